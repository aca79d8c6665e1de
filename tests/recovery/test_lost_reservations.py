"""Money reserved by a worker that was lost: given back if the call was never sent, held if it was."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from django.utils import timezone

from budgets import services as budgets
from budgets.models import BudgetAccount, Reservation
from runs import engine
from runs.engine import heartbeat
from runs.engine.claim import claim
from runs.models import Run, Step
from runs.services import start_run
from tests import factories
from tests.conftest import drive

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def run(tenant, asha):
    echo = factories.make_builtin_tools(tenant, price_micros=1000)["echo"]
    factories.grant(echo, use=[asha])
    factories.make_agent(
        tenant,
        tools=[echo],
        turns=[{"tool_calls": [{"name": echo.name, "arguments": {"x": 1}}]}, {"text": "ok"}],
    )
    run, _ = start_run(user=asha, agent="agent", input={})
    return run


def _lose_the_worker(run) -> None:
    heartbeat.untrack(run.pk)
    Run.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))


def test_it_gives_back_what_a_lost_worker_reserved_but_never_sent(run, asha):
    # The engine reserves and commits `dispatching` in one transaction; a reservation linked to no
    # step is what a worker of the earlier three-transaction engine left when it died in between.
    Run.objects.filter(pk=run.pk).update(
        lease_token=uuid.uuid4(), lease_expires_at=timezone.now() + dt.timedelta(seconds=30)
    )
    reservation = budgets.reserve(tenant=run.tenant, run=run, user=asha, amount_micros=700, purpose="model")
    _lose_the_worker(run)  # died between reserving and dispatching

    engine.advance(run.pk)  # another worker takes over
    assert Reservation.objects.get(pk=reservation.pk).status == "released"
    assert drive(run.pk).status == "succeeded"
    account = BudgetAccount.objects.get(run=run)
    assert (account.reserved_micros, account.held_micros) == (0, 0)
    assert not Reservation.objects.filter(run=run, status="open").exists()


def test_it_holds_what_a_lost_worker_reserved_for_a_call_it_sent(run):
    engine.advance(run.pk)  # the model proposes the tool call
    plan = claim(run.pk)  # reserves and commits the call as dispatching
    assert plan.kind == "tool" and plan.reservation_id is not None
    assert Step.objects.get(pk=plan.step_id).status == "dispatching"
    _lose_the_worker(run)  # died with the call in flight

    run = drive(run.pk)
    assert run.status == "succeeded"
    step = Step.objects.get(run=run, seq=2)
    assert (step.status, step.attempts, step.crashes) == ("succeeded", 2, 1)
    assert Reservation.objects.get(pk=plan.reservation_id).status == "held"  # it may have been charged
    assert BudgetAccount.objects.get(run=run).held_micros == 1000
    assert not Reservation.objects.filter(run=run, status="open").exists()
