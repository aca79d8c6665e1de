"""Admission (runs/admission.py): expected cost per run, room, order of arrival, 429 when asked."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from budgets import services as budgets
from budgets.models import BudgetAccount
from core.errors import DomainError
from runs import admission
from runs.models import Run, Step
from runs.recovery import sweeper
from runs.services import effective_limits, start_run
from tests import factories
from tests.conftest import drive

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def agent(tenant):
    return factories.make_agent(tenant, turns=[{"text": "done"}])


def finished_run(
    version, user, *, spent: int, status: str = "succeeded", ago: int = 0, reserved: int = 0
) -> Run:
    run = Run.objects.create(
        tenant=version.agent.tenant,
        created_by=user,
        agent=version.agent,
        version=version,
        input={},
        limits={},
        status=status,
        admitted_at=timezone.now(),
        finished_at=timezone.now() - dt.timedelta(minutes=ago),
    )
    BudgetAccount.objects.create(
        tenant=run.tenant, scope=BudgetAccount.Scope.RUN, run=run, limit_micros=10**7, spent_micros=spent
    )
    if reserved:
        Step.objects.create(run=run, seq=1, kind="model", status="succeeded", reserved_micros=reserved)
    return run


def test_it_learns_the_expected_cost_from_the_p90_of_the_last_succeeded_runs(tenant, asha, agent):
    """What a run spent plus its largest reservation: the room it needed at its peak."""
    limits = effective_limits({}, tenant)
    assert admission.expected_cost(version=agent, limits=limits, tenant=tenant) == limits["max_cost_micros"]
    for i in range(1, 11):
        finished_run(agent, asha, spent=1_000 * i, ago=i, reserved=300)
    finished_run(agent, asha, spent=900_000, status="stopped")  # not a finished task
    assert admission.expected_cost(version=agent, limits=limits, tenant=tenant) == 9_300
    for _ in range(20):  # newer runs replace older ones
        finished_run(agent, asha, spent=500, ago=0)
    assert admission.expected_cost(version=agent, limits=limits, tenant=tenant) == 500


def test_a_configured_expected_cost_wins_and_is_capped_by_the_day(tenant, asha):
    version = factories.make_agent(tenant, name="costly", expected_cost_micros=10**9)
    limits = effective_limits({}, tenant)
    assert admission.expected_cost(version=version, limits=limits, tenant=tenant) == min(
        limits["max_cost_micros"], tenant.daily_budget_micros
    )


def test_waiting_runs_start_in_order_of_arrival_as_room_frees_up(tenant, asha, ravi):
    factories.make_agent(tenant, expected_cost_micros=400_000, turns=[{"text": "done"}])
    tenant.daily_budget_micros = 1_000_000
    tenant.save()
    first, _ = start_run(user=asha, agent="agent", input={"n": 1})
    second, _ = start_run(user=asha, agent="agent", input={"n": 2})
    third, _ = start_run(user=ravi, agent="agent", input={"n": 3})
    fourth, _ = start_run(user=asha, agent="agent", input={"n": 4})
    assert [Run.objects.get(pk=r.pk).status for r in (first, second, third, fourth)] == [
        "queued",
        "queued",
        "waiting_budget",
        "waiting_budget",
    ]
    # A cheaper run arriving later still waits behind them: nobody overtakes.
    factories.make_agent(tenant, name="cheap", expected_cost_micros=1_000, turns=[{"text": "done"}])
    cheap, _ = start_run(user=asha, agent="cheap", input={})
    assert Run.objects.get(pk=cheap.pk).status == "waiting_budget"
    with pytest.raises(DomainError) as refused:
        start_run(user=asha, agent="cheap", input={"x": 1}, wait=False)
    assert (refused.value.status, refused.value.code) == (429, "tenant_budget_exhausted")
    assert refused.value.retry_after == admission.RETRY_SOON_SECONDS  # room may free up before tomorrow

    assert sweeper._admit_waiting_runs(timezone.now()) == 0
    drive(first.pk)  # finishes far under its expectation: its room is free again
    assert sweeper._admit_waiting_runs(timezone.now()) == 1
    assert [Run.objects.get(pk=r.pk).status for r in (third, fourth, cheap)] == [
        "queued",
        "waiting_budget",
        "waiting_budget",
    ]
    day = budgets.tenant_day_account(tenant, budgets.local_day(tenant))
    assert day.spent_micros <= day.limit_micros
