"""Stop rules: every run is bounded in steps, tool calls, cost, output tokens and wall time."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from django.utils import timezone

from agents.spec import DEFAULT_LIMITS
from approvals.models import Approval
from budgets.models import Reservation
from llm import gateway
from llm.models import ModelEndpoint
from runs.engine import advance
from runs.models import Run, Step
from runs.recovery import sweeper
from runs.services import start_run
from tests import factories
from tests.budgets.conftest import assert_books_balance, openai_endpoint
from tests.conftest import drive
from tools import offer

pytestmark = pytest.mark.django_db(transaction=True)


def endless_agent(tenant, user, echo, *, name: str = "agent", **spec):
    """A model that calls echo with fresh arguments forever (no loop to detect)."""
    factories.grant(echo, use=[user])
    endpoint = ModelEndpoint.objects.filter(tenant=tenant, name="endless").first() or factories.make_endpoint(
        tenant, name="endless", config={"auto_tool": echo.name, "auto_tool_turns": 1000}
    )
    return factories.make_agent(tenant, name=name, endpoint=endpoint, tools=[echo], **spec)


def test_it_stops_at_max_steps(tenant, asha, builtins):
    endless_agent(tenant, asha, builtins["echo"], limits={"max_steps": 5})
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert (run.status, run.stop_reason, run.step_count) == ("stopped", "max_steps", 5)
    assert list(Step.objects.filter(run=run).values_list("status", flat=True)) == ["succeeded"] * 5 + [
        "skipped"
    ]
    assert_books_balance(tenant)


def test_it_stops_at_max_tool_calls(tenant, asha, builtins):
    endless_agent(tenant, asha, builtins["echo"], limits={"max_tool_calls": 2})
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert (run.status, run.stop_reason, run.tool_call_count) == ("stopped", "max_tool_calls", 2)
    assert Reservation.objects.filter(run=run, purpose="tool").count() == 2
    assert_books_balance(tenant)


def test_it_stops_when_the_run_budget_cannot_pay_for_the_next_call(tenant, asha, builtins):
    probe_version = endless_agent(tenant, asha, builtins["echo"], name="probe")
    probe = Run(tenant=tenant, created_by=asha, version=probe_version, input={}, limits=dict(DEFAULT_LIMITS))
    first_call = gateway.estimate_cost_micros(
        probe_version.model_endpoint, gateway.build_request(probe, [], offer.offered_tools(probe))
    )
    # The same agent with room for exactly one model call.
    endless_agent(tenant, asha, builtins["echo"], limits={"max_cost_micros": first_call})
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert (run.status, run.stop_reason) == ("stopped", "budget_exhausted")
    assert run.model_call_count == 1
    budget = run.budget
    assert budget.limit_micros == first_call
    assert 0 < budget.spent_micros <= budget.limit_micros and budget.reserved_micros == 0
    refusal = run.events.get(kind="budget", skeleton__decision="refused")
    assert refusal.data["scope"] == "run"
    assert_books_balance(tenant)


def test_it_sends_the_output_limit_to_the_provider_capped_by_the_tenant(tenant, asha, builtins, fake_openai):
    fake_openai.tool_turns = 2
    endpoint = openai_endpoint(tenant, fake_openai)
    factories.grant(builtins["echo"], use=[asha])
    factories.make_agent(
        tenant, name="asks", endpoint=endpoint, tools=[builtins["echo"]], limits={"max_output_tokens": 77}
    )
    factories.make_agent(tenant, name="defaults", endpoint=endpoint, tools=[builtins["echo"]])
    tenant.max_output_tokens_cap = 50
    tenant.save()

    first = drive(start_run(user=asha, agent="asks", input={})[0].pk)
    sent_first = [r["max_completion_tokens"] for r in fake_openai.requests]
    second = drive(start_run(user=asha, agent="defaults", input={"again": 1})[0].pk)
    sent_second = [r["max_completion_tokens"] for r in fake_openai.requests[len(sent_first) :]]
    assert first.status == second.status == "succeeded"
    assert sent_first == [50, 50, 50]  # the version asked for 77; the tenant's cap is 50
    assert sent_second == [50, 50, 50]  # no limit in the spec: the default 1024, capped
    assert first.limits["max_output_tokens"] == second.limits["max_output_tokens"] == 50


def test_a_spec_without_limits_gets_defaults_capped_by_the_tenant(tenant, asha):
    factories.make_agent(tenant, turns=[{"text": "done"}])
    tenant.max_steps_cap, tenant.max_tool_calls_cap, tenant.max_wall_seconds_cap = 10, 5, 3600
    tenant.max_cost_micros_cap = 500_000
    tenant.save()
    run, _ = start_run(user=asha, agent="agent", input={})
    assert run.limits == {
        "max_steps": 10,
        "max_tool_calls": 5,
        "max_wall_seconds": 3600,
        "max_output_tokens": DEFAULT_LIMITS["max_output_tokens"],
        "max_cost_micros": 500_000,
    }
    assert run.budget.limit_micros == 500_000
    assert abs((run.deadline_at - run.created_at).total_seconds() - 3600) < 5


def test_the_sweeper_stops_runs_past_their_deadline_even_when_waiting(tenant, asha, builtins):
    echo = builtins["echo"]
    echo.approval_policy = "always"
    echo.save()
    factories.grant(echo, use=[asha])
    factories.make_agent(
        tenant,
        tools=[echo],
        limits={"max_wall_seconds": 60},
        turns=[{"tool_calls": [{"name": echo.name, "arguments": {"x": 1}}]}, {"text": "done"}],
    )
    waiting = drive(start_run(user=asha, agent="agent", input={"w": 1})[0].pk)
    assert waiting.status == "waiting_approval"
    queued, _ = start_run(user=asha, agent="agent", input={"q": 1})  # never picked up by a worker

    assert sweeper.sweep(now=waiting.deadline_at - dt.timedelta(seconds=1))["deadlines"] == 0
    assert sweeper.sweep(now=queued.deadline_at + dt.timedelta(seconds=1))["deadlines"] == 2
    for run in (waiting, queued):
        run.refresh_from_db()
        assert (run.status, run.stop_reason) == ("stopped", "deadline")
    assert Approval.objects.get(run=waiting).status == "voided"
    assert Step.objects.get(run=waiting, seq=2).status == "skipped"
    assert_books_balance(tenant)


def test_a_deadline_that_passes_during_a_call_stops_the_run_after_it(tenant, asha):
    factories.make_agent(tenant, turns=[{"text": "done"}], limits={"max_wall_seconds": 60})
    run, _ = start_run(user=asha, agent="agent", input={})
    # A worker holds the run (mid-call) when the deadline passes.
    Run.objects.filter(pk=run.pk).update(
        status="running",
        lease_token=uuid.uuid4(),
        lease_expires_at=timezone.now() + dt.timedelta(seconds=60),
        deadline_at=timezone.now() - dt.timedelta(seconds=1),
    )
    assert sweeper.sweep()["deadlines"] == 0
    run.refresh_from_db()
    assert run.status == "running" and not run.cancel_requested, "nobody asked to cancel"
    Run.objects.filter(pk=run.pk).update(lease_token=None, lease_expires_at=None)  # the call ended
    advance(run.pk)
    run.refresh_from_db()
    assert (run.status, run.stop_reason) == ("stopped", "deadline")
