"""RabbitMQ as the broker (quorum queues): a broker restart and a worker killed mid-step lose no run
and apply no effect twice (DESIGN.md 3). The suite's second pass runs this file, with the worker
crash tests, on a RabbitMQ node of its own (`python -m tests.services --broker rabbitmq`, the
Makefile's `test-rabbitmq`); on Redis it is skipped, where tests/recovery/test_broker_loss.py and
test_redis_restarts.py prove the same.

Unlike the Redis broker, which persists nothing here, a quorum queue keeps its messages through a
restart: the messages queued before it are delivered after it, and the run's own state (lease,
step status) makes every duplicate a no-op.
"""

from __future__ import annotations

import time

import pytest
from django.conf import settings

from runs.models import Run, Step
from runs.services import start_run
from tests import factories
from tests.recovery.conftest import FAST_LEASES, sweep_until
from tests.servers import wait_for
from tests.services import ThrowawayRabbit

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fast_sweeps"),
    pytest.mark.skipif(
        not settings.CELERY_BROKER_URL.startswith("amqp://"), reason="RabbitMQ pass only (make test-rabbitmq)"
    ),
]


def _dispute_agent(tenant, asha, bank):
    tools = factories.make_bank_tools(tenant, bank.mcp_url)
    names = {k: t.name for k, t in tools.items()}
    for key in ("lookup_transaction", "issue_refund"):
        factories.grant(tools[key], use=[asha])
    factories.make_agent(
        tenant,
        tools=[tools["lookup_transaction"], tools["issue_refund"]],
        turns=[
            {
                "tool_calls": [
                    {"name": names["lookup_transaction"], "arguments": {"transaction_id": "TXN-1002"}}
                ]
            },
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


def test_the_broker_uses_quorum_queues_with_confirmed_publishes():
    assert settings.CELERY_TASK_DEFAULT_QUEUE_TYPE == "quorum"
    assert settings.CELERY_BROKER_TRANSPORT_OPTIONS == {"confirm_publish": True}
    from agentplatform.celery import app

    with app.connection_for_write() as connection:
        declared = app.amqp.queues[settings.CELERY_TASK_DEFAULT_QUEUE]
        declared(connection.default_channel).declare()  # the same arguments: no PRECONDITION_FAILED
        assert declared.queue_arguments == {"x-queue-type": "quorum"}


def test_every_run_finishes_once_after_rabbitmq_restarts_mid_flight(tenant, asha, bank, workers):
    _dispute_agent(tenant, asha, bank)
    bank.fault(tool="lookup_transaction", delay_before_effect=1, times=100)  # slow enough to queue up
    worker = workers("w1", env=FAST_LEASES, concurrency=2)
    runs = [start_run(user=asha, agent="agent", input={"amount": 100 + n})[0] for n in range(6)]
    ids = [r.pk for r in runs]
    wait_for(
        lambda: Step.objects.filter(run__in=ids, kind="tool", status="succeeded").exists(),
        timeout=60,
        what="steps under way",
    )

    ThrowawayRabbit.from_env().restart()

    sweep_until(
        lambda: all(r.is_terminal for r in Run.objects.filter(pk__in=ids)),
        timeout=180,
        what="all runs finished",
    )
    finished = list(Run.objects.filter(pk__in=ids))
    assert {r.status for r in finished} == {"succeeded"}, [(r.pk, r.status, r.error) for r in finished]
    refunds = bank.effects("issue_refund")
    assert sorted(e["arguments"]["amount"] for e in refunds) == [100 + n for n in range(6)]  # one each
    assert worker.proc.poll() is None  # the same worker process rode out the restart


def test_a_sub_second_countdown_is_sent_and_delivered_after_a_whole_second(tenant, asha, bank):
    """Celery's native delayed delivery refuses 0 < countdown < 1 (the message was never sent, and
    the run waited for the sweeper): runs/queueing.py rounds a countdown up to whole seconds."""
    from django.db import transaction
    from kombu.transport.native_delayed_delivery import (
        bind_queue_to_native_delayed_delivery_exchange,
        declare_native_delayed_delivery_exchanges_and_queues,
    )

    from agentplatform.celery import app
    from runs import queueing

    _dispute_agent(tenant, asha, bank)
    name = settings.CELERY_TASK_DEFAULT_QUEUE
    with app.connection_for_write() as connection:
        # What a worker's DelayedDelivery step declares when it starts; no worker runs here.
        declare_native_delayed_delivery_exchanges_and_queues(connection, "quorum")
        app.amqp.queues[name](connection.default_channel).declare()
        bind_queue_to_native_delayed_delivery_exchange(connection, app.amqp.queues[name])
    run, _ = start_run(user=asha, agent="agent", input={"amount": 100})
    sent = time.monotonic()
    with transaction.atomic():
        queueing.enqueue(run.pk, countdown=0.4)

    arrivals = []
    with app.connection_for_write() as connection:
        channel = connection.default_channel

        def next_message():
            message = channel.basic_get(name, no_ack=True)
            if message is not None:
                arrivals.append(time.monotonic() - sent)
            return len(arrivals) == 2

        wait_for(next_message, timeout=10, interval=0.05, what="both messages of the run")
    assert arrivals[0] < 1.0  # the start's message, at once
    assert 1.0 <= arrivals[1] < 5.0  # the delayed one: whole seconds, never sooner than asked
