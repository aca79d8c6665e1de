"""An evaluation running beside real runs on a real Celery worker touches neither their budgets nor
the real tools: the tenant's day pays exactly the real runs' spend, the evaluation's account
exactly the evaluation's, and the example bank hears only the real runs' calls."""

from __future__ import annotations

import pytest
from django.db.models import Sum

from budgets.models import BudgetAccount
from budgets.selectors import ledger_mismatches
from evals import services
from runs.models import TERMINAL, Run
from runs.services import start_run
from tenants.models import Tenant
from tests.evals.conftest import SMALL, bank_calls, story_cases
from tests.servers import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(900)]

REAL_RUNS = 6


def _spent(accounts) -> int:
    return accounts.aggregate(total=Sum("spent_micros"))["total"] or 0


def test_an_evaluation_beside_real_runs_on_a_worker_spends_and_calls_only_its_own(story, asha, ravi, workers):
    Tenant.objects.filter(pk=asha.tenant_id).update(max_active_runs=100, max_starts_per_minute=100)
    asha.tenant.refresh_from_db()
    services.save_dataset(tenant=asha.tenant, dataset="disputes", cases=story_cases(), user=ravi)
    evaluation = services.start_evaluation(
        user=ravi, agent="dispute-agent", version=story["good"].number, dataset="disputes"
    )
    before = len(bank_calls(story["bank"]))
    workers("w1")

    # The real runs go to the worker on commit; the evaluation is driven here meanwhile.
    real = [
        start_run(user=asha, agent="dispute-agent", input={**SMALL, "i": i})[0].pk for i in range(REAL_RUNS)
    ]
    done = services.execute(evaluation.pk)
    wait_for(
        lambda: Run.objects.filter(pk__in=real, status__in=TERMINAL).count() == REAL_RUNS,
        timeout=300,
        what="the real runs to end on the worker",
    )

    real_runs = Run.objects.filter(pk__in=real)
    assert set(real_runs.values_list("status", flat=True)) == {"succeeded"}
    assert not real_runs.filter(evaluation=True).exists()
    eval_runs = Run.objects.filter(evaluation=True)
    assert done.status == "finished" and eval_runs.count() == len(story_cases())
    assert done.totals["pass_rate"] == 1.0
    # Their windows overlapped: the evaluation was not run before or after the real work.
    first_real_end = min(real_runs.values_list("finished_at", flat=True))
    assert min(eval_runs.values_list("created_at", flat=True)) < first_real_end

    # Budgets: the tenant's day pays exactly the real runs' spend; the evaluation's
    # account exactly the evaluation runs'; nothing stays reserved anywhere.
    real_spend = _spent(BudgetAccount.objects.filter(run__in=real_runs))
    eval_spend = _spent(BudgetAccount.objects.filter(run__in=eval_runs))
    assert real_spend > 0 and eval_spend > 0
    assert _spent(BudgetAccount.objects.filter(scope="tenant_day")) == real_spend
    # A user's day is kept only where the tenant limits one (not here): the evaluation adds none.
    assert not BudgetAccount.objects.filter(scope="user_day").exists()
    account = BudgetAccount.objects.get(pk=done.budget_account_id)
    assert account.spent_micros == eval_spend == done.totals["cost_micros"]
    # Every account is one of those: runs (both kinds), the tenant's day, the evaluation's.
    assert _spent(BudgetAccount.objects.all()) == 2 * real_spend + 2 * eval_spend
    assert not BudgetAccount.objects.exclude(reserved_micros=0).exists()
    assert all(ledger_mismatches(a) == {} for a in BudgetAccount.objects.all())

    # Tools: the bank heard the real runs' dispatched calls and nothing else.
    calls = bank_calls(story["bank"])[before:]
    dispatched = sorted(
        name.removeprefix("bank__")
        for r in real_runs
        for name in r.steps.filter(kind="tool", status="succeeded").values_list("tool_name", flat=True)
    )
    assert sorted(c["tool"] for c in calls) == dispatched and len(dispatched) >= 3 * REAL_RUNS
