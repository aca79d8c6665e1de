# make demo   – set up and run the dispute story on embedded defaults (SQLite, in-process broker)
# make test   – set up, lint, and run the whole suite on throwaway PostgreSQL + Redis servers of its own
# make test-rabbitmq – the recovery tests again with RabbitMQ (quorum queues) as the broker
# make test-fast – the same without the slow recovery, end-to-end, browser and production-shape tests
# make lint   – ruff check, ruff format --check (make format rewrites) and mypy (mypy.ini)
# make serve  – production shape: PostgreSQL, Redis broker, uvicorn, celery worker + beat, flower
# make serve-regions – two regions on one machine: a home and a region away, each its own PostgreSQL, Redis
#   and serve.sh, authority replicated, a link to cut and heal (docs/regions.md)
# make bench  – benchmarks under bench/ (PostgreSQL + Redis)
# make bench-peers – the engine side by side with a plain Celery chain, LangGraph and DBOS (bench/peers.py)
# make selfhosted-check – probe and run agents on a real llama-cpp-python server and LiteLLM's proxy (docs/self-hosted.md)
VENV ?= .venv
PY := $(VENV)/bin/python
TEST_DATABASE_URL ?= postgres://root@127.0.0.1:5432/test
TEST_BROKER_URL ?= redis://127.0.0.1:6379/15
# pytest-xdist workers, each on a PostgreSQL cluster and a Redis of its own; most of the suite waits
# on workers, leases and servers rather than on the CPU, so four share two cores well (1 = serial).
TEST_WORKERS ?= 4
PYTEST := $(PY) -m tests.services --sets $(TEST_WORKERS) -- $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal
# The second pass: the recovery guarantees again with RabbitMQ (quorum queues) as the broker, each
# test in turn, on a RabbitMQ node of its own (a broker restart, workers killed and stalled
# mid-step, the dispute story end to end). Redis stays the cache and the quota counters.
RABBITMQ_TESTS := tests/recovery/test_rabbitmq.py tests/recovery/test_worker_crash.py \
	tests/recovery/test_stalled_worker.py tests/e2e/test_dispute_story.py
PYTEST_RABBITMQ := $(PY) -m tests.services --broker rabbitmq -- $(PY) -m pytest -q -p no:cacheprovider $(RABBITMQ_TESTS)

.PHONY: setup demo test test-fast test-rabbitmq rabbitmq lint format services browser sandbox serve serve-regions bench bench-peers chaos selfhosted-check

$(VENV)/.installed: requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -r requirements.txt
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) manage.py demo

# Starts the machine's PostgreSQL and Redis when they are down; never stops or restarts them.
services:
	bash scripts/ensure_services.sh

browser:
	bash scripts/ensure_browser.sh

# bubblewrap and the read-only sandbox runtime (pandas, numpy) the runner mounts (docs/sandbox.md)
sandbox: setup
	bash scripts/ensure_sandbox.sh

# The session runs on its own PostgreSQL clusters and Redis servers (initdb/pg_ctl and redis-server
# on free ports, removed afterwards): the recovery tests restart those, never the machine's.
rabbitmq:
	bash scripts/ensure_rabbitmq.sh

test: setup browser sandbox rabbitmq lint
	$(PYTEST)
	$(PYTEST_RABBITMQ)

test-rabbitmq: setup rabbitmq
	$(PYTEST_RABBITMQ)

test-fast: setup sandbox lint
	$(PYTEST) -m "not slow"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

serve: setup sandbox
	bash scripts/serve.sh

# Its own PostgreSQL clusters and Redis servers under $AGENTPLATFORM_VAR_DIR/regions (var/regions by default), on
# ports of their own (HOME_API_PORT, ...: docs/regions.md); the machine's 5432 and 6379 are not used.
serve-regions: setup sandbox
	bash scripts/serve_regions.sh

bench: setup services
	DATABASE_URL=$(TEST_DATABASE_URL) CELERY_BROKER_URL=$(TEST_BROKER_URL) $(PY) bench/run_all.py

# The peers are benchmark-only dependencies (bench/requirements.txt), installed into the same venv.
# PostgreSQL and Redis must be running (make services starts them). BENCH_ARGS, e.g. --runs 20 --rounds 1.
$(VENV)/.bench-installed: bench/requirements.txt $(VENV)/.installed
	$(VENV)/bin/pip install -q --disable-pip-version-check -r bench/requirements.txt
	touch $@

bench-peers: setup $(VENV)/.bench-installed
	DATABASE_URL=$(TEST_DATABASE_URL) CELERY_BROKER_URL=$(TEST_BROKER_URL) $(PY) bench/peers.py $(BENCH_ARGS)

# The chaos run starts (and restarts) its own PostgreSQL cluster and Redis.
chaos: setup
	$(PY) bench/chaos.py

# llama-cpp-python's server (Gemma 3 270M from PyPI) and LiteLLM's proxy from .venv-selfhosted (built
# once by scripts/selfhosted_venv.sh, about 15 minutes on two cores); prints the probes' reports.
.venv-selfhosted/.installed: requirements-selfhosted.txt
	bash scripts/selfhosted_venv.sh
	touch $@

selfhosted-check: setup .venv-selfhosted/.installed
	$(PY) -m tests.services --sets 1 -- $(PY) -m pytest -q -p no:cacheprovider -n 0 -s tests/e2e/test_self_hosted_server.py
