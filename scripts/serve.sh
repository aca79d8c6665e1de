#!/usr/bin/env bash
# Production shape on one machine: uvicorn (API + admin, ASGI), celery worker, celery beat, flower,
# and the sandbox runner. Configure with environment variables (see README "Configuration" and
# "Production shape"); defaults target local services. Started as root, every process but the
# sandbox runner runs as SERVE_USER (scripts/service_user.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# shellcheck source=scripts/service_user.sh
. scripts/service_user.sh
export DATABASE_URL=${DATABASE_URL:-postgres://root@127.0.0.1:5432/agentplatform}
# RabbitMQ (quorum queues) is the production broker: it cost least per step in bench/peers.py and
# keeps its messages through its own restarts (docs/operations.md "The broker"); Redis is the cache
# and the quota counters, and stays supported as the broker (CELERY_BROKER_URL=redis://...).
export CELERY_BROKER_URL=${CELERY_BROKER_URL:-amqp://guest:guest@127.0.0.1:5672//}
case "$CELERY_BROKER_URL" in
  redis*) ;;
  *) export CACHE_URL=${CACHE_URL:-redis://127.0.0.1:6379/0} ;;
esac
export DB_POOL_MAX=${DB_POOL_MAX:-20}
# Absolute: the services may run from another directory (SERVICE_DIR, scripts/service_user.sh).
AGENTPLATFORM_VAR_DIR=${AGENTPLATFORM_VAR_DIR:-var}
mkdir -p "$AGENTPLATFORM_VAR_DIR"
export AGENTPLATFORM_VAR_DIR=$(realpath "$AGENTPLATFORM_VAR_DIR")
# Each process writes its counters here and /metrics adds them up; stale files from an earlier
# start would be added too, so the directory is emptied first.
export PROMETHEUS_MULTIPROC_DIR=${PROMETHEUS_MULTIPROC_DIR:-$AGENTPLATFORM_VAR_DIR/prometheus}
BIND=${BIND:-127.0.0.1:8000}
FLOWER_PORT=${FLOWER_PORT:-5555}
export FLOWER_URL=${FLOWER_URL:-http://127.0.0.1:$FLOWER_PORT}
WORKER_CONCURRENCY=${WORKER_CONCURRENCY:-128}
WEB_WORKERS=${WEB_WORKERS:-2}
SANDBOX_RUNNER_PORT=${SANDBOX_RUNNER_PORT:-8790}
export SANDBOX_RUNNER_URL=${SANDBOX_RUNNER_URL:-http://127.0.0.1:$SANDBOX_RUNNER_PORT}
SANDBOX_RUNNER_TOKEN_FILE=${SANDBOX_RUNNER_TOKEN_FILE:-$AGENTPLATFORM_VAR_DIR/sandbox-runner.token}
QUEUE=${CELERY_QUEUE:-runs}
SWEEP_QUEUE=${CELERY_SWEEP_QUEUE:-$QUEUE.sweeper}

case "$DATABASE_URL" in postgres*) ;; *) echo "serve needs PostgreSQL (DATABASE_URL)"; exit 2;; esac
case "$CELERY_BROKER_URL" in redis*|amqp*) ;; *) echo "serve needs Redis or RabbitMQ (CELERY_BROKER_URL)"; exit 2;; esac

dbname=${DATABASE_URL##*/}; dbname=${dbname%%\?*}
psql "${DATABASE_URL%/*}/postgres" -tAc "SELECT 1 FROM pg_database WHERE datname='$dbname'" | grep -q 1 \
  || psql "${DATABASE_URL%/*}/postgres" -c "CREATE DATABASE \"$dbname\"" >/dev/null

mkdir -p "$AGENTPLATFORM_VAR_DIR"
rm -rf "$PROMETHEUS_MULTIPROC_DIR" && mkdir -p "$PROMETHEUS_MULTIPROC_DIR"
$PY manage.py migrate --noinput
$PY manage.py collectstatic --noinput -v 0
production=$(DJANGO_SETTINGS_MODULE=agentplatform.settings $PY -c "from django.conf import settings as s; print('production' if s.PRODUCTION else 'development')")

# Who the services run as (root only for the sandbox runner), and what they may write.
choose_service_user "$production"
mkdir -p "$AGENTPLATFORM_VAR_DIR/beat"
give_to_service_user "$PROMETHEUS_MULTIPROC_DIR" "$AGENTPLATFORM_VAR_DIR/beat"
if [ ${#service_prefix[@]} -gt 0 ] && [ "$production" = development ]; then
  # Development's generated secrets are root's files (mode 0600): handed over in the environment.
  export SECRET_KEY=${SECRET_KEY:-$(cat "$AGENTPLATFORM_VAR_DIR/django-secret.key")}
  export SECRET_ENCRYPTION_KEYS=${SECRET_ENCRYPTION_KEYS:-$(cat "$AGENTPLATFORM_VAR_DIR/encryption.key")}
fi
# The sandbox runner's shared secret (docs/sandbox.md): made once, kept in a file only root reads;
# the platform's processes get it in their environment.
if [ ! -s "$SANDBOX_RUNNER_TOKEN_FILE" ]; then
  (umask 077 && $PY -c "import secrets; print(secrets.token_urlsafe(32))" > "$SANDBOX_RUNNER_TOKEN_FILE")
fi
export SANDBOX_RUNNER_TOKEN=${SANDBOX_RUNNER_TOKEN:-$(cat "$SANDBOX_RUNNER_TOKEN_FILE")}
as_service() { (cd "$SERVICE_DIR" && exec "${service_prefix[@]}" "$@"); }

pids=()
# Each process's lines start with its name (web, worker, beat, flower): one terminal, four processes.
named() { sed -u "s/^/$1 | /"; }
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait || true; }
# A signal exits (then EXIT cleans up) rather than returning to where it arrived: during start-up that
# was the wait for the worker and Flower below, which went on waiting after every process had stopped.
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ASGI, so that live run streams (/v1/runs/{id}/stream) wait on the event loop, holding no thread
# and no database connection each (agentplatform/asgi.py). uvicorn supervises its worker processes
# (a dead one is replaced). No proxy headers here: Django reads X-Forwarded-Proto
# (SECURE_PROXY_SSL_HEADER) and X-Forwarded-For (TRUSTED_PROXY_COUNT) itself. Open streams get 10 s
# to end at shutdown; clients resume with Last-Event-ID.
as_service "$SERVICE_PY" -m uvicorn agentplatform.asgi:application --host "${BIND%:*}" --port "${BIND##*:}" \
  --workers "$WEB_WORKERS" --no-proxy-headers --timeout-graceful-shutdown 10 > >(named "web   ") 2>&1 & pids+=($!)
# Threads: steps spend their time waiting on models and tools, and the engine returns its
# pooled database connection before every call, so one process keeps many runs in flight
# (128: docs/performance.md). The sweeper's queue is consumed too, by the same workers.
# No gossip or mingle: the platform coordinates through PostgreSQL, not between workers, and
# gossip's Redis pub/sub consumer is one more way a Redis restart reaches kombu's close bug
# (agentplatform/celery.py). Heartbeats stay (Flower sees the worker by them) and task events
# are on from the start, not only once Flower's periodic broadcast reaches a new worker.
# DB_POOL_CHECK=0: no connection check per checkout (agentplatform/settings.py says why that is safe here).
as_service env DB_POOL_CHECK="${WORKER_DB_POOL_CHECK:-0}" "$SERVICE_PY" -m celery -A agentplatform worker -P threads -c "$WORKER_CONCURRENCY" -Q "$QUEUE,$SWEEP_QUEUE" \
  --without-gossip --without-mingle --task-events --loglevel INFO > >(named "worker") 2>&1 & pids+=($!)
# The sandbox runner (run_python; docs/sandbox.md): a process of its own that re-executes itself
# with a cleared environment, so it holds no database URL, broker URL or secret. It needs root
# (cgroups, per-slot uids) and its runtime; without either the platform serves without run_python
# (it answers "the sandbox runner is not running") rather than starting a runner that exits and
# takes the stack down with it.
sandbox_backend=${SANDBOX_BACKEND:-bubblewrap}
sandbox_args=(--backend "$sandbox_backend")
[ -z "${SANDBOX_RUNTIME:-}" ] || sandbox_args+=(--runtime "$(realpath -m "$SANDBOX_RUNTIME")")
# Two runners on one machine need slot uids apart (scripts/serve_regions.sh gives each region its own).
[ -z "${SANDBOX_UID_BASE:-}" ] || sandbox_args+=(--uid-base "$SANDBOX_UID_BASE")
if [ "$(id -u)" != 0 ]; then
  run_python="off: the sandbox runner needs root (docs/sandbox.md)"
elif ! why=$($PY -m sandbox.runner --check "${sandbox_args[@]}" 2>&1); then
  run_python="off: ${why##*$'\n'} (scripts/ensure_sandbox.sh installs the runtime; docs/sandbox.md)"
else
  run_python="on ($sandbox_backend)"
  $PY -m sandbox.runner --port "$SANDBOX_RUNNER_PORT" "${sandbox_args[@]}" \
    --token-file "$(realpath "$SANDBOX_RUNNER_TOKEN_FILE")" > >(named "sandbox") 2>&1 & pids+=($!)
fi
case "$run_python" in off*) echo "sandbox runner not started, serving without run_python: ${run_python#off: }" >&2;; esac
# Beat and Flower record no platform metrics: kept out of the shared directory. Beat at WARNING:
# at INFO it says "Sending due task" for the sweeper and notify every few seconds, and nothing else.
as_service env -u PROMETHEUS_MULTIPROC_DIR "$SERVICE_PY" -m celery -A agentplatform beat --loglevel WARNING \
  --schedule "$AGENTPLATFORM_VAR_DIR/beat/celerybeat-schedule" > >(named "beat  ") 2>&1 & pids+=($!)
as_service env -u PROMETHEUS_MULTIPROC_DIR "$SERVICE_PY" -m celery -A agentplatform flower --port="$FLOWER_PORT" --address=127.0.0.1 \
  > >(named "flower") 2>&1 & pids+=($!)

# The last lines of the start-up output: where everything is, once the API answers.
host=${BIND%:*}; port=${BIND##*:}
case "$host" in 0.0.0.0|"") host=127.0.0.1;; esac
base="http://$host:$port"
ready=$($PY - "$base" <<'EOF'
import sys, time
import httpx
for _ in range(120):
    try:
        body = httpx.get(sys.argv[1] + "/readyz", timeout=5).json()
        if body["status"] == "ready":
            break
    except (httpx.HTTPError, ValueError):
        body = {"status": "not answering"}
    time.sleep(0.5)
print(body["status"] if body["status"] == "ready" else f"{body['status']}: {body.get('checks', '')}")
EOF
)
# The worker's and Flower's banners come a few seconds after the API answers: wait for both, so
# the URLs below are the last lines of the start-up output.
for _ in $(seq 20); do
  $PY -m celery -A agentplatform inspect ping --timeout 1 >/dev/null 2>&1 && break
done
$PY - "http://127.0.0.1:$FLOWER_PORT/healthcheck" <<'EOF' || true
import sys, time
import httpx
for _ in range(60):
    try:
        if httpx.get(sys.argv[1], timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
EOF
sleep 1  # their last start-up lines are flushed through the name prefixes
mode=$(DJANGO_SETTINGS_MODULE=agentplatform.settings $PY -c "from django.conf import settings as s; print('production' if s.PRODUCTION else 'development: DEBUG is ' + ('on, and a 404 page lists every URL' if s.DEBUG else 'off'))" 2>/dev/null || echo unknown)
[ "$mode" = production ] || mode="$mode (production mode locally: README, first screen)"
shown_db=$(printf '%s' "$DATABASE_URL" | sed -E 's#(://[^:/@]*):[^@]*@#\1:***@#')
cat <<EOF

== agent platform started ($ready); Ctrl-C stops every process
   mode       $mode
   API        $base/v1/         OpenAPI docs: $base/v1/docs
   admin      $base/admin/
   health     $base/healthz     readiness: $base/readyz
   metrics    $base/metrics     (Prometheus; protect with METRICS_TOKEN or METRICS_ALLOW_FROM)
   Flower     http://127.0.0.1:$FLOWER_PORT/
   sandbox    $SANDBOX_RUNNER_URL/healthz  (run_python: $run_python)
   processes  web, worker, beat, Flower as $([ ${#service_prefix[@]} -gt 0 ] && echo "$SERVE_USER" || id -un); sandbox runner as root
== first operator (a superuser with no tenant: sees every tenant in the admin), from another shell
   with the same environment (DATABASE_URL=$shown_db, and in production SECRET_KEY and
   SECRET_ENCRYPTION_KEYS):
   $PY manage.py createsuperuser --username ops
== apply a tenant: users, model endpoints, tools, agents (format: docs/configuration.md):
   $PY manage.py apply examples/dispute.yaml   (the example needs BANK_MCP_URL: python examples/bank_server.py)
EOF
wait -n "${pids[@]}"
