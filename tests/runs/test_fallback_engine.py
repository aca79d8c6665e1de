"""Fallback endpoints and circuit breakers through the engine, driven in-process against fake
OpenAI-compatible servers on 127.0.0.1 (the worker-process versions: tests/e2e/test_fallback_e2e.py)."""

from __future__ import annotations

import socket
from decimal import Decimal

import pytest

from budgets.models import BudgetAccount, Reservation
from llm import gateway
from llm.models import EndpointCircuit
from llm.types import Usage
from runs.engine import advance
from runs.models import Run, Step
from runs.services import start_run
from tests import factories
from tests.conftest import drive
from tests.fakes.model_servers import FakeOpenAI

pytestmark = pytest.mark.django_db(transaction=True)

CHEAP = {"price_input": Decimal("1"), "price_cached_input": Decimal("0.1"), "price_output": Decimal("2")}
DEAR = {"price_input": Decimal("10"), "price_cached_input": Decimal("1"), "price_output": Decimal("40")}


def closed_port() -> int:
    """A loopback port nothing listens on: connecting to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def backup_fake():
    fake = FakeOpenAI(tool_turns=1, min_cacheable_tokens=0)
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture
def primary_fake():
    fake = FakeOpenAI(tool_turns=1, min_cacheable_tokens=0)
    fake.start()
    yield fake
    fake.stop()


def _agent(tenant, builtins, primary_url, backup_url, *, fallbacks=None, breaker_failures=5, **spec):
    primary = factories.make_endpoint(
        tenant,
        name="primary",
        kind="openai",
        base_url=primary_url,
        timeout_seconds=2,
        breaker_failures=breaker_failures,
        **CHEAP,
    )
    backup = factories.make_endpoint(tenant, name="backup", kind="openai", base_url=backup_url, **DEAR)
    factories.grant(builtins["echo"], use=list(tenant.users.all()))
    factories.make_agent(
        tenant,
        tools=[builtins["echo"]],
        endpoint=primary,
        fallbacks=fallbacks if fallbacks is not None else [{"model": "backup"}],
        **spec,
    )
    return primary, backup


def _priced(endpoint, step) -> int:
    return gateway.cost_micros(endpoint, Usage(**step.usage))


def test_a_refused_primary_moves_the_call_to_the_fallback_at_its_prices(tenant, asha, builtins, backup_fake):
    primary, backup = _agent(tenant, builtins, f"http://127.0.0.1:{closed_port()}/v1", backup_fake.base_url)
    run, _ = start_run(user=asha, agent="agent", input={"message": "echo once"})
    run = drive(run.pk)
    assert run.status == "succeeded", run.error
    steps = list(Step.objects.filter(run=run, kind="model").order_by("seq"))
    # the refused call on the primary, then the fallback; move_back tries the primary again
    assert [(s.model_endpoint_id, s.status, s.error_class) for s in steps] == [
        (primary.pk, "failed", "server_error"),
        (backup.pk, "succeeded", ""),
        (primary.pk, "failed", "server_error"),
        (backup.pk, "succeeded", ""),
    ]
    for step in steps:
        assert step.request["endpoint"] == (
            backup.name if step.model_endpoint_id == backup.pk else primary.name
        )
        if step.status == "succeeded":
            assert step.cost_micros == _priced(backup, step) > _priced(primary, step)
            # reserved at the fallback's prices, not the primary's
            assert step.reserved_micros >= step.cost_micros
    assert len(backup_fake.requests) == 2
    moves = list(run.events.filter(kind="model_fallback").order_by("seq").values_list("data", flat=True))
    assert [(m["from_endpoint"], m["to_endpoint"], m["reason"]) for m in moves] == [
        ("primary", "backup", "server_error"),
        ("backup", "primary", "moved_back"),
        ("primary", "backup", "server_error"),
    ]
    run.budget.refresh_from_db()
    assert run.budget.spent_micros == sum(s.cost_micros for s in Step.objects.filter(run=run))
    assert run.budget.reserved_micros == 0 and run.budget.held_micros == 0


def test_503s_with_retry_after_move_at_once_and_move_back_false_stays(
    tenant, asha, builtins, primary_fake, backup_fake
):
    primary_fake.outage = {"fault": "503", "retry_after": 120}
    primary, backup = _agent(
        tenant,
        builtins,
        primary_fake.base_url,
        backup_fake.base_url,
        fallbacks=[{"model": "backup", "move_back": False}],
    )
    run, _ = start_run(user=asha, agent="agent", input={"message": "echo once"})
    run = drive(run.pk)  # a 120 s Retry-After would outlast drive: the move is immediate
    assert run.status == "succeeded", run.error
    steps = list(Step.objects.filter(run=run, kind="model").order_by("seq"))
    assert [s.model_endpoint_id for s in steps] == [primary.pk, backup.pk, backup.pk]
    assert len(primary_fake.requests) == 1 and len(backup_fake.requests) == 2


def test_429s_are_retried_on_the_primary_before_they_move(tenant, asha, builtins, primary_fake, backup_fake):
    primary_fake.queue({"fault": "429", "retry_after": 0}, {"fault": "429", "retry_after": 0})
    primary_fake.outage = None
    primary, backup = _agent(
        tenant,
        builtins,
        primary_fake.base_url,
        backup_fake.base_url,
        fallbacks=[{"model": "backup", "on": ["rate_limited"], "rate_limit_retries": 1}],
    )
    run, _ = start_run(user=asha, agent="agent", input={"message": "echo once"})
    run = drive(run.pk)
    assert run.status == "succeeded", run.error
    steps = list(Step.objects.filter(run=run, kind="model").order_by("seq"))
    assert [(s.model_endpoint_id, s.error_class) for s in steps][:3] == [
        (primary.pk, "rate_limited"),
        (primary.pk, "rate_limited"),
        (backup.pk, ""),
    ]


def test_a_timeout_keeps_its_charge_held_while_the_fallback_answers(
    tenant, asha, builtins, primary_fake, backup_fake
):
    primary_fake.outage = {"fault": "timeout", "seconds": 4}  # the endpoint's timeout is 2 s
    primary, backup = _agent(
        tenant,
        builtins,
        primary_fake.base_url,
        backup_fake.base_url,
        fallbacks=[{"model": "backup", "move_back": False}],
    )
    run, _ = start_run(user=asha, agent="agent", input={"message": "echo once"})
    run = drive(run.pk)
    assert run.status == "succeeded", run.error
    lost = Step.objects.get(run=run, seq=1)
    assert (lost.status, lost.error_class, lost.model_endpoint_id) == (
        "outcome_unknown",
        "timeout",
        primary.pk,
    )
    # the lost call may have been billed: its reservation stays held, the fallback's are settled
    assert Reservation.objects.get(step=lost).status == Reservation.Status.HELD
    run.budget.refresh_from_db()
    assert run.budget.held_micros == lost.reserved_micros > 0
    answered = Step.objects.filter(run=run, kind="model", status="succeeded")
    assert run.budget.spent_micros == sum(s.cost_micros for s in Step.objects.filter(run=run))
    assert all(s.model_endpoint_id == backup.pk for s in answered)


def test_a_prompt_too_long_for_the_primary_goes_to_a_fallback_that_takes_it(
    tenant, asha, builtins, primary_fake, backup_fake
):
    primary_fake.outage = {"fault": "context_too_long"}
    primary, backup = _agent(
        tenant,
        builtins,
        primary_fake.base_url,
        backup_fake.base_url,
        fallbacks=[{"model": "backup", "on": ["context_too_long"], "move_back": False}],
    )
    run, _ = start_run(user=asha, agent="agent", input={"message": "echo once"})
    run = drive(run.pk)
    assert run.status == "succeeded", run.error
    first = Step.objects.get(run=run, seq=1)
    assert (first.status, first.error_class) == ("failed", "context_too_long")


def test_without_a_fallback_that_takes_it_a_refusal_still_fails_the_run(
    tenant, asha, builtins, primary_fake, backup_fake
):
    primary_fake.outage = {"fault": "context_too_long"}
    _agent(
        tenant,
        builtins,
        primary_fake.base_url,
        backup_fake.base_url,
        fallbacks=[{"model": "backup", "on": ["server_error"]}],
    )
    run, _ = start_run(user=asha, agent="agent", input={"message": "echo once"})
    run = drive(run.pk)
    assert run.status == "failed" and "maximum context length" in run.error
    assert backup_fake.requests == []


def test_a_budget_that_cannot_carry_the_fallback_stops_the_run_before_it_is_sent(
    tenant, asha, builtins, backup_fake
):
    _agent(
        tenant,
        builtins,
        f"http://127.0.0.1:{closed_port()}/v1",
        backup_fake.base_url,
        # enough for the primary's worst case (about 2,100 micros), not for the fallback's (about 41,000)
        limits={"max_cost_micros": 20_000, "max_output_tokens": 1000},
    )
    run, _ = start_run(user=asha, agent="agent", input={"message": "echo once"})
    run = drive(run.pk)
    assert run.status == "stopped" and run.stop_reason == "budget_exhausted"
    assert "for the fallback endpoint backup, reserved at its own prices" in run.error
    assert backup_fake.requests == []
    account = BudgetAccount.objects.get(run=run)
    assert account.spent_micros == account.reserved_micros == account.held_micros == 0
    assert run.events.filter(kind="model_fallback").count() == 1


def test_an_open_circuit_with_no_fallback_left_waits_without_sending(
    tenant, asha, builtins, primary_fake, backup_fake
):
    primary_fake.outage = {"fault": "503"}
    primary, backup = _agent(
        tenant, builtins, primary_fake.base_url, backup_fake.base_url, fallbacks=[], breaker_failures=2
    )
    first, _ = start_run(user=asha, agent="agent", input={"message": "one"})
    advance(first.pk)
    advance(first.pk)
    assert EndpointCircuit.objects.get(pk=primary.pk).state == "open"
    assert len(primary_fake.requests) == 2
    opened = Run.objects.get(pk=first.pk).events.get(kind="circuit")
    assert opened.data == {"endpoint": "primary", "state": "open"}
    # the next call (of this run or another) is not sent: the run waits, holding no reservation
    second, _ = start_run(user=asha, agent="agent", input={"message": "two"})
    advance(second.pk)
    assert len(primary_fake.requests) == 2
    second = Run.objects.get(pk=second.pk)
    assert second.status == "running" and second.lease_token is None
    wait = second.events.get(kind="circuit_open")
    assert wait.data["endpoints"] == ["primary"] and 0 < wait.data["seconds"] <= 30
    assert not Step.objects.filter(run=second).exists()
    assert not Reservation.objects.filter(run=second, status=Reservation.Status.OPEN).exists()
