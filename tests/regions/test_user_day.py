"""A user's day budget across two regions (DESIGN.md section 9, docs/regions.md): escrowed like the
tenant's day, on the user's own day account, against two real PostgreSQL clusters, the home's API
process and a link the test owns. Money is asserted on both ledgers' rows."""

from __future__ import annotations

import json

import pytest

from budgets import services as budgets
from regions.models import SliceRequest
from regions.selectors import region_books
from runs.models import RunEvent
from tests.regions import race
from tests.regions.conftest import AWAY
from tests.regions.test_escrow import _assert_books, _keeper, _settle_books, _tenant

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.timeout(900)]

RUNS = 15
ZERO = {"limit": 0, "reserved": 0, "spent": 0, "held": 0}


def test_one_users_runs_racing_in_two_regions_never_spend_more_than_the_users_day(home, link):
    # The tenant's day is ample; the user's fits about 24 model calls (15 runs in each region
    # want about 90): the user's day is what stops them.
    tenant, asha, config = _tenant(home, "userday", calls=400, slice_calls=6, user_calls=24)
    slug = tenant.slug
    day = budgets.local_day(tenant)
    at_home = home.popen("race", {"slug": slug, "runs": RUNS, "timeout": 240})
    away = race.Race(tenant, asha, runs=RUNS, keeper=_keeper(config)).start()
    try:
        assert away.wait_quiet(timeout=240)
    finally:
        away.stop()
    assert home.result(at_home)["quiet"]
    _settle_books(config)
    totals = _assert_books(home, tenant, day)  # the tenant's day, and the home's check of users' days
    assert region_books(tenant, day) == {}  # Frankfurt's user limit is what it was granted less returned
    books_home = home.run("books", {"slug": slug, "day": day.isoformat()})
    key = f"{day.isoformat()}/{asha.pk}"
    user_home = books_home["user_days"][key]
    user_away = race.books(tenant)["user_days"].get(key, ZERO)
    lent = books_home["user_lent"].get(f"{AWAY}/{asha.pk}", {"granted": 0, "returned": 0})
    # What the home lent Frankfurt of Asha's day and did not get back is Frankfurt's limit for her.
    assert lent["granted"] - lent["returned"] == user_away["limit"], (lent, user_away)
    assert user_home["limit"] + user_away["limit"] == tenant.user_daily_budget_micros
    for side in (user_home, user_away):
        assert (side["reserved"], side["held"]) == (0, 0), side
        assert side["spent"] <= side["limit"], side
    spent = user_home["spent"] + user_away["spent"]
    assert spent <= tenant.user_daily_budget_micros  # never more than Asha's one day
    # Every cent Asha spent is the tenant's too (she is its only user), and both regions spent.
    assert spent == totals["home"]["spent"] + totals["away"]["spent"]
    assert user_home["spent"] > 0 and user_away["spent"] > 0, (user_home, user_away)
    # Her day ran out: runs stopped on it, in Frankfurt as at home, after parking for its slices.
    assert totals["away_runs"].get("stopped", 0) > 0 and totals["home_runs"].get("stopped", 0) > 0, totals
    assert any("user_day budget" in event.message for event in RunEvent.objects.filter(run__tenant=tenant))
    assert SliceRequest.objects.filter(tenant=tenant, user=asha, kind="grant", moved_micros__gt=0).exists()
    print("user day:", json.dumps({"user_home": user_home, "user_away": user_away, "lent": lent, **totals}))
