"""budgets.services against real PostgreSQL: reserve, settle, release, hold, reconcile, write off.

Every test checks the rows: account balances, reservation status, and that the ledger entries of
each account add up to its balances (budgets.selectors.ledger_mismatches).
"""

from __future__ import annotations

import datetime as dt
import zoneinfo

import pytest
from django.db import IntegrityError, transaction

from budgets import services as budgets
from budgets.models import BudgetAccount, LedgerEntry, Reservation
from runs.services import start_run
from tests import factories
from tests.budgets.conftest import assert_books_balance, in_threads

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def run(tenant, asha):
    factories.make_agent(tenant, turns=[{"text": "done"}], limits={"max_cost_micros": 100_000})
    run, _ = start_run(user=asha, agent="agent", input={})
    return run


def accounts(run, day=None):
    day_account = budgets.tenant_day_account(run.tenant, day or budgets.local_day(run.tenant))
    return day_account, BudgetAccount.objects.get(run=run)


def kinds(reservation) -> list[tuple[str, int]]:
    return [(e.kind, e.amount_micros) for e in LedgerEntry.objects.filter(reservation=reservation)]


def test_it_reserves_on_the_day_and_the_run_then_settles_the_actual_cost(tenant, run):
    reservation = budgets.reserve(tenant=tenant, run=run, amount_micros=30_000, purpose="model")
    day, account = accounts(run)
    assert (day.reserved_micros, account.reserved_micros) == (30_000, 30_000)
    assert account.remaining_micros == 70_000

    assert budgets.settle(reservation.pk, actual_micros=21_000)
    day, account = accounts(run)
    for a in (day, account):
        assert (a.reserved_micros, a.spent_micros, a.held_micros, a.overage_micros) == (0, 21_000, 0, 0)
    reservation.refresh_from_db()
    assert (reservation.status, reservation.actual_micros, reservation.overage) == ("settled", 21_000, False)
    assert kinds(reservation) == [("reserve", 30_000), ("settle", 21_000), ("release", 9_000)]
    assert_books_balance(tenant)


def test_it_refuses_a_reservation_any_account_cannot_fit_and_moves_nothing(tenant, run):
    with pytest.raises(budgets.BudgetExceeded) as refused:
        budgets.reserve(tenant=tenant, run=run, amount_micros=100_001, purpose="model")
    assert refused.value.scope == "run" and refused.value.code == "run_budget_exhausted"
    day, account = accounts(run)
    assert day.reserved_micros == account.reserved_micros == 0  # the day's take was rolled back
    assert not Reservation.objects.exists() and not LedgerEntry.objects.exists()

    budgets.set_day_limit(tenant, budgets.local_day(tenant), 50_000)
    with pytest.raises(budgets.BudgetExceeded) as refused:
        budgets.reserve(tenant=tenant, run=run, amount_micros=60_000, purpose="model")
    assert refused.value.scope == "tenant_day" and refused.value.status == 429
    assert budgets.reserve(tenant=tenant, run=run, amount_micros=50_000, purpose="model")  # exactly full fits
    assert [a.remaining_micros for a in accounts(run)] == [0, 50_000]


def test_it_limits_each_user_per_day_when_the_tenant_says_so(tenant, asha, run):
    tenant.user_daily_budget_micros = 10_000
    tenant.save()
    budgets.reserve(tenant=tenant, run=run, user=asha, amount_micros=6_000, purpose="model")
    with pytest.raises(budgets.BudgetExceeded) as refused:
        budgets.reserve(tenant=tenant, run=run, user=asha, amount_micros=6_000, purpose="model")
    assert refused.value.scope == "user_day"
    user_day = BudgetAccount.objects.get(scope="user_day", user=asha)
    assert (user_day.limit_micros, user_day.reserved_micros) == (10_000, 6_000)
    assert accounts(run)[1].reserved_micros == 6_000


def test_it_records_and_flags_an_overage(tenant, run):
    reservation = budgets.reserve(tenant=tenant, run=run, amount_micros=10_000, purpose="model")
    assert budgets.settle(reservation.pk, actual_micros=12_500)
    reservation.refresh_from_db()
    assert reservation.overage and reservation.actual_micros == 12_500
    for a in accounts(run):
        assert (a.spent_micros, a.overage_micros, a.reserved_micros) == (12_500, 2_500, 0)
    assert LedgerEntry.objects.get(reservation=reservation, kind="overage").amount_micros == 2_500
    assert_books_balance(tenant)


def test_it_keeps_a_hold_out_of_reach_until_reconciled_or_written_off(tenant, ravi, run):
    lost = budgets.reserve(tenant=tenant, run=run, amount_micros=40_000, purpose="model")
    assert budgets.hold(lost.pk, note="response lost")
    day, account = accounts(run)
    assert (account.reserved_micros, account.held_micros, account.remaining_micros) == (0, 40_000, 60_000)
    assert not budgets.release(lost.pk), "recovery must never release a hold"
    assert not budgets.settle(lost.pk, actual_micros=1)
    with pytest.raises(budgets.BudgetExceeded):
        budgets.reserve(tenant=tenant, run=run, amount_micros=60_001, purpose="model")

    assert budgets.reconcile(lost.pk, actual_micros=25_000, actor=ravi, note="provider usage export")
    assert not budgets.reconcile(lost.pk, actual_micros=25_000, actor=ravi, note="twice")
    for a in accounts(run):
        assert (a.held_micros, a.spent_micros) == (0, 25_000)
    lost.refresh_from_db()
    assert (lost.status, lost.closed_by, lost.actual_micros) == ("reconciled", ravi, 25_000)

    other = budgets.reserve(tenant=tenant, run=run, amount_micros=5_000, purpose="tool")
    budgets.hold(other.pk)
    assert budgets.write_off(other.pk, actor=ravi, note="provider confirms no charge")
    for a in accounts(run):
        assert (a.held_micros, a.spent_micros) == (0, 25_000)
    assert_books_balance(tenant)


def test_it_closes_a_reservation_once_when_a_late_worker_and_recovery_race(tenant, run):
    for _ in range(10):
        reservation = budgets.reserve(tenant=tenant, run=run, amount_micros=1_000, purpose="model")
        outcomes = in_threads(
            2,
            lambda i: (
                budgets.settle(reservation.pk, actual_micros=900)
                if i == 0
                else budgets.hold(reservation.pk, note="recovery")
            ),
        )
        assert sorted(outcomes) == [False, True]
    day, account = accounts(run)
    settled = Reservation.objects.filter(status="settled").count()
    held = Reservation.objects.filter(status="held").count()
    assert settled + held == 10
    assert (account.spent_micros, account.held_micros) == (900 * settled, 1_000 * held)
    assert_books_balance(tenant)


def test_it_never_lets_concurrent_reservations_of_one_run_overshoot(tenant, run):
    """Retries and parallel tool calls of one run all draw on the same run account."""

    def attempt(i: int) -> int:
        granted = 0
        for _ in range(10):
            try:
                reservation = budgets.reserve(tenant=tenant, run=run, amount_micros=3_000, purpose="tool")
            except budgets.BudgetExceeded:
                continue
            granted += 3_000
            if i % 3 == 0:
                budgets.settle(reservation.pk, actual_micros=3_000)
        return granted

    granted = sum(in_threads(16, attempt))
    assert granted == 99_000  # 33 of 160 attempts fit under 100,000; none more
    _, account = accounts(run)
    assert account.reserved_micros + account.spent_micros == 99_000 <= account.limit_micros
    assert Reservation.objects.count() == 33
    for reservation in Reservation.objects.filter(status="open"):
        budgets.release(reservation.pk)
    assert_books_balance(tenant)


def test_the_database_refuses_a_negative_balance(tenant, run):
    _, account = accounts(run)
    with pytest.raises(IntegrityError), transaction.atomic():
        BudgetAccount.objects.filter(pk=account.pk).update(reserved_micros=-1)


@pytest.mark.parametrize(
    "zone, before, after",
    [
        (
            "Asia/Kolkata",
            dt.datetime(2025, 3, 14, 18, 29, 59, tzinfo=dt.UTC),
            dt.datetime(2025, 3, 14, 18, 30, tzinfo=dt.UTC),
        ),
        (
            "America/Los_Angeles",
            dt.datetime(2025, 3, 15, 6, 59, 59, tzinfo=dt.UTC),
            dt.datetime(2025, 3, 15, 7, 0, tzinfo=dt.UTC),
        ),  # PDT: local midnight is 07:00 UTC
    ],
)
def test_it_charges_the_local_day_the_reservation_was_made_on(tenant, run, zone, before, after):
    tenant.time_zone = zone
    tenant.save()
    late = budgets.reserve(tenant=tenant, run=run, amount_micros=10_000, purpose="model", now=before)
    early = budgets.reserve(tenant=tenant, run=run, amount_micros=20_000, purpose="model", now=after)
    assert (
        budgets.local_day(tenant, before).isoformat()
        == before.astimezone(zoneinfo.ZoneInfo(zone)).date().isoformat()
    )
    assert (late.day, early.day) == (
        budgets.local_day(tenant, before),
        budgets.local_day(tenant, before) + dt.timedelta(days=1),
    )
    assert budgets.next_local_midnight(tenant, before) == after
    # Settled after midnight, the late charge stays on the day it was reserved on.
    budgets.settle(late.pk, actual_micros=9_000)
    budgets.settle(early.pk, actual_micros=19_000)
    old_day, run_account = accounts(run, late.day)
    new_day, _ = accounts(run, early.day)
    assert (old_day.spent_micros, new_day.spent_micros) == (9_000, 19_000)
    assert run_account.spent_micros == 28_000  # the run's budget does not reset at midnight
    assert_books_balance(tenant)


def test_every_movement_writes_one_entry_that_moves_all_accounts_of_its_reservation(tenant, asha, ravi, run):
    tenant.user_daily_budget_micros = 1_000_000
    tenant.save()
    settled = budgets.reserve(tenant=tenant, run=run, user=asha, amount_micros=5_000, purpose="model")
    budgets.settle(settled.pk, actual_micros=5_000)
    released = budgets.reserve(tenant=tenant, run=run, user=asha, amount_micros=2_000, purpose="tool")
    budgets.release(released.pk, note="not sent")
    held = budgets.reserve(tenant=tenant, run=run, user=asha, amount_micros=3_000, purpose="model")
    budgets.hold(held.pk)
    budgets.reconcile(held.pk, actual_micros=3_500, actor=ravi, note="usage export")

    three = {settled.day_account_id, settled.user_account_id, settled.run_account_id}
    assert None not in three and len(three) == 3
    expected = {
        settled: ["reserve", "settle"],
        released: ["reserve", "release"],
        held: ["reserve", "hold", "reconcile", "overage"],
    }
    for reservation, entry_kinds in expected.items():
        assert (
            list(LedgerEntry.objects.filter(reservation=reservation).values_list("kind", flat=True))
            == entry_kinds
        )
    assert LedgerEntry.objects.get(reservation=held, kind="reconcile").actor == ravi
    for account in BudgetAccount.objects.filter(pk__in=three):
        assert (account.spent_micros, account.overage_micros) == (8_500, 500)
    assert_books_balance(tenant)


def test_the_sweeper_releases_a_reservation_whose_worker_died_before_dispatching(tenant, run):
    from django.utils import timezone

    from runs.models import Step
    from runs.recovery import sweeper

    orphan = budgets.reserve(tenant=tenant, run=run, amount_micros=7_000, purpose="model")
    in_flight = budgets.reserve(tenant=tenant, run=run, amount_micros=8_000, purpose="model")
    step = Step.objects.create(run=run, seq=1, kind="model", status="dispatching")
    Reservation.objects.filter(pk=in_flight.pk).update(step=step)
    recent = budgets.reserve(tenant=tenant, run=run, amount_micros=9_000, purpose="model")
    Reservation.objects.filter(pk__in=[orphan.pk, in_flight.pk]).update(
        created_at=timezone.now() - dt.timedelta(hours=1)
    )

    assert sweeper.sweep()["orphan_reservations"] == 1
    statuses = dict(Reservation.objects.values_list("pk", "status"))
    assert statuses == {orphan.pk: "released", in_flight.pk: "open", recent.pk: "open"}
    assert "never dispatched" in LedgerEntry.objects.filter(reservation=orphan, kind="release").first().note
    _, account = accounts(run)
    assert account.reserved_micros == 17_000
    assert sweeper.sweep()["orphan_reservations"] == 0
