"""Pause and resume with a real worker (runs/controls/pausing.py), counted at the bank server: after a bulk
pause answers no new call reaches the bank, every call in flight is recorded, nothing paused wakes
up by itself (not even through a worker SIGKILL and the sweeper), and the bulk resume finishes every
run with no call made twice."""

from __future__ import annotations

import time

import httpx
import pytest

from runs.models import Run, Step
from runs.recovery import sweeper
from runs.services import start_run
from tests.recovery.conftest import FAST_LEASES, REFUND, client_for, http_bank_tool, single_call_agent
from tests.servers import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

RUNS = 12
SLOW = 4  # calls held in the bank, one per worker thread, while the pause is asked for


def bank_calls(bank) -> list[dict]:
    return [
        c for c in httpx.get(f"{bank.url}/calls", timeout=10).json()["calls"] if c["tool"] == "issue_refund"
    ]


def test_a_bulk_pause_stops_every_new_call_survives_sigkill_and_resumes_without_duplicates(
    tenant, asha, supervisor, bank, workers, fast_sweeps
):
    refund = http_bank_tool(tenant, bank, "issue_refund", effect_class="idempotent")
    single_call_agent(tenant, asha, refund, REFUND, final="refunded")
    bank.fault(tool="issue_refund", delay_before_effect=3, times=SLOW)
    w1 = workers("w1", env=FAST_LEASES, concurrency=SLOW)
    runs = [start_run(user=asha, agent="agent", input={"n": i})[0] for i in range(RUNS)]
    ids = [r.pk for r in runs]
    wait_for(lambda: len(bank_calls(bank)) >= SLOW, timeout=30, what="calls held in the bank")

    answer = client_for(supervisor).post(
        "/v1/runs/pause", {"reason": "core banking degraded", "agent": "agent"}, format="json"
    )
    calls_at_answer = len(bank_calls(bank))
    assert answer.status_code == 200, answer.json()
    assert 0 < answer.json()["count"] <= RUNS

    # The calls in flight finish and are recorded; then every run is paused (or had already ended).
    wait_for(
        lambda: not Run.objects.filter(pk__in=ids).exclude(status__in=["paused", "succeeded"]).exists(),
        timeout=30,
        what="every run paused at its step boundary",
    )
    assert not Step.objects.filter(run_id__in=ids, status="dispatching").exists()
    held = Step.objects.filter(run_id__in=ids, kind="tool", status="succeeded").count()
    assert held == len(bank.effects("issue_refund")) >= SLOW  # every outcome in flight is on record
    paused = set(Run.objects.filter(pk__in=ids, status="paused").values_list("pk", flat=True))
    assert paused

    # A worker SIGKILLed, another started, the sweeper run for a while: nothing paused wakes up.
    w1.kill()
    workers("w2", env=FAST_LEASES, concurrency=SLOW)
    until = time.monotonic() + 5
    while time.monotonic() < until:  # a window for a wrong wake-up to show, not a synchronisation
        sweeper.sweep()
        time.sleep(0.3)
    assert set(Run.objects.filter(pk__in=ids, status="paused").values_list("pk", flat=True)) == paused
    assert len(bank_calls(bank)) == calls_at_answer  # 0 new calls after the pause answered

    resumed = client_for(supervisor).post(
        "/v1/runs/resume", {"reason": "core banking is back"}, format="json"
    )
    assert resumed.json()["count"] == len(paused)
    wait_for(
        lambda: Run.objects.filter(pk__in=ids, status="succeeded").count() == RUNS,
        timeout=60,
        what="every run finished after the resume",
    )
    effects = bank.effects("issue_refund")
    keys = [e["idempotency_key"] for e in effects]
    assert len(keys) == len(set(keys)) == RUNS  # one refund per run, none twice
    assert all(s.attempts == 1 for s in Step.objects.filter(run_id__in=ids, kind="tool"))


def test_a_kill_switch_on_a_tool_sends_no_call_after_it_answers_and_off_resumes_every_run(
    tenant, asha, supervisor, bank, workers, fast_sweeps
):
    refund = http_bank_tool(tenant, bank, "issue_refund", effect_class="idempotent")
    single_call_agent(tenant, asha, refund, REFUND, final="refunded")
    bank.fault(tool="issue_refund", delay_before_effect=3, times=SLOW)
    workers("w1", env=FAST_LEASES, concurrency=SLOW)
    ids = [start_run(user=asha, agent="agent", input={"n": i})[0].pk for i in range(20)]
    wait_for(lambda: len(bank_calls(bank)) >= SLOW, timeout=30, what="calls held in the bank")

    on = client_for(supervisor).post(
        "/v1/kill-switches",
        {"scope": "tool", "target": refund.name, "on": True, "reason": "ledger down"},
        format="json",
    )
    assert on.status_code == 200, on.json()
    calls_at_answer = len(bank_calls(bank))
    wait_for(
        lambda: not Run.objects.filter(pk__in=ids).exclude(status__in=["paused", "succeeded"]).exists(),
        timeout=30,
        what="every run paused by the switch (or ended before it)",
    )
    until = time.monotonic() + 3
    while time.monotonic() < until:  # a window for a wrong call to show, not a synchronisation
        sweeper.sweep()
        time.sleep(0.3)
    assert len(bank_calls(bank)) == calls_at_answer  # 0 calls after the switch answered
    by_switch = Run.objects.filter(pk__in=ids, status="paused", paused_by_switch__isnull=False).count()
    assert by_switch >= 20 - calls_at_answer

    off = client_for(supervisor).post(
        "/v1/kill-switches",
        {"scope": "tool", "target": refund.name, "on": False, "reason": "ledger back"},
        format="json",
    )
    assert off.json()["runs_resumed"] == by_switch
    wait_for(
        lambda: Run.objects.filter(pk__in=ids, status="succeeded").count() == 20,
        timeout=60,
        what="all 20 finished after the switch went off",
    )
    keys = [e["idempotency_key"] for e in bank.effects("issue_refund")]
    assert len(keys) == len(set(keys)) == 20
