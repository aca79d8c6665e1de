"""A model reply that arrives after its worker lost the lease clears the hold on its charge.

The worker that takes the run over cannot know whether the lost call was charged, so it holds
the reservation (DESIGN.md section 6). When the stalled worker's reply does come back, it carries
the provider's usage for that very call: the hold is reconciled from it, with no person needed.
"""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest
from django.db import connections
from django.utils import timezone

from budgets.models import BudgetAccount, Reservation
from runs import engine
from runs.engine import heartbeat
from runs.models import Run, RunEvent, Step
from runs.services import start_run
from tests import factories
from tests.budgets.conftest import assert_books_balance, openai_endpoint
from tests.conftest import drive

pytestmark = pytest.mark.django_db(transaction=True)


def _wait(predicate, what: str, timeout: float = 20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_late_reply_reconciles_the_held_charge_of_its_call(tenant, asha, fake_openai):
    factories.make_agent(tenant, endpoint=openai_endpoint(tenant, fake_openai), tools=[])
    fake_openai.queue({"text": "first answer, too late"}, {"text": "second answer"})
    # Long enough for the takeover below to happen first on a loaded machine.
    fake_openai.latency_ms = 4000
    run, _ = start_run(user=asha, agent="agent", input={"question": "refund policy?"})

    def stalling_worker():
        try:
            engine.advance(run.pk)
        finally:
            connections.close_all()

    stalled = threading.Thread(target=stalling_worker)
    stalled.start()
    first = _wait(lambda: Step.objects.filter(run=run, seq=1, status="dispatching").first(), "the first call")
    # The fake reads its latency once the request arrived: lowered before, the "stalled" call
    # would come back at once and settle before any takeover.
    _wait(lambda: fake_openai.requests, "the first call at the provider")
    heartbeat.untrack(run.pk)  # it stops renewing its lease
    Run.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))
    fake_openai.latency_ms = 0

    engine.advance(run.pk)  # another worker takes over: the lost call's charge is held
    lost = Reservation.objects.get(run=run, step=first)
    assert lost.status == "held"
    assert BudgetAccount.objects.get(run=run).held_micros == lost.amount_micros > 0

    stalled.join(30)
    assert not stalled.is_alive()
    lost.refresh_from_db()
    assert lost.status == "reconciled" and lost.closed_by is None
    assert lost.actual_micros > 0  # priced from the usage the provider reported
    account = BudgetAccount.objects.get(run=run)
    assert account.held_micros == 0
    late = RunEvent.objects.get(run=run, kind="late_attempt", step_seq=1)
    assert late.data["hold_reconciled"] is True and late.data["cost_micros"] == lost.actual_micros
    assert Step.objects.get(pk=first.pk).status == "outcome_unknown"  # the run moved on without it

    run = drive(run.pk)
    assert run.status == "succeeded" and run.final_output == "second answer"
    assert account.__class__.objects.get(pk=account.pk).spent_micros == sum(
        r.actual_micros for r in Reservation.objects.filter(run=run)
    )
    assert_books_balance(tenant)
