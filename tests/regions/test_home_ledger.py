"""The home's slice ledger (regions/services.py), in this process playing the home: every grant
and return applied once by its request id, repeated or raced; never more lent than the home may."""

from __future__ import annotations

import uuid

import pytest

from budgets import services as budgets
from core.errors import Conflict
from regions import services as regions
from regions.models import RegionDay, SliceMove, TenantRegions
from regions.selectors import home_books
from tests import factories
from tests.budgets.conftest import in_threads

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def home(tenant, settings):
    settings.REGION_NAME = "mumbai"
    tenant.daily_budget_micros = 1_000_000
    tenant.save()
    TenantRegions.objects.create(
        tenant=tenant, home="mumbai", allowed=["mumbai", "frankfurt"], away_share_percent=60
    )
    return tenant


def _limit(tenant) -> int:
    return budgets.tenant_day_account(tenant, budgets.local_day(tenant)).limit_micros


def test_a_repeated_grant_or_return_is_answered_as_the_first_and_moves_nothing_more(home):
    day = budgets.local_day(home)
    asked = uuid.uuid4()
    first = regions.grant(tenant=home, region="frankfurt", day=day, request_id=asked, asked_micros=300_000)
    again = regions.grant(tenant=home, region="frankfurt", day=day, request_id=asked, asked_micros=300_000)
    assert first["moved_micros"] == again["moved_micros"] == 300_000
    assert _limit(home) == 700_000
    back = uuid.uuid4()
    assert (
        regions.take_back(tenant=home, region="frankfurt", day=day, request_id=back, amount_micros=300_000)[
            "moved_micros"
        ]
        == 300_000
    )
    # Nothing is outstanding now, yet the repeat of the return is answered, not refused.
    assert (
        regions.take_back(tenant=home, region="frankfurt", day=day, request_id=back, amount_micros=300_000)[
            "moved_micros"
        ]
        == 300_000
    )
    assert _limit(home) == 1_000_000 and home_books(home, day) == {}
    with pytest.raises(Conflict):  # a new return of what was never lent
        regions.take_back(tenant=home, region="frankfurt", day=day, request_id=uuid.uuid4(), amount_micros=1)


def test_the_same_grant_raced_eight_times_moves_once(home):
    day = budgets.local_day(home)
    asked = uuid.uuid4()
    answers = in_threads(
        8,
        lambda i: regions.grant(
            tenant=home, region="frankfurt", day=day, request_id=asked, asked_micros=200_000
        ),
    )
    assert {a["moved_micros"] for a in answers} == {200_000}
    assert SliceMove.objects.count() == 1 and _limit(home) == 800_000
    assert RegionDay.objects.get().granted_micros == 200_000 and home_books(home, day) == {}


def test_it_lends_no_more_than_the_regions_share_nor_what_it_has_free(home):
    day = budgets.local_day(home)
    grants = [
        regions.grant(tenant=home, region="frankfurt", day=day, request_id=uuid.uuid4(), asked_micros=400_000)
        for _ in range(3)
    ]
    assert [g["moved_micros"] for g in grants] == [400_000, 200_000, 0]  # 60% of the day at most
    assert grants[-1]["home_free_micros"] == 0  # nothing more for frankfurt
    budgets.reserve(tenant=home, amount_micros=350_000, purpose="tool")  # the home spends
    other = regions.grant(tenant=home, region="paris", day=day, request_id=uuid.uuid4(), asked_micros=400_000)
    assert other["moved_micros"] == 50_000  # what is left of the day
    assert _limit(home) + 600_000 + 50_000 == 1_000_000 and home_books(home, day) == {}


def _users_move(move, tenant, user, micros: int, *, request_id: uuid.UUID | None = None) -> dict:
    """A grant or return of `micros` of the user's today, Frankfurt's request (a new id unless given)."""
    amount = {"asked_micros" if move is regions.grant else "amount_micros": micros}
    return move(
        tenant=tenant,
        region="frankfurt",
        day=budgets.local_day(tenant),
        request_id=request_id or uuid.uuid4(),
        user_id=user.pk,
        **amount,
    )


def _user_limit(tenant, user) -> int:
    return budgets.user_day_account(tenant, budgets.local_day(tenant), user.pk).limit_micros


def test_a_users_day_is_lent_by_the_same_rules_on_the_users_own_account(home, asha):
    home.user_daily_budget_micros = 100_000
    home.save()
    day = budgets.local_day(home)
    asked = uuid.uuid4()
    first = _users_move(regions.grant, home, asha, 40_000, request_id=asked)
    again = _users_move(regions.grant, home, asha, 40_000, request_id=asked)
    assert first["moved_micros"] == again["moved_micros"] == 40_000
    assert first["home_free_micros"] == 20_000  # 60 % of the user's day at most, 40 % already out
    more = _users_move(regions.grant, home, asha, 40_000)
    assert (more["moved_micros"], more["home_free_micros"]) == (20_000, 0)
    # The user's account at home lost what was lent; the tenant's day did not move.
    assert _user_limit(home, asha) == 40_000 and _limit(home) == 1_000_000
    assert RegionDay.objects.get(user=asha).outstanding_micros == 60_000
    assert home_books(home, day) == {}
    # At home the user can spend only what is left: 40,000.
    budgets.reserve(tenant=home, user=asha, amount_micros=40_000, purpose="tool")
    with pytest.raises(budgets.BudgetExceeded) as refused:
        budgets.reserve(tenant=home, user=asha, amount_micros=1, purpose="tool")
    assert refused.value.scope == "user_day"
    back = _users_move(regions.take_back, home, asha, 25_000)
    assert back["moved_micros"] == 25_000 and _user_limit(home, asha) == 65_000
    assert home_books(home, day) == {}
    # A new daily budget for users keeps what is lent out of the home's limit.
    home.user_daily_budget_micros = 200_000
    home.save()
    budgets.set_user_day_limits(home, day, 200_000)
    assert _user_limit(home, asha) == 200_000 - 35_000 and home_books(home, day) == {}


def test_a_slice_of_a_users_day_is_refused_without_a_user_day_budget_or_for_a_stranger(home, asha):
    day = budgets.local_day(home)
    with pytest.raises(Conflict, match="no day budget for user"):  # the tenant limits no user's day
        _users_move(regions.grant, home, asha, 1)
    home.user_daily_budget_micros = 100_000
    home.save()
    stranger = factories.make_user(factories.make_tenant("elsewhere"), "stranger")
    with pytest.raises(Conflict, match="no day budget for user"):
        _users_move(regions.grant, home, stranger, 1)
    assert not SliceMove.objects.exists() and home_books(home, day) == {}
