"""The issue's proof of pause and resume, with a real worker and counted at the bank server.

A hundred runs in flight, thirty of them with their refund call held in the bank: the bulk pause
answers, then no new call reaches the bank and no model call starts, every call in flight is
recorded, every run is paused; the bulk resume finishes all hundred with no refund made twice and
each run costing exactly what the same run cost in a control set that was never paused.

And the same hold through PostgreSQL restarts (the session's throwaway cluster, never the
machine's), once while the pause is only requested and the held calls are still in the bank, and
once while everything is paused, with a worker SIGKILLed: nothing paused wakes up by itself,
nothing running is lost.
"""

from __future__ import annotations

import time

import httpx
import pytest
from django.db.models import Sum
from django.utils import timezone

from budgets.models import BudgetAccount
from runs.models import Run, Step
from runs.recovery import sweeper
from runs.services import start_run
from tests.recovery.conftest import (
    FAST_LEASES,
    REFUND,
    client_for,
    db_retry,
    http_bank_tool,
    postgres,
    restart_postgres,
    single_call_agent,
    sweep_until,
)
from tests.servers import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

RUNS = 100
IN_FLIGHT = 30  # one held refund call per worker thread when the pause is asked for
HOLD = 8


def refund_calls(bank) -> list[dict]:
    calls = httpx.get(f"{bank.url}/calls", timeout=10).json()["calls"]
    return [c for c in calls if c["tool"] == "issue_refund"]


def costs(ids) -> dict[int, int]:
    """What each run was charged, by its input: its steps' settled cost, and its budget account
    (which must agree, with nothing reserved or held)."""
    by_input = {}
    for run in Run.objects.filter(pk__in=ids).select_related("budget"):
        charged = Step.objects.filter(run=run).aggregate(total=Sum("cost_micros"))["total"] or 0
        assert (run.budget.spent_micros, run.budget.reserved_micros, run.budget.held_micros) == (
            charged,
            0,
            0,
        )
        by_input[run.input["n"]] = charged
    return by_input


def all_succeeded(ids) -> bool:
    return Run.objects.filter(pk__in=ids, status="succeeded").count() == len(ids)


def start(user, n: int) -> list:
    return [start_run(user=user, agent="agent", input={"n": i})[0].pk for i in range(n)]


@pytest.fixture
def refund_agent(tenant, asha, bank):
    # Two hundred starts in a few seconds by one user, all admitted at once (each is expected to
    # cost up to its 2.00 limit): above the default quotas and day budget, which are not the test.
    tenant.max_starts_per_minute = tenant.max_active_runs = 1000
    tenant.daily_budget_micros = 1000 * 2_000_000
    tenant.save()
    # A call is held in the bank for HOLD seconds, well inside its timeout.
    refund = http_bank_tool(tenant, bank, "issue_refund", effect_class="idempotent", timeout_seconds=HOLD + 5)
    single_call_agent(tenant, asha, refund, REFUND, final="refunded")
    return refund


# Two hundred runs through one real worker: 54 s alone, past the suite's default 300 s once in CI
# under the whole suite (-n 4 on two cores); the waits inside keep their own deadlines.
@pytest.mark.timeout(1200)
def test_a_hundred_runs_paused_and_resumed_make_every_call_once_and_cost_what_unpaused_runs_do(
    tenant, asha, supervisor, bank, workers, fast_sweeps, refund_agent
):
    control = start(asha, RUNS)
    w1 = workers("w1", env=FAST_LEASES, concurrency=IN_FLIGHT)
    # A deadline, not a measure: 54 s alone; under the whole suite at -n 4 it passed 240 s twice this round.
    wait_for(lambda: all_succeeded(control), timeout=480, what="the control set finished")
    assert len(refund_calls(bank)) == len(bank.effects("issue_refund")) == RUNS
    before = len(refund_calls(bank))

    # All hundred queued before a worker takes them: its thirty threads end up each holding a
    # refund call in the bank, and the seventy other runs wait for a thread.
    w1.stop()
    bank.fault(tool="issue_refund", delay_before_effect=HOLD, times=IN_FLIGHT)
    ids = start(asha, RUNS)
    workers("w2", env=FAST_LEASES, concurrency=IN_FLIGHT)
    wait_for(lambda: len(refund_calls(bank)) - before >= IN_FLIGHT, timeout=120, what="30 calls held")
    answer = client_for(supervisor).post(
        "/v1/runs/pause", {"reason": "core banking degraded", "agent": "agent"}, format="json"
    )
    answered_at = timezone.now()
    calls_at_answer = len(refund_calls(bank))
    assert answer.status_code == 200, answer.json()
    assert answer.json()["count"] == RUNS  # every worker thread was held in the bank: none had ended
    assert calls_at_answer - before == IN_FLIGHT

    # The calls in flight end and are recorded; every run is paused at its step boundary.
    wait_for(
        lambda: Run.objects.filter(pk__in=ids, status="paused").count() == RUNS,
        timeout=60,
        what="every run paused",
    )
    assert not Step.objects.filter(run_id__in=ids, status="dispatching").exists()
    recorded = Step.objects.filter(run_id__in=ids, kind="tool", status="succeeded").count()
    assert recorded == IN_FLIGHT == len(bank.effects("issue_refund")) - RUNS  # every outcome on record
    assert not Run.objects.filter(pk__in=ids, lease_token__isnull=False).exists()
    # A window for a wrong call to show (with the sweeper playing beat), not a synchronisation.
    until = time.monotonic() + 4
    while time.monotonic() < until:
        sweeper.sweep()
        time.sleep(0.3)
    assert len(refund_calls(bank)) == calls_at_answer  # 0 tool calls after the pause answered
    assert not Step.objects.filter(run_id__in=ids, kind="model", started_at__gt=answered_at).exists()
    assert Run.objects.filter(pk__in=ids, status="paused").count() == RUNS

    resumed = client_for(supervisor).post(
        "/v1/runs/resume", {"reason": "core banking is back"}, format="json"
    )
    assert resumed.json()["count"] == RUNS
    wait_for(lambda: all_succeeded(ids), timeout=480, what="every paused run finished after the resume")

    keys = [e["idempotency_key"] for e in bank.effects("issue_refund")]
    assert len(keys) == len(set(keys)) == 2 * RUNS  # one refund per run, none twice
    assert len(refund_calls(bank)) == 2 * RUNS  # and no call sent twice either
    assert set(Step.objects.filter(run_id__in=ids, kind="tool").values_list("attempts", flat=True)) == {1}
    paused_costs, control_costs = costs(ids), costs(control)
    assert paused_costs == control_costs  # run by run: the pause charged nothing
    days = BudgetAccount.objects.filter(tenant=tenant, scope=BudgetAccount.Scope.TENANT_DAY)
    spent = days.aggregate(total=Sum("spent_micros"))["total"]
    assert spent == 2 * sum(control_costs.values())


def test_a_pause_holds_through_postgresql_restarts_and_a_worker_sigkill(
    tenant, asha, supervisor, bank, workers, fast_sweeps, own_services, refund_agent
):
    runs, held = 20, 6
    bank.fault(tool="issue_refund", delay_before_effect=HOLD, times=held)
    ids = start(asha, runs)
    w1 = workers("w1", env=FAST_LEASES, concurrency=held)
    wait_for(lambda: len(refund_calls(bank)) >= held, timeout=60, what="calls held in the bank")
    answer = client_for(supervisor).post("/v1/runs/pause", {"reason": "ledger maintenance"}, format="json")
    assert answer.json()["count"] == runs
    calls_at_answer = len(refund_calls(bank))

    # PostgreSQL restarts while the held calls are in the bank: their outcomes are recorded all the same.
    restart_postgres()
    sweep_until(
        lambda: Run.objects.filter(pk__in=ids, status="paused").count() == runs,
        timeout=90,
        what="every run paused after the restart",
    )
    assert (
        db_retry(lambda: Step.objects.filter(run_id__in=ids, kind="tool", status="succeeded").count()) == held
    )
    assert len(bank.effects("issue_refund")) == held
    assert not Step.objects.filter(run_id__in=ids, status="dispatching").exists()

    # Everything paused: PostgreSQL restarted again, the worker SIGKILLed and replaced, the
    # sweeper run for a while. Nothing wakes up, nothing is called.
    postgres("restart")
    w1.kill()
    workers("w2", env=FAST_LEASES, concurrency=held)
    until = time.monotonic() + 4
    while time.monotonic() < until:  # a window for a wrong wake-up to show, not a synchronisation
        db_retry(sweeper.sweep)
        time.sleep(0.3)
    assert db_retry(lambda: Run.objects.filter(pk__in=ids, status="paused").count()) == runs
    assert len(refund_calls(bank)) == calls_at_answer

    resumed = client_for(supervisor).post("/v1/runs/resume", {"reason": "ledger back"}, format="json")
    assert resumed.json()["count"] == runs
    sweep_until(lambda: all_succeeded(ids), timeout=120, what="every run finished after the resume")
    keys = [e["idempotency_key"] for e in bank.effects("issue_refund")]
    assert len(keys) == len(set(keys)) == runs
    assert set(Step.objects.filter(run_id__in=ids, kind="tool").values_list("attempts", flat=True)) == {1}
    costs(ids)  # every run's account agrees with its steps: nothing left reserved or held
