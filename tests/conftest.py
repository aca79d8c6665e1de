"""Test setup: real PostgreSQL and Redis. `make test` runs the session on throwaway servers of its own
(tests/services.py); the machine's PostgreSQL and Redis must come out of any session untouched."""

from __future__ import annotations

import os
import time

import pytest
from django.conf import settings
from django.utils import timezone

from runs.models import TERMINAL, WAITING, Run, RunStatus
from tests import factories
from tests.services import machine_services


@pytest.fixture(scope="session", autouse=True)
def _require_real_services():
    engine = settings.DATABASES["default"]["ENGINE"]
    if os.environ.get("CI") or os.environ.get("REQUIRE_POSTGRES", "1") == "1":
        assert "postgresql" in engine, f"tests must run on PostgreSQL, not {engine}: use `make test`"


@pytest.fixture(scope="session", autouse=True)
def _machine_services_untouched():
    """Other users share the machine's PostgreSQL (5432) and Redis (6379): no test may restart them."""
    before = machine_services()
    yield
    after = machine_services()
    changed = [
        f"{name}: {before[name]} -> {after[name]}"
        for name in before
        if before[name] is not None and after[name] != before[name]
    ]
    if changed:
        pytest.fail(
            "the machine's services were restarted or stopped during the tests: " + "; ".join(changed)
        )


@pytest.fixture(scope="session", autouse=True)
def _drop_content_key_store(django_db_setup, django_db_blocker):
    """The content key store (vault/store.py) is a database beside the test database, made on first
    use: dropped with it."""
    yield
    from vault import store

    with django_db_blocker.unblock():
        store.drop_database()


@pytest.fixture(autouse=True)
def _purge_broker():
    """Unit tests drive runs in-process; drop the messages their commits sent to the broker.

    Before the test too: the sweeper reads the queue's oldest message (runs/recovery/broker.py),
    so a message left by anything that published after the last test's teardown (a worker still
    stopping, a late on-commit) would make a test's lost run look merely queued behind it.
    """
    _empty_queue()
    yield
    _empty_queue()


def _empty_queue() -> None:
    if settings.CELERY_BROKER_URL.startswith("redis"):
        import redis

        redis.Redis.from_url(settings.CELERY_BROKER_URL).delete(settings.CELERY_TASK_DEFAULT_QUEUE)


@pytest.fixture(autouse=True)
def _clear_rate_limits():
    """Rate limits count in the cache (local memory in tests): each test starts with none used."""
    from django.core.cache import cache

    cache.clear()


@pytest.fixture(autouse=True)
def _forget_signing_key():
    """A process keeps the signing key it read for a few seconds (authority/keys.py): a test's
    database starts without the previous test's key."""
    from authority import keys

    keys._current.clear()


@pytest.fixture(autouse=True)
def _forget_leases():
    """A worker process's heartbeat thread extends every lease it was given until the step lets it
    go (runs/engine/heartbeat.py); a test that claims a run and stops there would have the thread
    go on updating that run in the next tests' database, on a connection of its own."""
    yield
    from runs.engine import heartbeat

    for run_id in list(heartbeat._active):
        heartbeat.untrack(run_id)


@pytest.fixture
def tenant(db):
    return factories.make_tenant()


@pytest.fixture
def asha(tenant):
    return factories.make_user(tenant, "asha")


@pytest.fixture
def ravi(tenant):
    return factories.make_user(tenant, "ravi", staff=True)


@pytest.fixture
def builtins(tenant):
    return factories.make_builtin_tools(tenant)


def drive(run_id, *, max_tasks: int = 200, settle_wait: float = 10) -> Run:
    """Run the engine in-process until the run ends or waits (what a worker would do).

    A settle window that ends within `settle_wait` seconds is waited out and the run woken as the
    sweeper would; a longer one is returned like any other wait.
    """
    from runs.engine import advance
    from runs.recovery.sweeper import sweep

    for _ in range(max_tasks):
        advance(run_id)
        run = Run.objects.get(pk=run_id)
        if (
            run.status == RunStatus.WAITING_SETTLE
            and (run.resume_at - timezone.now()).total_seconds() <= settle_wait
        ):
            time.sleep(max((run.resume_at - timezone.now()).total_seconds(), 0) + 0.01)
            sweep()
            continue
        if run.status in TERMINAL or run.status in WAITING:
            return run
        step = run.steps.filter(next_attempt_at__isnull=False).order_by("-seq").first()
        if step and step.next_attempt_at > timezone.now():
            time.sleep(min((step.next_attempt_at - timezone.now()).total_seconds(), 5) + 0.01)
    raise AssertionError(f"run {run_id} did not settle after {max_tasks} tasks: {run.status}")


@pytest.fixture
def bank():
    from tests.servers import BankServer

    server = BankServer().start()
    yield server
    server.stop()


@pytest.fixture
def workers(transactional_db):
    """Start real Celery worker processes on demand; all are stopped after the test."""
    from tests.servers import Worker

    started: list[Worker] = []

    def start(name: str = "w1", *, ready_within: float = 60, **kwargs) -> Worker:
        worker = Worker(name, **kwargs)
        started.append(worker)  # before it starts: a start that fails must still be stopped
        return worker.start(ready_within)

    yield start
    for worker in started:
        worker.stop()


# `make test-fast` leaves these out: they start and kill worker processes, restart services, drive a
# browser or run the production shape, and take most of the suite's time.
SLOW_PATHS = (
    "tests/recovery/",
    "tests/e2e/",
    "tests/test_production_shape.py",
    "tests/api/test_schemathesis.py",
    "tests/stream/test_stream_live.py",
    "tests/stream/test_idle_streams.py",
)


def pytest_collection_modifyitems(config, items):
    root = str(config.rootpath)
    for item in items:
        path = str(item.path).removeprefix(root + os.sep)
        if path.startswith(SLOW_PATHS) or path.endswith("_browser.py"):
            item.add_marker(pytest.mark.slow)
