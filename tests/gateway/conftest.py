"""Fixtures for the tool gateway tests: the bank MCP server's tools, a recording model server."""

from __future__ import annotations

import httpx
import pytest

from runs.engine import advance
from runs.models import TERMINAL, WAITING, Run
from tests import factories
from tests.fakes.model_servers import FakeAnthropic

MODEL_KEY = "sk-ant-model-key-7f3e9a1c"


@pytest.fixture(scope="module")
def shared_bank():
    """One bank server process per module (starting one costs seconds); tests reset its ledger."""
    from tests.servers import BankServer

    server = BankServer().start()
    yield server
    server.stop()


@pytest.fixture
def bank(shared_bank):
    httpx.post(f"{shared_bank.url}/ledger/reset", timeout=10).raise_for_status()
    httpx.post(f"{shared_bank.url}/faults/reset", timeout=10).raise_for_status()
    return shared_bank


@pytest.fixture
def bank_tools(tenant, bank):
    return factories.make_bank_tools(tenant, bank.mcp_url)


@pytest.fixture
def claude(tenant):
    """A model server that records every request it is sent; replies are queued by the test."""
    from tenants.models import Secret

    fake = FakeAnthropic(api_key=MODEL_KEY)
    base_url = fake.start()
    secret = Secret(tenant=tenant, name="anthropic-key")
    secret.set_value(MODEL_KEY)
    secret.save()
    factories.make_endpoint(tenant, name="claude", kind="anthropic", base_url=base_url, secret=secret)
    yield fake
    fake.stop()


def advance_until(run_id, predicate, *, max_tasks: int = 50) -> Run:
    """Advance one task at a time until predicate(run) holds; stop early if the run settles."""
    for _ in range(max_tasks):
        run = Run.objects.get(pk=run_id)
        if predicate(run):
            return run
        if run.status in TERMINAL or run.status in WAITING:
            raise AssertionError(f"run settled in {run.status} before the condition held")
        advance(run_id)
    raise AssertionError(f"condition not reached after {max_tasks} tasks")


def tool_step_done(seq: int):
    """Predicate: the tool step with this seq has an outcome."""

    def done(run: Run) -> bool:
        step = run.steps.filter(seq=seq).first()
        return step is not None and step.status not in ("proposed", "approved", "dispatching")

    return done
