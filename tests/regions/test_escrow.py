"""The day budget across two regions (DESIGN.md section 9, docs/regions.md), against two real
PostgreSQL clusters, two Redis servers, the home's API process and a link the test cuts.

Money is asserted on both ledgers' rows: the home's (read by its own process) and this region's.
"""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid

import httpx
import pytest
from django.utils import timezone

from budgets import services as budgets
from budgets.models import Reservation
from regions import services as regions
from regions.client import GRANT_PATH
from regions.models import Heartbeat, HomeLink, SliceRequest, TenantRegions
from regions.selectors import parked_by_reason, region_books
from regions.signing import sign_request
from runs.engine import advance
from runs.engine.decisions import REGION_UNREACHABLE
from runs.models import Run, RunEvent
from runs.services import start_run
from tests import factories
from tests.regions import race
from tests.regions.conftest import AWAY, HOME, KEY
from tests.servers import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.timeout(900)]

ZONE = "Asia/Kolkata"
RUNS = 50


def _tenant(home, slug: str, *, calls: int, slice_calls: int, user_calls: int | None = None) -> tuple:
    """The tenant in both regions: its day fits about `calls` model calls; slices of `slice_calls`;
    with `user_calls`, each user's day fits about that many (its user has the same id at home, as
    replication keeps the home's ids)."""
    tenant = factories.make_tenant(slug, time_zone=ZONE, max_active_runs=200, max_starts_per_minute=200)
    asha = factories.make_user(tenant, f"asha-{slug}")
    per_call = race.make_racing_agent(tenant, asha, factories)
    tenant.daily_budget_micros = calls * per_call
    if user_calls is not None:
        tenant.user_daily_budget_micros = user_calls * per_call
    tenant.save()
    # Authority's reach is test_authority.py's business: here a copy a day old may be acted on.
    config = TenantRegions.objects.create(
        tenant=tenant,
        home=HOME,
        allowed=[HOME, AWAY],
        slice_micros=slice_calls * per_call,
        revocation_reach_seconds=86_400,
    )
    Heartbeat.objects.update_or_create(region=HOME, defaults={"beat_at": timezone.now()})
    answer = home.run(
        "setup",
        {
            "slug": slug,
            "daily": tenant.daily_budget_micros,
            "slice": config.slice_micros,
            "zone": ZONE,
            "regions": [HOME, AWAY],
            "user_daily": tenant.user_daily_budget_micros,
            "user_id": asha.pk if user_calls is not None else None,
        },
    )
    assert answer["per_call"] == per_call  # the same agent, priced the same, in both regions
    return tenant, asha, config


def _keeper(config):
    def tend() -> None:
        config.refresh_from_db()
        regions.tend(config)

    return tend


def _settle_books(config) -> None:
    """Let the keeper send what is pending (the link is up), so both sides agree to the micro."""
    wait_for(
        lambda: (regions.tend(config), not SliceRequest.objects.filter(status="pending").exists())[1],
        timeout=30,
        what="no request pending",
    )


def _assert_books(home, tenant, day: dt.date) -> dict:
    """Both ledgers reconciled: the home's limit plus what it lent is the daily budget; what it
    lent Frankfurt is Frankfurt's limit; each region spent exactly its steps' costs; nothing is
    reserved or held; the two together spent at most the daily budget. Returns the totals."""
    at_home = home.run("books", {"slug": tenant.slug, "day": day.isoformat()})
    here = race.books(tenant)
    assert at_home["check"] == {}, at_home
    assert region_books(tenant, day) == {}
    lent = at_home["lent"].get(AWAY, {"granted": 0, "returned": 0})
    away_day = here["days"].get(day.isoformat(), {"limit": 0, "reserved": 0, "spent": 0, "held": 0})
    home_day = at_home["days"][day.isoformat()]
    assert lent["granted"] - lent["returned"] == away_day["limit"], (lent, away_day)
    assert home_day["limit"] + away_day["limit"] == tenant.daily_budget_micros
    for side in (home_day, away_day):
        assert (side["reserved"], side["held"]) == (0, 0), side
        assert side["spent"] <= side["limit"]
    spent = sum(d["spent"] for d in at_home["days"].values()) + sum(d["spent"] for d in here["days"].values())
    assert spent == at_home["step_costs"] + here["step_costs"]
    assert home_day["spent"] + away_day["spent"] <= tenant.daily_budget_micros
    assert not Reservation.objects.filter(tenant=tenant, status="open").exists()
    return {"home": home_day, "away": away_day, "home_runs": at_home["runs"], "away_runs": here["runs"]}


def test_it_refuses_requests_that_are_not_signed_by_a_known_region(home, link):
    tenant, _, _ = _tenant(home, "unsigned", calls=10, slice_calls=2)
    body = json.dumps(
        {"tenant": tenant.slug, "day": "2026-01-01", "request_id": str(uuid.uuid4()), "amount_micros": 5}
    ).encode()
    url = link.url + GRANT_PATH
    signed = sign_request(key=KEY, region=AWAY, method="POST", path=GRANT_PATH, body=body)
    forged = sign_request(key="not-the-key", region=AWAY, method="POST", path=GRANT_PATH, body=body)
    stale = sign_request(
        key=KEY, region=AWAY, method="POST", path=GRANT_PATH, body=body, now=time.time() - 120
    )
    assert httpx.post(url, content=body).status_code == 403
    assert httpx.post(url, content=body, headers=forged).status_code == 403
    assert httpx.post(url, content=body, headers=stale).status_code == 403
    assert httpx.post(url, content=body + b" ", headers=signed).status_code == 403  # body changed
    assert httpx.post(url, content=body, headers={**signed, "X-Region": "paris"}).status_code == 403
    assert home.run("books", {"slug": tenant.slug, "day": "2026-01-01"})["moves"] == []
    assert httpx.post(url, content=body, headers=signed).status_code == 200  # the same, signed
    assert len(home.run("books", {"slug": tenant.slug, "day": "2026-01-01"})["moves"]) == 1


def test_fifty_runs_racing_in_each_region_never_spend_more_than_the_one_day_budget(home, link):
    tenant, asha, config = _tenant(home, "racing", calls=40, slice_calls=6)
    day = budgets.local_day(tenant)
    at_home = home.popen("race", {"slug": tenant.slug, "runs": RUNS, "timeout": 240})
    away = race.Race(tenant, asha, runs=RUNS, keeper=_keeper(config)).start()
    try:
        assert away.wait_quiet(timeout=240)
    finally:
        away.stop()
    home_race = home.result(at_home)
    assert home_race["quiet"]
    _settle_books(config)
    totals = _assert_books(home, tenant, day)
    # Both regions spent (the slices moved), and the day was used up to about one run's worth.
    assert totals["home"]["spent"] > 0 and totals["away"]["spent"] > 0, totals
    assert totals["away_runs"].get("succeeded", 0) > 0 and totals["home_runs"].get("succeeded", 0) > 0, totals
    print("racing:", json.dumps(totals))


CUT_SECONDS = 60


def test_a_sixty_second_partition_parks_the_region_within_its_slice_and_resumes_in_arrival_order(home, link):
    tenant, asha, config = _tenant(home, "partition", calls=40, slice_calls=4)
    day = budgets.local_day(tenant)
    # A lost reply first: the home applies a grant whose answer never arrives; the region keeps
    # the request pending and sends it again, same id, once the replies come back. Only the
    # grants' answers are lost, from the first one: the keeper's probe gets through and the
    # region asks (losing every answer would stop it at the probe, and a region holding its
    # whole share by the time a run succeeded would never ask again).
    link.lose_replies = GRANT_PATH
    away = race.Race(tenant, asha, runs=20, keeper=_keeper(config)).start()
    try:
        wait_for(
            lambda: SliceRequest.objects.filter(tenant=tenant, status="pending", attempts__gte=2).exists(),
            timeout=60,
            what="a grant sent again after its answer was lost",
        )
        link.lose_replies = False
        wait_for(
            lambda: not SliceRequest.objects.filter(tenant=tenant, status="pending").exists(), timeout=30
        )

        link.cut()
        cut_at = time.monotonic()
        limit_at_cut = budgets.tenant_day_account(tenant, day).limit_micros
        wait_for(
            lambda: parked_by_reason(tenant)[REGION_UNREACHABLE] > 0, timeout=CUT_SECONDS, what="a parked run"
        )
        while time.monotonic() - cut_at < CUT_SECONDS:
            account = budgets.tenant_day_account(tenant, day)
            assert account.limit_micros == limit_at_cut  # nothing granted while cut off
            assert (
                account.reserved_micros + account.spent_micros + account.held_micros <= account.limit_micros
            )
            time.sleep(1)
        assert HomeLink.objects.get(tenant=tenant).state == "down"
        parked = list(regions.parked_runs(tenant).values_list("pk", flat=True))
        assert parked
        healed_at = timezone.now()
        link.heal()
        assert away.wait_quiet(timeout=240)
    finally:
        away.stop()
    # Resumed in the order they parked.
    resumed = [
        event.run_id
        for event in RunEvent.objects.filter(run_id__in=parked, at__gte=healed_at).order_by("at", "id")
        if event.message.startswith("resumed: a budget slice arrived")
    ]
    first_resume = list(dict.fromkeys(resumed))
    assert first_resume[: len(parked)] == parked[: len(first_resume)]
    assert {r.status for r in Run.objects.filter(pk__in=parked)} <= {"succeeded", "stopped"}
    _settle_books(config)
    totals = _assert_books(home, tenant, day)
    assert SliceRequest.objects.filter(tenant=tenant, attempts__gte=2, status="applied").exists()
    print("partition:", json.dumps(totals), "parked:", len(parked))


def test_midnight_during_a_partition_spends_no_new_day_money_from_an_old_slice(home, link, monkeypatch):
    # Four runs on a slice of 20 calls: the most one region may hold (away_share_percent, 50).
    tenant, asha, config = _tenant(home, "midnight", calls=40, slice_calls=20)
    today = budgets.local_day(tenant)
    wait_for(  # a slice of today (the keeper's passes: the home's first answer may be slow)
        lambda: (
            (regions.tend(config), budgets.tenant_day_account(tenant, today).limit_micros)[1]
            == config.slice_micros
        ),
        timeout=60,
        interval=1,
        what="today's slice",
    )
    runs = [start_run(user=asha, agent="agent", input={"i": i})[0].pk for i in range(4)]
    assert {Run.objects.get(pk=r).status for r in runs} == {"queued"}  # admitted on today's slice
    link.cut()
    regions.tend(config)  # finds the home unreachable
    midnight = budgets.next_local_midnight(tenant)
    shift = midnight - budgets.clock() + dt.timedelta(minutes=1)
    monkeypatch.setattr(budgets, "clock", lambda: dt.datetime.now(dt.UTC) + shift)
    tomorrow = budgets.local_day(tenant)
    assert tomorrow == today + dt.timedelta(days=1)
    for run_id in runs:
        advance(run_id)
    assert parked_by_reason(tenant)[REGION_UNREACHABLE] == 4
    assert not Reservation.objects.filter(tenant=tenant).exists()  # neither day's money moved
    assert budgets.tenant_day_account(tenant, today).spent_micros == 0
    link.heal()
    wait_for(  # the keeper gives yesterday's slice back, asks for today's, resumes the runs
        lambda: (regions.tend(config), not regions.parked_runs(tenant).exists())[1],
        timeout=60,
        interval=1,
        what="the runs resumed",
    )
    for run_id in runs:
        for _ in range(20):
            advance(run_id)
            if Run.objects.get(pk=run_id).status in ("succeeded", "stopped"):
                break
    assert {Run.objects.get(pk=r).status for r in runs} == {"succeeded"}
    assert set(Reservation.objects.filter(tenant=tenant).values_list("day", flat=True)) == {tomorrow}
    old = budgets.tenant_day_account(tenant, today)
    assert (old.limit_micros, old.spent_micros) == (0, 0)  # the old slice closed, all given back
    _settle_books(config)
    _assert_books(home, tenant, today)
    _assert_books(home, tenant, tomorrow)
