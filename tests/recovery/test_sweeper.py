"""The sweeper (Celery beat) finds runs nobody is moving and says, per run, what it found and did."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from budgets import services as budgets
from budgets.models import Reservation
from runs import engine
from runs.engine.claim import claim
from runs.models import Run, RunEvent, Step
from runs.recovery.sweeper import sweep
from runs.services import start_run
from tests import factories
from tests.recovery.conftest import events

pytestmark = pytest.mark.django_db(transaction=True)
LONG_AGO = timezone.now() - dt.timedelta(hours=1)


@pytest.fixture
def run(tenant, asha, builtins):
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    factories.make_agent(
        tenant,
        tools=[echo],
        turns=[{"tool_calls": [{"name": echo.name, "arguments": {"x": 1}}]}, {"text": "ok"}],
    )
    run, _ = start_run(user=asha, agent="agent", input={})
    return run


def test_it_requeues_a_run_whose_lease_expired_once_per_expiry(run, settings):
    settings.QUEUED_TOO_LONG_SECONDS = 30
    assert claim(run.pk) is not None  # a worker took the run, then died
    now = timezone.now()
    Run.objects.filter(pk=run.pk).update(
        last_enqueued_at=now - dt.timedelta(seconds=8), lease_expires_at=now - dt.timedelta(seconds=1)
    )
    assert sweep()["expired_leases"] == 1
    [event] = [e for e in events(run.pk, "recovery")]
    assert event.data == {"found": "expired_lease", "action": "requeue"}
    assert "lease expired" in event.message
    counts = sweep()
    assert counts["expired_leases"] == counts["lost_messages"] == 0  # its message is on the way
    Run.objects.filter(pk=run.pk).update(
        last_enqueued_at=LONG_AGO + dt.timedelta(seconds=1), lease_expires_at=LONG_AGO
    )
    assert sweep()["lost_messages"] == 1  # ...but never came: sent again, like any lost one


def test_it_requeues_a_run_whose_message_was_lost(run, settings):
    settings.QUEUED_TOO_LONG_SECONDS = 30
    assert sweep()["lost_messages"] == 0  # just enqueued
    Run.objects.filter(pk=run.pk).update(last_enqueued_at=LONG_AGO)
    assert sweep()["lost_messages"] == 1
    [event] = events(run.pk, "recovery")
    assert event.data == {"found": "lost_message", "action": "requeue"}
    assert Run.objects.get(pk=run.pk).last_enqueued_at == LONG_AGO  # the same message, sent again
    assert sweep()["lost_messages"] == 0  # once per QUEUED_TOO_LONG_SECONDS


def test_it_leaves_runs_that_wait_for_a_person_or_progress_alone(run, settings):
    settings.QUEUED_TOO_LONG_SECONDS = 30
    assert claim(run.pk) is not None  # leased and alive
    Run.objects.filter(pk=run.pk).update(last_enqueued_at=LONG_AGO)
    assert sweep()["expired_leases"] == sweep()["lost_messages"] == 0
    Run.objects.filter(pk=run.pk).update(status="needs_attention", lease_token=None, lease_expires_at=None)
    assert sweep()["expired_leases"] == sweep()["lost_messages"] == 0
    assert events(run.pk, "recovery") == []


def test_it_holds_the_reservation_of_an_attempt_whose_worker_was_lost(run, tenant, asha):
    step = Step.objects.create(run=run, seq=1, kind="model", status="outcome_unknown")
    reservation = budgets.reserve(tenant=tenant, run=run, user=asha, amount_micros=700, purpose="model")
    Reservation.objects.filter(pk=reservation.pk).update(step=step)
    assert sweep()["lost_attempts_held"] == 1
    assert Reservation.objects.get(pk=reservation.pk).status == "held"
    [event] = events(run.pk, "recovery")
    assert event.data == {"found": "open_reservation", "action": "hold"} and event.step_seq == 1
    assert run.budget.__class__.objects.get(pk=run.budget.pk).held_micros == 700
    assert sweep()["lost_attempts_held"] == 0


def test_it_leaves_the_reservation_of_a_call_in_flight_open(run, tenant, asha):
    step = Step.objects.create(run=run, seq=1, kind="model", status="dispatching")
    reservation = budgets.reserve(tenant=tenant, run=run, user=asha, amount_micros=700, purpose="model")
    Reservation.objects.filter(pk=reservation.pk).update(step=step)
    assert sweep()["lost_attempts_held"] == 0
    assert Reservation.objects.get(pk=reservation.pk).status == "open"


def test_it_lets_the_first_copy_of_a_message_sent_again_move_the_run_and_drops_the_other(run, settings):
    settings.QUEUED_TOO_LONG_SECONDS = 30
    Run.objects.filter(pk=run.pk).update(last_enqueued_at=LONG_AGO)  # its message was sent long ago...
    assert sweep()["lost_messages"] == 1  # ...so the sweeper sent it again
    engine.advance(run.pk, enqueued_at=LONG_AGO)  # one copy arrives: the model step
    assert Step.objects.get(run=run, seq=2).status == "proposed"
    engine.advance(run.pk, enqueued_at=LONG_AGO)  # the other copy is now superseded
    assert Step.objects.get(run=run, seq=2).status == "proposed"
    engine.advance(run.pk, enqueued_at=Run.objects.get(pk=run.pk).last_enqueued_at)
    assert Step.objects.get(run=run, seq=2).status == "succeeded"  # the run's next message carries on


def test_it_sends_a_silent_runs_message_again_less_and_less_often(run, settings):
    import redis
    from django.conf import settings as live

    settings.QUEUED_TOO_LONG_SECONDS = 30
    broker = redis.Redis.from_url(live.CELERY_BROKER_URL)
    start = timezone.now()
    Run.objects.filter(pk=run.pk).update(last_enqueued_at=start)
    sent = []
    for t in range(0, 400, 5):  # a sweep every 5 s
        broker.delete(live.CELERY_TASK_DEFAULT_QUEUE)  # every copy is lost too
        at = start + dt.timedelta(seconds=t)
        if sweep(now=at)["lost_messages"]:
            sent.append(t)
            RunEvent.objects.filter(pk=events(run.pk, "recovery")[-1].pk).update(at=at)  # on the same clock
    assert sent == [30, 90, 210]  # after 30 s, then 60 s more, then 120 s


def test_it_leaves_a_message_that_is_still_waiting_in_the_queue_alone(run, settings):
    """A long queue is not a lost message: sending a copy would only lengthen it."""
    import redis
    from django.conf import settings as live

    settings.QUEUED_TOO_LONG_SECONDS = 30
    later = timezone.now() + dt.timedelta(minutes=5)  # no worker has taken it for five minutes
    broker = redis.Redis.from_url(live.CELERY_BROKER_URL)
    assert broker.llen(live.CELERY_TASK_DEFAULT_QUEUE) == 1
    assert sweep(later)["lost_messages"] == 0
    assert events(run.pk, "recovery") == []
    assert broker.llen(live.CELERY_TASK_DEFAULT_QUEUE) == 1

    broker.delete(live.CELERY_TASK_DEFAULT_QUEUE)  # now the broker has lost it
    assert sweep(later)["lost_messages"] == 1
    assert broker.llen(live.CELERY_TASK_DEFAULT_QUEUE) == 1
    assert [e.data["found"] for e in events(run.pk, "recovery")] == ["lost_message"]
