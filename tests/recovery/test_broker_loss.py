"""Redis is only the broker: losing it, or every message in it, loses no run (DESIGN.md 1 and 3).

Tests that stop or restart Redis do it to the session's throwaway Redis (tests/services.py).

Runs whose message vanished sit in `queued`/`running` with no lease; the sweeper re-enqueues
them once they have been untouched for QUEUED_TOO_LONG_SECONDS.
"""

from __future__ import annotations

import time

import pytest
import redis
from django.conf import settings

from runs.models import Run, RunEvent, Step
from runs.services import start_run
from tests import factories
from tests.recovery.conftest import (
    EMAIL,
    FAST_LEASES,
    client_for,
    events,
    restart_redis,
    single_call_agent,
    start_redis,
    stop_redis,
    sweep_until,
)
from tests.servers import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_sweeps")]


def _broker() -> redis.Redis:
    return redis.Redis.from_url(settings.CELERY_BROKER_URL)


def _all_finished(run_ids):
    return lambda: all(r.is_terminal for r in Run.objects.filter(pk__in=run_ids))


def test_it_finishes_every_run_whose_queued_message_was_lost(tenant, asha, bank, workers):
    email = factories.make_bank_tools(tenant, bank.mcp_url)["send_customer_email"]
    single_call_agent(tenant, asha, email, EMAIL, final="emailed")
    runs = [start_run(user=asha, agent="agent", input={"n": n})[0] for n in range(4)]
    queue = settings.CELERY_TASK_DEFAULT_QUEUE
    assert _broker().llen(queue) == 4
    _broker().delete(queue)  # every queued message is gone
    workers("w1", env=FAST_LEASES)
    assert {r.status for r in Run.objects.filter(pk__in=[r.pk for r in runs])} == {"queued"}

    sweep_until(_all_finished([r.pk for r in runs]), timeout=60, what="all runs finished")
    for run in Run.objects.filter(pk__in=[r.pk for r in runs]):
        assert run.status == "succeeded", run.error
        assert [e.data["found"] for e in events(run.pk, "recovery")][:1] == ["lost_message"]
    keys = sorted(e["idempotency_key"] for e in bank.effects("send_customer_email"))
    assert keys == sorted(Step.objects.filter(run__in=runs, seq=2).values_list("idempotency_key", flat=True))


@pytest.mark.usefixtures("own_services")
def test_it_finishes_every_run_after_redis_restarts_mid_flight(tenant, asha, bank, workers):
    tools = factories.make_bank_tools(tenant, bank.mcp_url)
    names = {k: t.name for k, t in tools.items()}
    for key in ("lookup_transaction", "search_tickets", "issue_refund"):
        factories.grant(tools[key], use=[asha])
    factories.make_agent(
        tenant,
        tools=[tools[k] for k in ("lookup_transaction", "search_tickets", "issue_refund")],
        turns=[
            {
                "tool_calls": [
                    {"name": names["lookup_transaction"], "arguments": {"transaction_id": "TXN-1002"}}
                ]
            },
            {"tool_calls": [{"name": names["search_tickets"], "arguments": {"query": "$input.ref"}}]},
            {
                "tool_calls": [
                    {
                        "name": names["issue_refund"],
                        "arguments": {
                            "transaction_id": "TXN-1002",
                            "amount": "$input.amount",
                            "currency": "INR",
                        },
                    }
                ]
            },
            {"text": "refunded"},
        ],
    )
    bank.fault(tool="lookup_transaction", delay_before_effect=1, times=100)  # slow enough to queue up
    worker = workers("w1", env=FAST_LEASES, concurrency=2)
    runs = [
        start_run(user=asha, agent="agent", input={"ref": f"R{n}", "amount": 100 + n})[0] for n in range(6)
    ]
    ids = [r.pk for r in runs]
    wait_for(
        lambda: (
            Step.objects.filter(run__in=ids, kind="tool", status="succeeded").exists()
            and _broker().llen(settings.CELERY_TASK_DEFAULT_QUEUE) > 0
        ),
        timeout=60,
        what="work queued up",
    )

    queue = settings.CELERY_TASK_DEFAULT_QUEUE
    queued = set(_broker().lrange(queue, 0, -1))
    restart_redis()
    # Every message queued before the restart is gone. (A worker finishing a step may already have
    # sent a new one to the fresh server: only the old ones, each with its own task id, must be.)
    assert not queued & set(_broker().lrange(queue, 0, -1))

    sweep_until(_all_finished(ids), timeout=120, what="all runs finished")
    finished = list(Run.objects.filter(pk__in=ids))
    assert {r.status for r in finished} == {"succeeded"}, [(r.pk, r.status, r.error) for r in finished]
    refunds = bank.effects("issue_refund")
    assert sorted(e["arguments"]["amount"] for e in refunds) == [100 + n for n in range(6)]  # one each
    found = set(
        RunEvent.objects.filter(run__in=ids, kind="recovery").values_list("skeleton__found", flat=True)
    )
    assert found & {"lost_message", "expired_lease"}
    assert worker.proc.poll() is None  # the same worker process did all of it


@pytest.mark.usefixtures("own_services")
def test_a_worker_rides_out_a_redis_outage_with_calls_in_flight(tenant, asha, bank, workers):
    lookup = factories.make_bank_tools(tenant, bank.mcp_url)["lookup_transaction"]
    factories.grant(lookup, use=[asha])
    factories.make_agent(
        tenant,
        tools=[lookup],
        turns=[
            {"tool_calls": [{"name": lookup.name, "arguments": {"transaction_id": "TXN-1002"}}]},
            {"tool_calls": [{"name": lookup.name, "arguments": {"transaction_id": "TXN-1003"}}]},
            {"text": "done"},
        ],
    )
    bank.fault(tool="lookup_transaction", delay_before_effect=2, times=100)
    worker = workers("w1", env=FAST_LEASES, concurrency=2)
    ids = [start_run(user=asha, agent="agent", input={"n": n})[0].pk for n in range(4)]
    wait_for(
        lambda: Step.objects.filter(run__in=ids, kind="tool", status="dispatching").exists(),
        timeout=60,
        what="a tool call in flight",
    )

    stop_redis()  # holding unacknowledged messages, with calls in flight
    time.sleep(10)  # longer than a blip: the worker must reconnect, not exit
    start_redis()

    sweep_until(_all_finished(ids), timeout=120, what="all runs finished")
    assert {r.status for r in Run.objects.filter(pk__in=ids)} == {"succeeded"}
    assert worker.proc.poll() is None, worker.output()[-2000:]


@pytest.mark.usefixtures("own_services")
def test_it_admits_a_run_while_redis_is_down_and_runs_it_once_redis_is_back(tenant, asha, bank, workers):
    email = factories.make_bank_tools(tenant, bank.mcp_url)["send_customer_email"]
    single_call_agent(tenant, asha, email, EMAIL, final="emailed")
    stop_redis()
    try:
        answer = client_for(asha).post(
            "/v1/runs",
            {"agent": "agent", "input": {}},
            format="json",
            HTTP_IDEMPOTENCY_KEY="while-redis-was-down",
        )
    finally:
        start_redis()
    assert answer.status_code == 201, answer.content  # admitted: the row is the truth
    run_id = answer.json()["id"]
    assert Run.objects.get(pk=run_id).status == "queued"
    workers("w1", env=FAST_LEASES)

    sweep_until(_all_finished([run_id]), timeout=60, what="the run finished")
    assert Run.objects.get(pk=run_id).status == "succeeded"
    assert [e.data["found"] for e in events(run_id, "recovery")][:1] == ["lost_message"]
    assert len(bank.effects("send_customer_email")) == 1
