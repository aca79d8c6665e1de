"""Admission that always makes progress (runs/admission.py): a cold version on a tight day, the
progress rule, the refusal of a run no day can carry, and when a waiting run is expected to start.

The case from the field: 50 runs of a new agent version (no history to learn from) started on a
tenant day with USD 0.20 left and a per-run cost limit of USD 2.00. Sized by the worst case, none
ever fitted, and all 50 waited in waiting_budget day after day while the money sat unused.
"""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from budgets import services as budgets
from runs import admission
from runs.models import TERMINAL, Run, StopReason
from runs.recovery import sweeper
from runs.services import start_run
from tests import factories
from tests.budgets.conftest import assert_books_balance
from tests.conftest import drive
from tests.servers import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(400)]

LEFT = 200_000  # USD 0.20 left today
LIMIT = 2_000_000  # USD 2.00 per run


def api(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def spend_day_down_to(tenant, left: int) -> None:
    spent = budgets.reserve(tenant=tenant, amount_micros=tenant.daily_budget_micros - left, purpose="model")
    budgets.settle(spent.pk, actual_micros=spent.amount_micros)


def day_totals(tenant):
    day = budgets.tenant_day_account(tenant, budgets.local_day(tenant))
    return day.limit_micros, day.spent_micros + day.reserved_micros + day.held_micros


@pytest.fixture
def tight_day(tenant):
    tenant.max_active_runs = 100
    tenant.max_starts_per_minute = 100
    tenant.save()
    spend_day_down_to(tenant, LEFT)
    return tenant


@pytest.fixture
def cold(tight_day):
    return factories.make_agent(
        tight_day, turns=[{"text": "done"}], limits={"max_cost_micros": LIMIT, "max_output_tokens": 1000}
    )


def admitted_unfinished(tenant) -> int:
    return Run.objects.filter(tenant=tenant, admitted_at__isnull=False).exclude(status__in=TERMINAL).count()


def test_fifty_runs_of_a_cold_version_on_a_tight_day_all_finish_and_never_overspend(tight_day, asha, cold):
    runs = [start_run(user=asha, agent="agent", input={"i": i})[0] for i in range(50)]
    # Before: every run expected its worst case (USD 2.00 > USD 0.20 left) and all 50 waited.
    assert [r.status for r in runs].count("queued") == 1
    assert runs[0].status == "queued" and runs[0].expected_cost_micros == LIMIT

    most_at_once = []
    while True:
        queued = list(Run.objects.filter(tenant=tight_day, status="queued").order_by("created_at"))
        if not queued:
            break
        most_at_once.append(admitted_unfinished(tight_day))
        for run in queued:
            assert drive(run.pk).status == "succeeded"
        sweeper._admit_waiting_runs(timezone.now())
        limit, used = day_totals(tight_day)
        assert used <= limit

    finished = Run.objects.filter(pk__in=[r.pk for r in runs])
    assert sorted(set(finished.values_list("status", flat=True))) == ["succeeded"]
    # Cold, they started one at a time until enough had finished to learn from; then by the p90.
    assert most_at_once[: admission.MIN_LEARNED] == [1] * admission.MIN_LEARNED
    assert max(most_at_once) > 1
    _, source = admission.expectation(version=cold, limits=runs[-1].limits, tenant=tight_day)
    assert source == "learned"
    assert Run.objects.get(pk=runs[-1].pk).expected_cost_micros < LEFT  # admitted by what was learned
    limit, used = day_totals(tight_day)
    assert used <= limit
    assert_books_balance(tight_day)


def test_with_a_real_worker_the_cold_queue_finishes_the_same_day(tight_day, asha, cold, workers):
    workers("w1", concurrency=4)
    day = budgets.local_day(tight_day)
    statuses = [
        api(asha).post("/v1/runs", {"agent": "agent", "input": {"i": i}}, format="json").status_code
        for i in range(20)
    ]
    assert statuses == [201] * 20
    overspent = []

    def all_ended():  # play Celery beat: the sweeper admits as runs finish
        sweeper.sweep()
        limit, used = day_totals(tight_day)
        if used > limit:
            overspent.append((limit, used))
        return Run.objects.filter(tenant=tight_day).exclude(status__in=TERMINAL).count() == 0

    wait_for(all_ended, timeout=300, interval=0.3, what="all 20 runs to end")
    runs = Run.objects.filter(tenant=tight_day)
    assert sorted(set(runs.values_list("status", flat=True))) == ["succeeded"]
    assert {budgets.local_day(tight_day, r.finished_at) for r in runs} == {day}
    assert overspent == []
    assert_books_balance(tight_day)


def test_the_run_started_alone_cannot_overspend_and_a_spent_day_waits_for_tomorrow(tenant, asha):
    """The progress rule puts one run at risk, never the money: the ledger refuses its call."""
    tenant.on_budget_exhausted = tenant.OnBudgetExhausted.STOP
    tenant.save()
    factories.make_agent(tenant, turns=[{"text": "done"}], limits={"max_output_tokens": 1000})
    spend_day_down_to(tenant, 50)  # less than one call's reservation
    head, _ = start_run(user=asha, agent="agent", input={"i": 0})
    behind, _ = start_run(user=asha, agent="agent", input={"i": 1})
    assert (head.status, behind.status) == ("queued", "waiting_budget")
    limit_before, used_before = day_totals(tenant)

    head = drive(head.pk)
    assert (head.status, head.stop_reason) == ("stopped", StopReason.TENANT_BUDGET_EXHAUSTED)
    assert day_totals(tenant) == (limit_before, used_before)  # nothing reserved beyond the limit
    # The day has shown it cannot carry one more: the queue waits for tomorrow, not run after run.
    assert sweeper._admit_waiting_runs(timezone.now()) == 0
    start = api(asha).get(f"/v1/runs/{behind.pk}").json()["expected_start"]
    assert start["when"] == "next_local_midnight" and start["runs_ahead"] == 0
    assert dt.datetime.fromisoformat(start["at"]) == budgets.next_local_midnight(tenant)
    refused = api(asha).post("/v1/runs", {"agent": "agent", "input": {"i": 2}, "wait": False}, format="json")
    assert refused.status_code == 429
    assert int(refused["Retry-After"]) > admission.RETRY_SOON_SECONDS
    assert_books_balance(tenant)


def test_a_run_no_whole_day_can_carry_is_refused_at_start_naming_the_figures(tenant, asha):
    tenant.daily_budget_micros = 1_000_000
    tenant.save()
    factories.make_agent(tenant, expected_cost_micros=1_500_000, limits={"max_cost_micros": 2_000_000})
    answer = api(asha).post("/v1/runs", {"agent": "agent", "input": {}}, format="json")
    assert answer.status_code == 422, answer.content
    error = answer.json()["error"]
    assert error["code"] == "expected_cost_exceeds_daily_budget"
    assert "1500000 micros" in error["message"] and "1000000 micros" in error["message"]
    assert not Run.objects.filter(tenant=tenant).exists()


def test_a_waiting_run_says_when_it_is_expected_to_start(tight_day, asha, cold):
    head, _ = start_run(user=asha, agent="agent", input={"i": 0})
    second, _ = start_run(user=asha, agent="agent", input={"i": 1})
    third, _ = start_run(user=asha, agent="agent", input={"i": 2})
    assert api(asha).get(f"/v1/runs/{head.pk}").json()["expected_start"] is None  # admitted
    assert api(asha).get(f"/v1/runs/{third.pk}").json()["expected_start"] == {
        "when": "as_admitted_runs_finish",
        "at": None,
        "runs_ahead": 1,
    }
    drive(head.pk)
    start = api(asha).get(f"/v1/runs/{second.pk}").json()["expected_start"]
    assert (start["when"], start["runs_ahead"]) == ("next_admission_pass", 0)
    assert dt.datetime.fromisoformat(start["at"]) <= timezone.now() + dt.timedelta(seconds=60)
    listed = api(asha).get("/v1/runs").json()["results"]
    assert {r["id"]: r["expected_start"] is not None for r in listed}[str(third.pk)]
