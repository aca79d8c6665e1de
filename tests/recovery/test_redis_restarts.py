"""One worker process rides out repeated Redis restarts with runs in flight (README, "Production shape").

Celery workers with the gossip, mingle and heartbeat consumer steps exited with `Unrecoverable error:
AttributeError("'NoneType' object has no attribute 'hostname'")` on most Redis restarts; workers
run without those steps (scripts/serve.sh, tests.servers.WITHOUT_STEPS). Redis here is the
session's throwaway server (tests/services.py).
"""

from __future__ import annotations

import collections
import time

import pytest

from runs.models import Run, Step
from runs.services import start_run
from tests import factories
from tests.recovery.conftest import EMAIL, FAST_LEASES, restart_redis, sweep_until
from tests.servers import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_sweeps", "own_services")]

RESTARTS = 5
WAVE = 4


@pytest.mark.timeout(600)
def test_one_worker_process_rides_out_five_redis_restarts_with_runs_in_flight(tenant, asha, bank, workers):
    tools = factories.make_bank_tools(tenant, bank.mcp_url)
    used = [tools[k] for k in ("lookup_transaction", "send_customer_email", "issue_refund")]
    for tool in used:
        factories.grant(tool, use=[asha])
    factories.make_agent(
        tenant,
        tools=used,
        turns=[
            {"tool_calls": [{"name": used[0].name, "arguments": {"transaction_id": "TXN-1002"}}]},
            {"tool_calls": [{"name": used[1].name, "arguments": {**EMAIL, "to": "$input.to"}}]},
            {
                "tool_calls": [
                    {
                        "name": used[2].name,
                        "arguments": {
                            "transaction_id": "TXN-1002",
                            "amount": "$input.amount",
                            "currency": "INR",
                        },
                    }
                ]
            },
            {"text": "refunded and told"},
        ],
    )
    # Slow calls keep steps in flight (threads busy, messages unacknowledged) when Redis goes away.
    bank.fault(tool="lookup_transaction", delay_before_effect=1.5, times=1000)
    bank.fault(tool="send_customer_email", delay_before_effect=1, times=1000)
    worker = workers("w1", env=FAST_LEASES, concurrency=8)
    pid = worker.proc.pid
    ids: list = []

    for restart in range(RESTARTS):
        # A fresh wave each time, fewer than the worker's threads: the worker holds unacknowledged
        # messages and also waits in BRPOP for more, the state in which restarts used to kill it.
        ids += [
            start_run(
                user=asha,
                agent="agent",
                input={"to": f"c{len(ids) + n}@example.com", "amount": 100 + len(ids) + n},
            )[0].pk
            for n in range(WAVE)
        ]
        in_flight = Step.objects.filter(run__in=ids, kind="tool", status="dispatching")
        wait_for(in_flight.exists, timeout=60, interval=0.05, what="a tool call in flight")
        restart_redis()
        deadline = time.monotonic() + 4  # play beat for a while: lost messages are sent again
        sweep_until(lambda deadline=deadline: time.monotonic() > deadline, timeout=30, what="time to pass")
        assert worker.proc.poll() is None, (
            f"worker exited after restart {restart + 1}:\n{worker.output()[-3000:]}"
        )

    sweep_until(
        lambda: all(r.is_terminal for r in Run.objects.filter(pk__in=ids)),
        timeout=240,
        what="all runs finished",
    )
    finished = list(Run.objects.filter(pk__in=ids))
    assert {r.status for r in finished} == {"succeeded"}, [(r.pk, r.status, r.error) for r in finished]
    for tool in ("send_customer_email", "issue_refund"):
        keys = collections.Counter(e["idempotency_key"] for e in bank.effects(tool))
        assert len(keys) == len(ids) and set(keys.values()) == {1}, (
            tool,
            keys,
        )  # one effect per run, none twice
    assert worker.proc.poll() is None and worker.proc.pid == pid, worker.output()[-3000:]
    output = worker.output()
    assert "Unrecoverable error" not in output, output[-3000:]
    assert output.count("Connected to redis://") >= RESTARTS + 1, output[-3000:]  # it saw every restart
