"""Budget-facing API: admission quotas (429 + Retry-After), GET /v1/usage, a run's budget."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from budgets import services as budgets
from runs.models import Run
from runs.services import start_run
from tests import factories
from tests.budgets.conftest import in_threads
from tests.conftest import drive

pytestmark = pytest.mark.django_db(transaction=True)


def api(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def start(user, **body):
    return api(user).post("/v1/runs", {"agent": "agent", "input": {}, **body}, format="json")


@pytest.fixture
def agent(tenant):
    return factories.make_agent(tenant, turns=[{"text": "done"}])


def test_it_refuses_a_run_over_the_active_run_quota(tenant, asha, agent):
    tenant.max_active_runs = 1
    tenant.save()
    assert start(asha).status_code == 201
    refused = start(asha, input={"second": True})
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "active_run_quota_exceeded"
    assert int(refused["Retry-After"]) > 0
    assert Run.objects.count() == 1


def test_it_refuses_a_run_over_the_start_rate(tenant, asha, ravi, agent):
    tenant.max_starts_per_minute = 2
    tenant.save()
    for i in range(2):
        run = Run.objects.get(pk=start(asha, input={"i": i}).json()["id"])
        drive(run.pk)  # finished runs do not count as active; only the rate applies
    refused = start(asha, input={"i": 3})
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "start_rate_exceeded"
    assert refused["Retry-After"] == "60"
    assert start(ravi).status_code == 201  # the rate is per user


def test_it_refuses_a_run_that_asked_not_to_wait_when_the_tenant_day_is_spent(tenant, asha, agent):
    tenant.time_zone = "Asia/Kolkata"
    tenant.save()
    spent = budgets.reserve(tenant=tenant, amount_micros=tenant.daily_budget_micros, purpose="model")
    budgets.settle(spent.pk, actual_micros=spent.amount_micros)
    refused = start(asha, wait=False)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "tenant_budget_exhausted"
    until_midnight = (budgets.next_local_midnight(tenant) - timezone.now()).total_seconds()
    assert abs(int(refused["Retry-After"]) - until_midnight) < 10
    assert not Run.objects.exists()


def test_a_run_waits_for_budget_when_the_tenant_day_is_spent_and_starts_the_next_day(
    tenant, asha, agent, monkeypatch
):
    from runs.recovery import sweeper

    spent = budgets.reserve(tenant=tenant, amount_micros=tenant.daily_budget_micros, purpose="model")
    budgets.settle(spent.pk, actual_micros=spent.amount_micros)
    waiting = start(asha)
    assert waiting.status_code == 201
    body = waiting.json()
    assert (body["status"], body["admitted_at"], body["started_at"]) == ("waiting_budget", None, None)
    assert body["expected_cost_micros"] > 0
    run = Run.objects.get(pk=body["id"])
    assert not run.steps.exists() and run.lease_token is None
    assert list(run.events.filter(kind="status").values_list("skeleton__to", flat=True)) == ["waiting_budget"]
    assert sweeper._admit_waiting_runs(timezone.now()) == 0  # still no room today

    tomorrow = timezone.now() + dt.timedelta(days=1)
    monkeypatch.setattr(budgets, "clock", lambda: tomorrow)
    assert sweeper._admit_waiting_runs(timezone.now()) == 1
    run.refresh_from_db()
    assert run.status == "queued" and run.admitted_at is not None and run.deadline_at is not None
    assert list(run.events.filter(kind="status").values_list("skeleton__to", flat=True)) == [
        "waiting_budget",
        "queued",
    ]


def test_concurrent_starts_never_exceed_the_active_run_quota(tenant, asha, agent):
    tenant.max_active_runs = 3
    tenant.max_starts_per_minute = 100
    tenant.save()
    answers = in_threads(12, lambda i: start(asha, input={"i": i}))
    codes = sorted(a.status_code for a in answers)
    assert codes == [201] * 3 + [429] * 9
    assert {a.json()["error"]["code"] for a in answers if a.status_code == 429} == {
        "active_run_quota_exceeded"
    }
    assert Run.objects.count() == 3


def test_usage_shows_days_and_agents_and_a_run_shows_its_budget(tenant, asha, ravi):
    factories.make_agent(tenant, name="alpha", turns=[{"text": "done"}])
    factories.make_agent(tenant, name="beta", limits={"max_cost_micros": 700_000})
    alpha = drive(start_run(user=asha, agent="alpha", input={})[0].pk)
    beta = drive(start_run(user=asha, agent="beta", input={})[0].pk)
    held = budgets.reserve(tenant=tenant, run=beta, amount_micros=4_000, purpose="model")
    budgets.hold(held.pk, note="lost")
    other = factories.make_tenant("globex")
    budgets.reserve(tenant=other, amount_micros=99, purpose="model")

    usage = api(asha).get("/v1/usage?days=7")
    assert usage.status_code == 200
    body = usage.json()
    assert body["time_zone"] == tenant.time_zone
    (today,) = body["days"]
    spent = alpha.budget.spent_micros + beta.budget.spent_micros
    assert today == {
        "day": budgets.local_day(tenant).isoformat(),
        "limit_micros": tenant.daily_budget_micros,
        "reserved_micros": 0,
        "spent_micros": spent,
        "held_micros": 4_000,
        "overage_micros": 0,
        "remaining_micros": tenant.daily_budget_micros - spent - 4_000,
        "over_limit": False,
    }
    assert body["agents"] == [
        {
            "agent": "alpha",
            "spent_micros": alpha.budget.spent_micros,
            "held_micros": 0,
            "reserved_micros": 0,
            "runs": 1,
        },
        {
            "agent": "beta",
            "spent_micros": beta.budget.spent_micros,
            "held_micros": 4_000,
            "reserved_micros": 0,
            "runs": 1,
        },
    ]
    assert api(asha).get("/v1/usage?days=0").status_code == 400

    detail = api(ravi).get(f"/v1/runs/{beta.pk}").json()
    assert detail["budget"] == {
        "limit_micros": 700_000,
        "reserved_micros": 0,
        "spent_micros": beta.budget.spent_micros,
        "held_micros": 4_000,
        "overage_micros": 0,
        "remaining_micros": 700_000 - beta.budget.spent_micros - 4_000,
    }
    assert detail["limits"]["max_cost_micros"] == 700_000
