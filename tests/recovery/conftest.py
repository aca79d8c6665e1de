"""Failure recovery with real processes: workers are killed, stalled and cut off from their
broker or database, and every test counts the effects at the bank server's ledger.

Workers get short leases (tool timeout + LEASE_MARGIN_SECONDS) so a lost worker is noticed
within seconds; the tests play Celery beat by calling the sweeper themselves.
"""

from __future__ import annotations

import os
import time
from urllib.parse import urlparse

import httpx
import pytest
from django.conf import settings
from django.db import close_old_connections, connection
from django.db.utils import InterfaceError, OperationalError
from rest_framework.test import APIClient

from runs.models import Run, RunEvent, Step
from runs.recovery import sweeper
from tests import factories
from tests.servers import wait_for
from tests.services import Refused, ThrowawayPostgres, ThrowawayRedis
from tools.models import Tool, ToolServer

# Worker environment: a tool with timeout T holds a lease of T + 1 seconds.
FAST_LEASES = {"LEASE_MARGIN_SECONDS": "1", "QUEUED_TOO_LONG_SECONDS": "3"}


def client_for(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def db_retry(read, *, timeout: float = 60):
    """Read through a database restart: a broken connection is closed and the read retried."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return read()
        except (OperationalError, InterfaceError):
            if time.monotonic() > deadline:
                raise
            connection.close()
            time.sleep(0.5)


def run_of(run_id) -> Run:
    return db_retry(lambda: Run.objects.get(pk=run_id))


def step_of(run_id, seq: int) -> Step:
    return db_retry(lambda: Step.objects.get(run_id=run_id, seq=seq))


def sweep_until(predicate, *, timeout: float = 60, what: str = "condition"):
    """Play Celery beat: sweep every 0.3 s until predicate() is truthy."""

    def tick():
        db_retry(sweeper.sweep)
        return db_retry(predicate)

    return wait_for(tick, timeout=timeout, interval=0.3, what=what)


def until_status(run_id, *statuses: str, timeout: float = 60):
    return sweep_until(
        lambda: (r := Run.objects.get(pk=run_id)).status in statuses and r,
        timeout=timeout,
        what=f"run {run_id} in {statuses}",
    )


def until_dispatching(run_id, seq: int, *, attempt: int = 1, timeout: float = 30) -> Step:
    return wait_for(
        lambda: Step.objects.filter(run_id=run_id, seq=seq, status="dispatching", attempts=attempt).first(),
        timeout=timeout,
        what=f"step {seq} dispatching (attempt {attempt})",
    )


def events(run_id, kind: str | None = None) -> list[RunEvent]:
    found = RunEvent.objects.filter(run_id=run_id).order_by("id")
    return list(found.filter(kind=kind) if kind else found)


def http_bank_tool(
    tenant,
    bank,
    remote: str,
    *,
    effect_class: str,
    server_name: str = "bankhttp",
    status: bool = False,
    **fields,
) -> Tool:
    """One of the bank's tools through its plain HTTP adapter (declared, as tenants do for http)."""
    server, _ = ToolServer.objects.get_or_create(
        tenant=tenant, name=server_name, defaults={"kind": ToolServer.Kind.HTTP, "url": f"{bank.url}/http"}
    )
    # settle_seconds 0: the bank makes an accepted call visible at once (tests of the settle
    # window itself set one, with a provider that lags).
    values = {
        "enabled": True,
        "effect_class": effect_class,
        "timeout_seconds": 5,
        "price_micros": 1000,
        "input_schema": {"type": "object"},
        "backoff_seconds": 0.5,
        "settle_seconds": 0,
        **fields,
    }
    if status:
        values["status_url"] = f"{bank.url}/http/status/{{key}}"
    return Tool.objects.create(
        tenant=tenant, server=server, name=f"{server_name}__{remote}", remote_name=remote, **values
    )


def until_fault_taken(bank, tool: str, *, timeout: float = 30) -> None:
    """Wait until the bank has consumed every fault armed for `tool` (the request is in the server)."""
    wait_for(
        lambda: all(
            f["remaining"] == 0
            for f in httpx.get(f"{bank.url}/faults", timeout=10).json()["faults"]
            if f["tool"] == tool
        ),
        timeout=timeout,
        interval=0.05,
        what=f"{tool} request in the server",
    )


def single_call_agent(tenant, user, tool: Tool, arguments: dict, *, final: str = "done", **spec):
    """An agent that makes one tool call, then answers `final`."""
    factories.grant(tool, use=[user])
    return factories.make_agent(
        tenant,
        tools=[tool],
        turns=[{"tool_calls": [{"name": tool.name, "arguments": arguments}]}, {"text": final}],
        **spec,
    )


EMAIL = {"to": "c@example.com", "subject": "Your refund", "body": "Refunded."}
REFUND = {"transaction_id": "TXN-1002", "amount": 3200, "currency": "INR"}  # below the approval rule


@pytest.fixture
def fast_sweeps(settings):
    """The test plays beat: runs untouched for 3 s count as lost messages (as in the workers)."""
    settings.QUEUED_TOO_LONG_SECONDS = int(FAST_LEASES["QUEUED_TOO_LONG_SECONDS"])


@pytest.fixture
def supervisor(tenant):
    return factories.make_user(tenant, "meera", staff=True)


# --- infrastructure restarts: only of this session's own servers -----------------------------------
# The session must run on throwaway servers (`make test`, or `python -m tests.services -- pytest ...`):
# these helpers act on the servers named by THROWAWAY_POSTGRES / THROWAWAY_REDIS, and only when the
# test database and the broker are on them. The machine's PostgreSQL and Redis are never touched.


def broker_port() -> int:
    return urlparse(settings.CELERY_BROKER_URL).port or 6379


def session_redis() -> ThrowawayRedis:
    """The throwaway Redis this session's broker URL points at; refuses any other."""
    broker = ThrowawayRedis.from_env()
    if broker.port != broker_port():
        raise Refused(f"the broker is on port {broker_port()}, not on the throwaway Redis ({broker.port})")
    return broker


def session_postgres() -> ThrowawayPostgres:
    """The throwaway cluster serving the test database; refuses any other."""
    cluster = ThrowawayPostgres.from_env()
    port = int(connection.settings_dict["PORT"] or 5432)
    if cluster.port != port:
        raise Refused(f"the test database is on port {port}, not on the throwaway cluster ({cluster.port})")
    return cluster


@pytest.fixture
def own_services():
    """Skip (fail on CI) a test that restarts a server when the session does not run on its own servers."""
    try:
        return session_postgres(), session_redis()
    except Refused as exc:
        message = (
            f"restarts only throwaway servers; run through `make test` or `python -m tests.services`: {exc}"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def stop_redis() -> None:
    """Shut Redis down without saving: every queued message is gone."""
    session_redis().stop()


def start_redis() -> None:
    session_redis().start()


def restart_redis() -> None:
    """A real Redis restart with nothing persisted."""
    session_redis().restart()


def postgres(action: str) -> None:
    """start, stop, restart or kill the throwaway cluster that serves the test database."""
    cluster = session_postgres()
    connection.close()
    getattr(cluster, action)()
    close_old_connections()
    connection.close()


def restart_postgres() -> None:
    postgres("restart")
