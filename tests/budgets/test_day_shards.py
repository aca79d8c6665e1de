"""A tenant's day is split into sub-accounts (DESIGN.md section 9): the day as a whole still decides.

Each run reserves on its own sub-account; when that one is short, the day's free room is pooled
under a lock of all sub-accounts. These tests check the rows: the day never goes over its limit,
refusals happen only when the whole day is short, and the sub-accounts' limits always add up to
the daily budget.
"""

from __future__ import annotations

import threading

import pytest
from django.db import DatabaseError, connection, transaction

from budgets import services as budgets
from budgets.models import BudgetAccount, Reservation
from runs.services import start_run
from tests import factories
from tests.budgets.conftest import assert_books_balance, in_threads
from tests.servers import wait_for

SHARDS = 8
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def eight_shards(settings):
    settings.BUDGET_DAY_SHARDS = SHARDS


def make_runs(tenant, user, count: int) -> list:
    tenant.max_active_runs = tenant.max_starts_per_minute = 100
    tenant.save()
    factories.make_agent(tenant, turns=[{"text": "done"}], limits={"max_cost_micros": 1_000_000})
    return [start_run(user=user, agent="agent", input={"i": i})[0] for i in range(count)]


def sub_accounts(tenant) -> list[BudgetAccount]:
    return list(
        BudgetAccount.objects.filter(
            tenant=tenant, scope="tenant_day", day=budgets.local_day(tenant)
        ).order_by("shard")
    )


def test_the_day_opens_as_sub_accounts_whose_limits_add_up_to_the_daily_budget(tenant):
    tenant.daily_budget_micros = 1_000_003
    tenant.save()
    day = budgets.tenant_day_account(tenant, budgets.local_day(tenant))
    shards = sub_accounts(tenant)
    assert [a.shard for a in shards] == list(range(SHARDS))
    assert sum(a.limit_micros for a in shards) == day.limit_micros == 1_000_003
    assert day.remaining_micros == 1_000_003


def test_a_run_whose_sub_account_is_short_draws_on_the_rest_of_the_day(tenant, asha):
    tenant.daily_budget_micros = 80_005  # 10,000 per sub-account, 10,005 on the first
    tenant.save()
    (run,) = make_runs(tenant, asha, 1)
    first = budgets.reserve(tenant=tenant, run=run, amount_micros=70_003, purpose="model")
    own = BudgetAccount.objects.get(pk=first.day_account_id)
    assert own.shard == run.pk.int % SHARDS and own.reserved_micros == 70_003
    assert budgets.reserve(tenant=tenant, run=run, amount_micros=10_002, purpose="model")  # exactly full
    with pytest.raises(budgets.BudgetExceeded) as refused:
        budgets.reserve(tenant=tenant, run=run, amount_micros=1, purpose="model")
    assert (refused.value.scope, refused.value.code) == ("tenant_day", "tenant_day_budget_exhausted")
    shards = sub_accounts(tenant)
    assert sum(a.limit_micros for a in shards) == 80_005
    assert all(a.remaining_micros == 0 for a in shards)
    for reservation in Reservation.objects.filter(status="open"):
        budgets.settle(reservation.pk, actual_micros=reservation.amount_micros)
    assert_books_balance(tenant)


@pytest.mark.parametrize("shards", [SHARDS, 7])
def test_sixty_four_runs_racing_on_one_day_get_exactly_the_room_there_is(tenant, asha, settings, shards):
    """Runs take any free sub-account at first; near the end they all pool. None too many, and
    the limits, spread again and again in shares that do not divide evenly, still add up."""
    settings.BUDGET_DAY_SHARDS = shards
    tenant.daily_budget_micros = 40 * 10_000 + 5_003
    tenant.save()
    runs = make_runs(tenant, asha, 64)
    budgets.tenant_day_account(tenant, budgets.local_day(tenant))  # opened before the race

    def attempt(i: int) -> int:
        granted = 0
        while True:
            try:
                reservation = budgets.reserve(
                    tenant=tenant, run=runs[i], amount_micros=10_000, purpose="model"
                )
            except budgets.BudgetExceeded:
                return granted
            granted += 1
            budgets.settle(reservation.pk, actual_micros=10_000)

    assert sum(in_threads(64, attempt)) == 40
    day = budgets.tenant_day_account(tenant, budgets.local_day(tenant))
    assert (day.spent_micros, day.reserved_micros, day.limit_micros) == (400_000, 0, 405_003)
    assert len(sub_accounts(tenant)) == shards
    assert all(a.remaining_micros >= 0 for a in sub_accounts(tenant))
    assert Reservation.objects.filter(status="settled").count() == 40
    assert_books_balance(tenant)


def waiting_for_a_lock(statement: str) -> int:
    """Backends of this database waiting for a lock in a statement that starts like `statement`."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND ltrim(query, E' \\n') LIKE %s",
            [statement],
        )
        return cursor.fetchone()[0]


def test_a_run_that_pools_the_day_waits_for_it_holding_no_other_budget_account(tenant, asha):
    """The lock order that keeps reservations free of deadlocks: a transaction waits for a
    sub-account of the day only while it holds no budget account. No sub-account has room for
    the call here, so it pools the day; while it waits for a sub-account another transaction
    holds, its run account stays free. (An earlier form had already locked the run account and
    its own sub-account when it swept the day from shard 0: two runs short on the day deadlocked.)"""
    tenant.daily_budget_micros = SHARDS * 1_000  # 1,000 a sub-account; the call needs 1,500
    tenant.save()
    (run,) = make_runs(tenant, asha, 1)
    budgets.tenant_day_account(tenant, budgets.local_day(tenant))
    busy = next(a for a in sub_accounts(tenant) if a.shard == (run.pk.int + 1) % SHARDS)
    held, release = threading.Event(), threading.Event()
    found: dict = {}

    def hold_one_sub_account() -> None:
        try:
            with transaction.atomic():
                BudgetAccount.objects.select_for_update(no_key=True).get(pk=busy.pk)
                held.set()
                release.wait(30)
        finally:
            connection.close()

    def reserve() -> None:
        try:
            with transaction.atomic():  # as the engine reserves: inside the claim's transaction
                found["reservation"] = budgets.reserve(
                    tenant=tenant, run=run, amount_micros=1_500, purpose="model"
                )
        except BaseException as exc:  # re-raised by the test
            found["error"] = exc
        finally:
            connection.close()

    holder, reserver = threading.Thread(target=hold_one_sub_account), threading.Thread(target=reserve)
    holder.start()
    try:
        assert held.wait(10)
        reserver.start()
        wait_for(
            lambda: waiting_for_a_lock("WITH locked AS%"),  # RESERVE_POOLED
            timeout=10,
            interval=0.01,
            what="the reservation waiting for the busy sub-account",
        )
        with transaction.atomic():
            try:
                BudgetAccount.objects.select_for_update(no_key=True, nowait=True).get(run=run)
            except DatabaseError as exc:
                pytest.fail(f"the run account is held by a reservation waiting for the day: {exc}")
    finally:
        release.set()
        holder.join(30)
    reserver.join(30)
    if "error" in found:
        raise found["error"]
    assert found["reservation"].amount_micros == 1_500
    assert sum(a.limit_micros for a in sub_accounts(tenant)) == SHARDS * 1_000
    budgets.settle(found["reservation"].pk, actual_micros=1_500)
    assert_books_balance(tenant)


def test_lowering_the_limit_below_what_is_used_leaves_no_sub_account_any_room(tenant, asha):
    tenant.daily_budget_micros = 800_000
    tenant.save()
    runs = make_runs(tenant, asha, 16)
    for run in runs:
        budgets.reserve(tenant=tenant, run=run, amount_micros=20_000, purpose="model")  # 320,000 used
    today = budgets.local_day(tenant)

    assert budgets.set_day_limit(tenant, today, 300_000)
    assert sum(a.limit_micros for a in sub_accounts(tenant)) == 300_000
    for run in runs:
        with pytest.raises(budgets.BudgetExceeded):
            budgets.reserve(tenant=tenant, run=run, amount_micros=1, purpose="model")

    assert budgets.set_day_limit(tenant, today, 340_000)  # 20,000 free again, spread over the day
    granted = 0
    for run in runs:
        try:
            budgets.reserve(tenant=tenant, run=run, amount_micros=5_000, purpose="model")
            granted += 1
        except budgets.BudgetExceeded:
            pass
    assert granted == 4
    day = budgets.tenant_day_account(tenant, today)
    assert day.reserved_micros == 340_000 == day.limit_micros
    for reservation in Reservation.objects.filter(status="open"):
        budgets.release(reservation.pk)
    assert_books_balance(tenant)


def test_with_one_sub_account_the_day_is_a_single_account(tenant, asha, settings):
    settings.BUDGET_DAY_SHARDS = 1
    tenant.daily_budget_micros = 50_000
    tenant.save()
    (run,) = make_runs(tenant, asha, 1)
    budgets.reserve(tenant=tenant, run=run, amount_micros=50_000, purpose="model")
    with pytest.raises(budgets.BudgetExceeded):
        budgets.reserve(tenant=tenant, run=run, amount_micros=1, purpose="model")
    assert [a.shard for a in sub_accounts(tenant)] == [0]
