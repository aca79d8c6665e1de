"""Admission that finishes runs (DESIGN.md sections 6 and 8).

A tenant's day budget shared by more runs than it can carry would let every run start, spend,
and stop part-way (`tenant_budget_exhausted`): money spent, nothing finished. So a run is
admitted only while the day's remaining budget, less what the runs already admitted are still
expected to spend, covers the new run's expected cost:

    room = (day limit - spent - reserved - held)
           - sum over admitted, unfinished runs of max(expected - (spent + reserved + held), 0)
    admit when room >= expected and no run of the tenant waits ahead of this one

Otherwise the run waits in `waiting_budget` (a row: no worker, no message), in order of arrival;
the sweeper admits waiting runs as room appears (runs finish under their expectation, holds are
reconciled) or the next local day begins (runs.recovery.sweeper._admit_waiting_runs). A caller that asked not to wait
is answered 429 with Retry-After instead.

A version's expected cost per run is `expected_cost_micros` in its spec, or else the 90th
percentile over its last LEARN_FROM succeeded runs (from MIN_LEARNED of them) of what each spent
plus its largest single reservation, or else, with nothing to learn from (a cold version), the
run's own cost limit capped at the tenant's daily budget (its worst case). The largest reservation
is in it because a run needs that much room at its peak, not only what it ends up spending: its
last call reserves a worst case (several times what the call costs) on top of everything spent
before it. Sized by spend alone, admitted runs would refuse each other's reservations and stop
part-way, which admission is there to prevent. The expectation is snapshotted on the run
(Run.expected_cost_micros), so the sum above is one SQL statement; the sweeper recomputes a waiting
run's before admitting it, so runs queued while their version was cold use what was learned since.

Admission always makes progress. Room alone would let a queue wait forever: 50 runs of a cold
version with a 2.00 limit on a day with 0.20 left never fit their worst case. So when nothing of
the tenant is admitted and unfinished and the day has budget left, the head of the queue starts
alone (at most one run at a time is then at risk of stopping part-way, and the ledger still
refuses what does not fit). A cold version's runs thus start one at a time on a tight day until
MIN_LEARNED have succeeded, then by their learned p90. Once a run of the tenant has stopped today
on the day's budget (tenant_budget_exhausted), the day has shown it cannot carry one more, and the
queue waits for the next local day instead of starting run after run that stops at once. A run
whose configured or learned expectation is above the tenant's whole daily budget could never be
admitted by room: start_run refuses it (422 expected_cost_exceeds_daily_budget) instead of letting it
wait forever.

Admission decisions of one tenant are serialized on its row (start_run and admit_waiting both
lock it), and room is read in one statement, so the day's balances and the admitted runs'
spending are one consistent snapshot. The ledger still refuses any reservation that does not fit:
admission decides who starts, the ledger guarantees the limit.
"""

from __future__ import annotations

import datetime as dt
import math

from django.conf import settings
from django.db import connection
from django.db.models import Max, Q

from agents.spec import spec_for
from budgets import services as budgets
from budgets.models import BudgetAccount
from core import sql
from runs.models import TERMINAL, Run, RunStatus, Step, StopReason

LEARN_FROM = 20
MIN_LEARNED = 5
# A refused caller is told to come back after this long when room may appear before tomorrow
# (a run finishing under its expectation frees it; the sweeper notices within its period).
RETRY_SOON_SECONDS = 30


def expectation(*, version, limits: dict, tenant) -> tuple[int, str]:
    """(what a run of this version is expected to cost in micros, where that comes from:
    "configured", "learned" or "cold"). A configured or learned figure may exceed the tenant's daily
    budget (start_run refuses such a run); the cold worst case is capped by it."""
    configured = spec_for(version).expected_cost_micros
    if configured:
        return max(min(int(configured), limits["max_cost_micros"]), 1), "configured"
    recent = list(
        Run.objects.filter(version=version, status=RunStatus.SUCCEEDED, evaluation=False)
        .order_by("-finished_at")
        .values_list("pk", "budget__spent_micros", "budget__held_micros")[:LEARN_FROM]
    )
    # The runs' largest reservations in a second statement that names the runs: steps are
    # partitioned by their run, and a join from runs planned every month's partition (4.8 ms a
    # call with seven years of months kept; 2.9 ms this way).
    largest = dict(
        Step.objects.filter(run_id__in=[pk for pk, _, _ in recent])
        .values("run_id")
        .annotate(largest=Max("reserved_micros"))
        .values_list("run_id", "largest")
    )
    peaks = [spent + held + (largest.get(pk) or 0) for pk, spent, held in recent if spent is not None]
    if len(peaks) >= MIN_LEARNED:
        costs = sorted(peaks)
        learned = costs[math.ceil(0.9 * len(costs)) - 1]  # nearest-rank 90th percentile
        return max(min(learned, limits["max_cost_micros"]), 1), "learned"
    return max(min(limits["max_cost_micros"], tenant.daily_budget_micros), 1), "cold"


def expected_cost(*, version, limits: dict, tenant) -> int:
    """What a run of this version is expected to cost, in micros (see the module docstring)."""
    return expectation(version=version, limits=limits, tenant=tenant)[0]


def room_micros(tenant) -> tuple[int, int]:
    """(room for new runs, the day's remaining budget), read in one statement. The day is the
    budget clock's (budgets.clock), the one reservations are charged to."""
    day = budgets.local_day(tenant)
    budgets.tenant_day_account(tenant, day)  # opens the day's accounts if need be
    terminal = sorted(TERMINAL)
    marks = ", ".join(["%s"] * len(terminal))
    accounts = sql.table(BudgetAccount)
    unspent = "(r.expected_cost_micros - b.spent_micros - b.reserved_micros - b.held_micros)"
    statement = (
        f"SELECT (SELECT COALESCE(SUM(d.limit_micros - d.reserved_micros - d.spent_micros - d.held_micros), 0) "
        f"FROM {accounts} d WHERE d.tenant_id = %s AND d.scope = %s AND d.day = %s), "
        f"(SELECT COALESCE(SUM(CASE WHEN {unspent} > 0 THEN {unspent} ELSE 0 END), 0) "
        f"FROM {sql.table(Run)} r JOIN {accounts} b ON b.run_id = r.id "
        f"WHERE r.tenant_id = %s AND r.admitted_at IS NOT NULL AND r.status NOT IN ({marks}))"
    )
    with connection.cursor() as cursor:
        cursor.execute(statement, [tenant.pk, BudgetAccount.Scope.TENANT_DAY, day, tenant.pk, *terminal])
        remaining, committed = cursor.fetchone()
    return int(remaining) - int(committed), int(remaining)


def waiting_runs(tenant):
    """Runs of the tenant waiting to be admitted, oldest first (a run paused mid-way for budget
    was admitted before: it has admitted_at and waits for its resume_at instead)."""
    return Run.objects.filter(tenant=tenant, status=RunStatus.WAITING_BUDGET, admitted_at__isnull=True)


def _running(tenant):
    return Run.objects.filter(tenant=tenant, admitted_at__isnull=False).exclude(status__in=TERMINAL)


def day_gave_out(tenant, now: dt.datetime | None = None) -> bool:
    """Has a run of the tenant stopped today because the day's budget could not carry it?"""
    now = now or budgets.clock()
    day_began = budgets.next_local_midnight(tenant, now) - dt.timedelta(days=1)
    return Run.objects.filter(
        tenant=tenant, stop_reason=StopReason.TENANT_BUDGET_EXHAUSTED, finished_at__gte=day_began
    ).exists()


def may_start_alone(tenant, remaining: int, now: dt.datetime | None = None) -> bool:
    """The progress rule: nothing of the tenant admitted and unfinished, budget left today, and no
    run has stopped on today's budget. The caller holds the tenant row lock."""
    return remaining > 0 and not _running(tenant).exists() and not day_gave_out(tenant, now)


def decide(*, tenant, expected: int) -> tuple[bool, int]:
    """(admit now?, Retry-After seconds if not). The caller holds the tenant row lock."""
    room, remaining = room_micros(tenant)
    now = budgets.clock()
    if not waiting_runs(tenant).exists() and (room >= expected or may_start_alone(tenant, remaining, now)):
        return True, 0
    until_tomorrow = int((budgets.next_local_midnight(tenant, now) - now).total_seconds()) + 1
    # With nothing left today, nothing frees room before tomorrow.
    return False, until_tomorrow if remaining <= 0 or day_gave_out(tenant, now) else min(
        RETRY_SOON_SECONDS, until_tomorrow
    )


def expected_start(run, now: dt.datetime | None = None) -> dict | None:
    """When a run waiting for admission is expected to start, for its API representation and page:
    {"when": "next_admission_pass" | "as_admitted_runs_finish" | "next_local_midnight",
     "at": a time or None, "runs_ahead": n}. None for a run not waiting to be admitted."""
    if run.status != RunStatus.WAITING_BUDGET or run.admitted_at is not None:
        return None
    tenant = run.tenant
    now = now or budgets.clock()
    ahead = (
        waiting_runs(tenant)
        .filter(Q(created_at__lt=run.created_at) | Q(created_at=run.created_at, id__lt=run.id))
        .count()
    )
    room, remaining = room_micros(tenant)
    if remaining <= 0 or day_gave_out(tenant, now):
        when, at = "next_local_midnight", budgets.next_local_midnight(tenant, now)
    elif ahead == 0 and (room >= (run.expected_cost_micros or 0) or may_start_alone(tenant, remaining, now)):
        interval = settings.CELERY_BEAT_SCHEDULE["sweep"]["schedule"]
        when, at = "next_admission_pass", now + dt.timedelta(seconds=float(interval))
    else:
        # Budget remains: the progress rule starts the head once the admitted runs finish.
        when, at = "as_admitted_runs_finish", None
    return {"when": when, "at": at, "runs_ahead": ahead}
