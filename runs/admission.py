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
plus its largest single reservation, or else, with nothing to learn from, the run's own cost limit
(its worst case). The largest reservation is in it because a run needs that much room at its
peak, not only what it ends up spending: its last call reserves a worst case (several times what
the call costs) on top of everything spent before it. Sized by spend alone, admitted runs would
refuse each other's reservations and stop part-way, which admission is there to prevent. It is capped at the tenant's
daily budget, so a version more expensive than a whole day still runs, alone, on a fresh day,
instead of blocking the queue behind it forever. The expectation is snapshotted on the run at
admission (Run.expected_cost_micros), so the sum above is one SQL statement.

Admission decisions of one tenant are serialized on its row (start_run and admit_waiting both
lock it), and room is read in one statement, so the day's balances and the admitted runs'
spending are one consistent snapshot. The ledger still refuses any reservation that does not fit:
admission decides who starts, the ledger guarantees the limit.
"""

from __future__ import annotations

import math

from django.db import connection
from django.db.models import Max

from agentplatform import sql
from agents.spec import spec_for
from budgets import services as budgets
from budgets.models import BudgetAccount
from runs.models import TERMINAL, Run, RunStatus

LEARN_FROM = 20
MIN_LEARNED = 5
# A refused caller is told to come back after this long when room may appear before tomorrow
# (a run finishing under its expectation frees it; the sweeper notices within its period).
RETRY_SOON_SECONDS = 30


def expected_cost(*, version, limits: dict, tenant) -> int:
    """What a run of this version is expected to cost, in micros (see the module docstring)."""
    configured = spec_for(version).expected_cost_micros
    if configured:
        expected = int(configured)
    else:
        peaks = [
            spent + held + (reserved or 0)
            for spent, held, reserved in Run.objects.filter(version=version, status=RunStatus.SUCCEEDED)
            .order_by("-finished_at")
            .annotate(largest_reservation=Max("steps__reserved_micros"))
            .values_list("budget__spent_micros", "budget__held_micros", "largest_reservation")[:LEARN_FROM]
            if spent is not None
        ]
        if len(peaks) >= MIN_LEARNED:
            costs = sorted(peaks)
            expected = costs[math.ceil(0.9 * len(costs)) - 1]  # nearest-rank 90th percentile
        else:
            expected = limits["max_cost_micros"]
    return max(min(expected, limits["max_cost_micros"], tenant.daily_budget_micros), 1)


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


def decide(*, tenant, expected: int) -> tuple[bool, int]:
    """(admit now?, Retry-After seconds if not). The caller holds the tenant row lock."""
    room, remaining = room_micros(tenant)
    if room >= expected and not waiting_runs(tenant).exists():
        return True, 0
    now = budgets.clock()
    until_tomorrow = int((budgets.next_local_midnight(tenant, now) - now).total_seconds()) + 1
    # If even a day with no other run on it has too little left, nothing frees room before tomorrow.
    return False, until_tomorrow if remaining < expected else min(RETRY_SOON_SECONDS, until_tomorrow)
