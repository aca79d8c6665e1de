"""The settle window (DESIGN.md 5.1): a provider slower than our timeout is never paid twice.

The bank's `make_payment` applies every POST it receives (no de-duplication, as a payment gateway
without idempotency does) and, with `delay_before_effect`, applies it seconds after receiving
it: our call times out first, and a status lookup in between truthfully answers "not found".
Each test counts the payments at the bank. A real worker runs the engine; the test plays beat.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import time

import pytest
import redis
from django.conf import settings
from django.utils import timezone

from runs.services import start_run
from tests.recovery.conftest import (
    FAST_LEASES,
    events,
    http_bank_tool,
    single_call_agent,
    step_of,
    until_fault_taken,
    until_status,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_sweeps")]

PAYMENT = {"to_account": "ACC-42", "amount": 2500}
TIMEOUT = 2  # our read timeout
APPLIES_AFTER = 4  # the provider applies the payment this long after receiving it
SETTLE = 5  # what the tenant promised for this provider: longer than it lags past our timeout


def _payment_tool(tenant, bank, *, settle_seconds: int = SETTLE):
    return http_bank_tool(
        tenant,
        bank,
        "make_payment",
        effect_class="reconcilable",
        timeout_seconds=TIMEOUT,
        settle_seconds=settle_seconds,
        status_url=f"{bank.url}/http/payment_status/{{key}}",
        max_attempts=3,
    )


def _messages_for(run_id) -> list[str]:
    """Messages about this run in the broker: queued, or delivered and not yet acknowledged."""
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    found = []
    raw = broker.lrange(settings.CELERY_TASK_DEFAULT_QUEUE, 0, -1) + list(broker.hvals("unacked"))
    for item in raw:
        text = item.decode(errors="replace")
        try:
            message = json.loads(text)
            message = message[0] if isinstance(message, list) else message
            text += base64.b64decode(message.get("body", "")).decode(errors="replace")
        except (ValueError, AttributeError, TypeError):
            pass
        if str(run_id) in text:
            found.append(text)
    return found


def _payments_once_settled(bank, step) -> list[dict]:
    """The bank's payments once every request it received has had time to be applied."""
    late = step.started_at + dt.timedelta(seconds=APPLIES_AFTER + 1) - timezone.now()
    time.sleep(max(late.total_seconds(), 0))
    return bank.effects("make_payment")


def _lookups(run_id) -> list:
    return [e for e in events(run_id, "recovery") if e.message.startswith("status lookup for step 2")]


def test_it_pays_once_when_the_provider_applies_the_payment_after_our_timeout(tenant, asha, bank, workers):
    tool = _payment_tool(tenant, bank)
    single_call_agent(tenant, asha, tool, PAYMENT, final="paid")
    bank.fault(tool="make_payment", delay_before_effect=APPLIES_AFTER)
    workers("w1", env=FAST_LEASES)
    run, _ = start_run(user=asha, agent="agent", input={})

    # The call times out; the run waits as a row for the settle window, holding no message.
    waiting = until_status(run.pk, "waiting_settle", timeout=30)
    step = step_of(run.pk, 2)
    sent = step.dispatched_at
    assert step.status == "dispatching" and waiting.lease_token is None
    assert waiting.resume_at >= sent + dt.timedelta(seconds=TIMEOUT + SETTLE)
    assert _messages_for(run.pk) == []
    parked = [e for e in events(run.pk, "status") if e.data.get("to") == "waiting_settle"]
    assert len(parked) == 1 and parked[0].data["until"] == waiting.resume_at.isoformat()
    assert "settle" in parked[0].message and "step 2" in parked[0].message

    run = until_status(run.pk, "succeeded", "failed", "needs_attention", timeout=60)
    assert run.status == "succeeded", run.error
    step = step_of(run.pk, 2)
    payments = _payments_once_settled(bank, step)
    assert len(payments) == 1  # every POST is a payment: one POST
    assert (step.status, step.attempts) == ("succeeded", 1)
    assert step.result["structured"]["payment_id"] == payments[0]["result"]["payment_id"]
    lookups = _lookups(run.pk)
    assert [e.data["found"] for e in lookups] == [True]
    assert lookups[0].at >= sent + dt.timedelta(seconds=TIMEOUT + SETTLE)


def test_it_pays_once_when_the_worker_dies_and_the_provider_is_slow(tenant, asha, bank, workers):
    tool = _payment_tool(tenant, bank)
    single_call_agent(tenant, asha, tool, PAYMENT, final="paid")
    bank.fault(tool="make_payment", delay_before_effect=APPLIES_AFTER)
    w1 = workers("w1", env=FAST_LEASES)
    run, _ = start_run(user=asha, agent="agent", input={})
    until_fault_taken(bank, "make_payment")  # the request is in the provider
    w1.kill()
    workers("w2", env=FAST_LEASES)

    # The lease (timeout + 1 s) ends before the provider applies the payment; the worker that
    # takes over waits for the window instead of asking at once and paying again.
    run = until_status(run.pk, "succeeded", "failed", "needs_attention", timeout=60)
    assert run.status == "succeeded", run.error
    step = step_of(run.pk, 2)
    assert len(_payments_once_settled(bank, step)) == 1
    assert (step.status, step.attempts, step.crashes) == ("succeeded", 1, 1)
    assert [e.data["found"] for e in _lookups(run.pk)] == [True]
    # Asked only once the window had passed (parked in waiting_settle until then, unless taking
    # the run over alone took that long).
    assert _lookups(run.pk)[0].at >= step.dispatched_at + dt.timedelta(seconds=TIMEOUT + SETTLE)


def test_it_waits_while_the_provider_says_the_payment_is_in_progress(tenant, asha, bank, workers):
    tool = _payment_tool(tenant, bank, settle_seconds=1)
    single_call_agent(tenant, asha, tool, PAYMENT, final="paid")
    # Applied 8 s after receipt; meanwhile the status route answers 409 in progress.
    bank.fault(tool="make_payment", delay_before_effect=8, pending_visible=True)
    workers("w1", env=FAST_LEASES)
    run, _ = start_run(user=asha, agent="agent", input={})

    run = until_status(run.pk, "succeeded", "failed", "needs_attention", timeout=60)
    assert run.status == "succeeded", run.error
    assert len(bank.effects("make_payment")) == 1
    answers = [e.message for e in _lookups(run.pk)]
    assert any("in progress" in a for a in answers) and answers[-1].endswith("found, not retrying")
    assert not any("not found" in a for a in answers)
    step = step_of(run.pk, 2)
    assert (step.status, step.attempts) == ("succeeded", 1)  # asked again, never sent again


def test_it_waits_on_a_409_for_a_key_in_use_and_then_collects_the_one_refund(tenant, asha, bank, workers):
    """An idempotent provider that locks a key while its first request runs answers a repeat 409."""
    refund = http_bank_tool(
        tenant,
        bank,
        "issue_refund",
        effect_class="idempotent",
        timeout_seconds=TIMEOUT,
        settle_seconds=1,
        max_attempts=2,
    )
    single_call_agent(
        tenant,
        asha,
        refund,
        {"transaction_id": "TXN-1002", "amount": 3200, "currency": "INR"},
        final="refunded",
    )
    bank.fault(tool="issue_refund", delay_before_effect=8, pending_visible=True)
    workers("w1", env=FAST_LEASES)
    run, _ = start_run(user=asha, agent="agent", input={})

    run = until_status(run.pk, "succeeded", "failed", "needs_attention", timeout=60)
    assert run.status == "succeeded", run.error
    refunds = bank.effects("issue_refund")
    assert len(refunds) == 1
    step = step_of(run.pk, 2)
    assert step.result["structured"]["refund_id"] == refunds[0]["result"]["refund_id"]
    waits = [e for e in events(run.pk, "status") if e.data.get("to") == "waiting_settle"]
    assert any("in progress" in e.message for e in waits)  # the 409s were waited on...
    assert step.attempts <= 2  # ...without using up max_attempts
