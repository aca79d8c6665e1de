"""Races, redeliveries, stale workers and cancellation against real PostgreSQL."""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest
from django.db import connection

from runs import engine
from runs.engine.claim import claim
from runs.engine.model_step import do_model
from runs.engine.tool_step import do_tool
from runs.models import Run, RunEvent, RunStatus, Step, StepStatus
from runs.queueing import lease_seconds_for
from runs.services import cancel_run, start_run
from tests import factories
from tests.conftest import drive
from tests.servers import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def _email_agent(tenant, asha, bank):
    tools = factories.make_bank_tools(tenant, bank.mcp_url)
    email = tools["send_customer_email"]
    factories.grant(email, use=[asha])
    factories.make_agent(
        tenant,
        tools=[email],
        turns=[
            {
                "tool_calls": [
                    {"name": email.name, "arguments": {"to": "c@example.com", "subject": "s", "body": "b"}}
                ]
            },
            {"text": "sent"},
        ],
    )
    return email


def test_it_executes_each_step_once_when_eight_workers_race_on_one_run(tenant, asha, bank):
    _email_agent(tenant, asha, bank)
    run, _ = start_run(user=asha, agent="agent", input={"q": 1})
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        try:
            for _ in range(40):
                engine.advance(run.pk)
                if Run.objects.get(pk=run.pk).is_terminal:
                    return
                time.sleep(0.01)
        finally:
            connection.close()

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    assert len(bank.effects("send_customer_email")) == 1
    steps = list(Step.objects.filter(run=run).order_by("seq"))
    assert [s.kind for s in steps] == ["model", "tool", "model"]
    assert all(s.attempts == 1 for s in steps)


def test_it_treats_a_redelivered_message_as_a_no_op(tenant, asha, builtins):
    factories.grant(builtins["echo"], use=[asha])
    factories.make_agent(
        tenant,
        tools=[builtins["echo"]],
        turns=[{"tool_calls": [{"name": builtins["echo"].name, "arguments": {"x": 1}}]}, {"text": "ok"}],
    )
    run, _ = start_run(user=asha, agent="agent", input={})
    plan = claim(run.pk)  # a worker holds the lease for the first model call
    assert plan is not None
    before = (Step.objects.count(), RunEvent.objects.filter(run=run).count())
    engine.advance(run.pk)  # the same message delivered again
    assert (Step.objects.count(), RunEvent.objects.filter(run=run).count()) == before
    do_model(plan)
    run = drive(run.pk)
    assert run.status == RunStatus.SUCCEEDED
    events = RunEvent.objects.filter(run=run).count()
    engine.advance(run.pk)  # redelivered after the end
    assert RunEvent.objects.filter(run=run).count() == events
    assert Step.objects.filter(run=run).count() == 3


def test_it_fences_out_a_stale_worker_whose_lease_was_taken_over(tenant, asha, builtins):
    sleep = builtins["sleep"]
    factories.grant(sleep, use=[asha])
    factories.make_agent(
        tenant,
        tools=[sleep],
        turns=[{"tool_calls": [{"name": sleep.name, "arguments": {"seconds": 5}}]}, {"text": "ok"}],
    )
    run, _ = start_run(user=asha, agent="agent", input={})
    engine.advance(run.pk)  # model step proposes the tool call
    stale = threading.Thread(target=lambda: (engine.advance(run.pk), connection.close()))
    stale.start()
    step = wait_for(
        lambda: Step.objects.filter(run=run, seq=2, status=StepStatus.DISPATCHING).first(), timeout=10
    )
    # The claim leased the run until dispatched_at + the lease (one `now`); the stale worker's
    # heartbeat extends that once, later: then it is known to be alive and ticking, and its next
    # tick is a third of a lease away. (Compared with the claim's own value, not with a first read,
    # which a tick landing before it would already include.)
    claimed_until = step.dispatched_at + dt.timedelta(seconds=lease_seconds_for(sleep.timeout_seconds))
    wait_for(
        lambda: (Run.objects.get(pk=run.pk).lease_expires_at or claimed_until) > claimed_until,
        timeout=10,
        interval=0.02,
        what="the stale worker's heartbeat",
    )
    Run.objects.filter(pk=run.pk).update(lease_expires_at="2000-01-01T00:00:00Z")
    engine.advance(run.pk)  # the new owner takes over and re-runs the read-only call
    stale.join(30)
    step = Step.objects.get(run=run, seq=2)
    assert step.status == StepStatus.SUCCEEDED
    assert step.attempts == 2
    late = RunEvent.objects.filter(run=run, kind="late_attempt")
    assert late.count() == 1 and late.first().step_seq == 2
    assert drive(run.pk).status == RunStatus.SUCCEEDED


def test_it_starts_no_call_after_a_cancel_during_a_long_tool_call(tenant, asha, builtins, workers):
    sleep = builtins["sleep"]
    factories.grant(sleep, use=[asha])
    factories.make_agent(
        tenant,
        tools=[sleep],
        turns=[{"tool_calls": [{"name": sleep.name, "arguments": {"seconds": 3}}]}, {"text": "never said"}],
    )
    workers("w1")
    run, _ = start_run(user=asha, agent="agent", input={})
    wait_for(lambda: Step.objects.filter(run=run, seq=2, status=StepStatus.DISPATCHING).exists(), timeout=30)
    cancel_run(run_id=run.pk, actor=asha, reason="customer withdrew")
    run = wait_for(lambda: (r := Run.objects.get(pk=run.pk)).is_terminal and r, timeout=30)
    assert run.status == RunStatus.CANCELLED
    assert Step.objects.filter(run=run, kind="model").count() == 1
    assert Step.objects.get(run=run, seq=2).status == StepStatus.SUCCEEDED  # the call in flight finished


def test_it_cancels_a_queued_run_before_any_call(tenant, asha, builtins):
    factories.make_agent(tenant, tools=[], turns=[{"text": "hi"}])
    run, _ = start_run(user=asha, agent="agent", input={})
    cancel_run(run_id=run.pk, actor=asha)
    run = drive(run.pk)
    assert run.status == RunStatus.CANCELLED
    assert not Step.objects.filter(run=run).exists()


def test_a_worker_paused_past_its_lease_before_sending_sends_nothing(tenant, asha, bank, settings):
    # The chaos run caught it: a worker SIGSTOPped between committing the call and sending it woke
    # after another worker had taken the run over, asked the provider ("not found") and retried;
    # its own late request then applied the payment a second time.
    settings.LEASE_MARGIN_SECONDS = 1
    email = _email_agent(tenant, asha, bank)
    email.timeout_seconds = 1
    email.save(update_fields=["timeout_seconds"])
    run, _ = start_run(user=asha, agent="agent", input={"q": 1})
    engine.advance(run.pk)  # the model proposes the email
    plan = claim(run.pk)  # the call is committed as dispatching, the lease taken
    assert plan is not None and plan.kind == "tool"
    time.sleep(plan.lease_seconds + 0.2)  # the process is paused before the request goes out
    do_tool(plan)  # it wakes and carries on where it stopped
    assert bank.effects("send_customer_email") == []
    step = Step.objects.get(run=run, seq=2)
    assert step.status == StepStatus.FAILED and "not sent" in step.error
