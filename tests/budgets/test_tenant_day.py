"""Tenant days in the tenant's time zone: midnight, pausing until tomorrow, stopping.

Time is controlled through the budget clock (budgets.services.clock), the one seam the engine
and the budget services read "today" from; the sweeper takes `now` as an argument.
"""

from __future__ import annotations

import datetime as dt
import zoneinfo

import pytest
from django.utils import timezone

from agents.spec import DEFAULT_LIMITS
from budgets import services as budgets
from budgets.models import BudgetAccount, Reservation
from llm import gateway
from runs.engine import advance
from runs.models import Run, Step
from runs.recovery import sweeper
from runs.services import start_run
from tests import factories
from tests.budgets.conftest import assert_books_balance
from tests.conftest import drive
from tools import offer

pytestmark = pytest.mark.django_db(transaction=True)

DAY = dt.date(2030, 1, 15)


class Clock:
    def __init__(self, monkeypatch, zone: str):
        self.zone = zoneinfo.ZoneInfo(zone)
        self.now = None
        monkeypatch.setattr(budgets, "clock", lambda: self.now)

    def set(self, day: dt.date, hour: int, minute: int) -> dt.datetime:
        self.now = dt.datetime.combine(day, dt.time(hour, minute), tzinfo=self.zone).astimezone(dt.UTC)
        return self.now


@pytest.fixture
def two_call_agent(tenant, asha, builtins):
    echo = builtins["echo"]
    echo.price_micros = 1_000
    echo.save()
    factories.grant(echo, use=[asha])
    # A low configured expected cost: admitted on a nearly spent day, so these tests reach the
    # pause and the midnight rules of a run already under way.
    return factories.make_agent(
        tenant,
        tools=[echo],
        limits={"max_wall_seconds": 2 * 24 * 3600},
        expected_cost_micros=1_000,
        turns=[
            {"tool_calls": [{"name": echo.name, "arguments": {"n": 1}}]},
            {"tool_calls": [{"name": echo.name, "arguments": {"n": 2}}]},
            {"text": "done"},
        ],
    )


def day_account(tenant, day: dt.date) -> BudgetAccount:
    return budgets.tenant_day_account(tenant, day)


def first_call_estimate(version, user) -> int:
    probe = Run(
        tenant=version.agent.tenant, created_by=user, version=version, input={}, limits=dict(DEFAULT_LIMITS)
    )
    return gateway.estimate_cost_micros(
        version.model_endpoint, gateway.build_request(probe, [], offer.offered_tools(probe))
    )


def test_a_run_crossing_midnight_keeps_its_run_budget_and_charges_each_day_its_own_calls(
    tenant, asha, two_call_agent, monkeypatch
):
    tenant.time_zone = "Asia/Kolkata"
    tenant.save()
    clock = Clock(monkeypatch, "Asia/Kolkata")
    clock.set(DAY, 23, 58)
    run, _ = start_run(user=asha, agent="agent", input={})
    advance(run.pk)  # model call 1
    advance(run.pk)  # tool call 2
    clock.set(DAY + dt.timedelta(days=1), 0, 2)
    run = drive(run.pk)
    assert run.status == "succeeded", run.error

    reservations = list(Reservation.objects.filter(run=run).order_by("created_at"))
    assert [(r.purpose, r.day) for r in reservations] == [
        ("model", DAY),
        ("tool", DAY),
        ("model", DAY + dt.timedelta(days=1)),
        ("tool", DAY + dt.timedelta(days=1)),
        ("model", DAY + dt.timedelta(days=1)),
    ]
    before, after = reservations[:2], reservations[2:]
    assert day_account(tenant, DAY).spent_micros == sum(r.actual_micros for r in before)
    assert day_account(tenant, DAY + dt.timedelta(days=1)).spent_micros == sum(r.actual_micros for r in after)
    # One run account for the life of the run: nothing reset at midnight.
    assert BudgetAccount.objects.filter(run=run).count() == 1
    assert run.budget.spent_micros == sum(s.cost_micros for s in Step.objects.filter(run=run))
    assert run.budget.remaining_micros == run.budget.limit_micros - run.budget.spent_micros
    assert_books_balance(tenant)


def test_a_paused_run_resumes_after_local_midnight_and_charges_the_new_day(
    tenant, asha, two_call_agent, monkeypatch
):
    tenant.time_zone = "America/Los_Angeles"
    tenant.on_budget_exhausted = "pause"
    tenant.daily_budget_micros = 1_000_000
    tenant.save()
    clock = Clock(monkeypatch, "America/Los_Angeles")
    today = timezone.now().astimezone(clock.zone).date()  # the sweeper also checks real deadlines
    clock.set(today, 22, 0)
    # Other work spent today's budget but for one model call and one tool call.
    room = first_call_estimate(two_call_agent, asha) + 1_000
    earlier = budgets.reserve(
        tenant=tenant, amount_micros=1_000_000 - room, purpose="model", note="other runs"
    )
    budgets.settle(earlier.pk, actual_micros=earlier.amount_micros)
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)

    midnight = dt.datetime.combine(today + dt.timedelta(days=1), dt.time(0, 0), tzinfo=clock.zone)
    assert (run.status, run.resume_at, run.stop_reason) == ("waiting_budget", midnight, "")
    assert run.events.get(kind="budget", skeleton__decision="refused").data["scope"] == "tenant_day"
    assert sweeper.sweep(now=midnight - dt.timedelta(seconds=1))["budget_resumed"] == 0
    assert Run.objects.get(pk=run.pk).status == "waiting_budget"

    clock.set(today + dt.timedelta(days=1), 0, 1)
    assert sweeper.sweep(now=midnight + dt.timedelta(minutes=1))["budget_resumed"] == 1
    run = drive(run.pk)
    assert run.status == "succeeded", run.error
    days = list(Reservation.objects.filter(run=run).order_by("created_at").values_list("purpose", "day"))
    tomorrow = today + dt.timedelta(days=1)
    assert days == [
        ("model", today),
        ("tool", today),
        ("model", tomorrow),
        ("tool", tomorrow),
        ("model", tomorrow),
    ]
    old = day_account(tenant, today)
    assert old.spent_micros <= old.limit_micros
    assert_books_balance(tenant)


def test_a_run_stops_when_the_tenant_day_is_spent_and_the_tenant_says_stop(
    tenant, asha, two_call_agent, monkeypatch
):
    tenant.daily_budget_micros = first_call_estimate(two_call_agent, asha) + 1_000
    tenant.save()
    Clock(monkeypatch, "UTC").set(DAY, 12, 0)
    run = drive(start_run(user=asha, agent="agent", input={})[0].pk)
    assert (run.status, run.stop_reason) == ("stopped", "tenant_budget_exhausted")
    assert run.resume_at is None
    assert Reservation.objects.filter(run=run).count() == 2
    assert day_account(tenant, DAY).spent_micros <= day_account(tenant, DAY).limit_micros
    assert_books_balance(tenant)
