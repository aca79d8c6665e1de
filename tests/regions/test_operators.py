"""What operators and supervisors see of a region: the status API and /metrics, on a region whose
home is unreachable (no home server at all: the peer's address refuses connections)."""

from __future__ import annotations

import pytest
from django.db import transaction
from django.utils import timezone
from rest_framework.test import APIClient

from budgets import services as budgets
from regions import services as regions
from regions.models import Heartbeat, HomeLink, SliceRequest, TenantRegions
from runs.engine import advance
from runs.engine.decisions import REGION_UNREACHABLE
from runs.services import start_run
from tests import factories
from tests.observability.conftest import scrape, value
from tests.services import free_port

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def away(tenant, asha, settings):
    """Frankfurt, with Mumbai (the home) unreachable, and one run parked for want of a slice."""
    settings.REGION_NAME = "frankfurt"
    settings.REGION_PEERS = {"mumbai": f"http://127.0.0.1:{free_port()}"}  # nothing listens there
    settings.REGION_KEYS = {"mumbai": "k"}
    settings.REGION_TIMEOUT_SECONDS = 0.5
    factories.make_agent(tenant, turns=[{"text": "ok"}])
    config = TenantRegions.objects.create(tenant=tenant, home="mumbai", allowed=["mumbai", "frankfurt"])
    Heartbeat.objects.create(region="mumbai", beat_at=timezone.now())  # a fresh copy of authority
    with transaction.atomic():  # a slice of one micro: the run is let start alone, its call does not fit
        budgets.move_day_limit(tenant, budgets.local_day(tenant), 1)
    run, _ = start_run(user=asha, agent="agent", input={})
    regions.tend(config)  # the home does not answer
    advance(run.pk)
    return run


def test_a_refused_call_away_from_home_parks_the_run_with_the_reason(away):
    away.refresh_from_db()
    assert away.status == "waiting_budget" and away.resume_at is None
    assert away.events.filter(kind="status").last().data["region_reason"] == REGION_UNREACHABLE
    assert HomeLink.objects.get().state == "down"
    assert not SliceRequest.objects.exists()  # the probe failed first: nothing was asked


def test_supervisors_read_the_region_status_and_others_may_not(away, tenant, asha, ravi):
    client = APIClient()
    client.force_authenticate(ravi)
    body = client.get("/v1/regions/status").json()
    assert (body["region"], body["home"], body["is_home"]) == ("frankfurt", "mumbai", False)
    assert body["link"]["state"] == "down" and "ConnectError" in body["link"]["last_error"]
    assert body["parked_runs"][REGION_UNREACHABLE] == 1
    assert body["day_account"]["limit_micros"] == 1
    assert 0 <= body["authority_age_seconds"] < 60
    assert body["user_days"] == []  # the tenant limits no user's day
    client.force_authenticate(asha)
    assert client.get("/v1/regions/status").status_code == 403


def test_metrics_show_the_link_and_the_parked_runs(away, tenant):
    samples = scrape()
    assert value(samples, "agentplatform_region_link_up", tenant=tenant.slug) == 0
    assert (
        value(samples, "agentplatform_region_runs_parked", tenant=tenant.slug, reason=REGION_UNREACHABLE) == 1
    )


def test_metrics_show_the_slice_balance_away_from_home(away, tenant):
    samples = scrape()
    parts = {
        part: value(samples, "agentplatform_region_slice_balance_micros", tenant=tenant.slug, part=part)
        for part in ("limit", "free", "reserved", "spent", "held")
    }
    assert parts == {"limit": 1, "free": 1, "reserved": 0, "spent": 0, "held": 0}
    with transaction.atomic():  # a slice of 5,000 arrives, and 1,200 of it is reserved
        budgets.move_day_limit(tenant, budgets.local_day(tenant), 5_000)
    held = budgets.reserve(tenant=tenant, amount_micros=1_200, purpose="model")
    budgets.hold(held.pk)
    budgets.reserve(tenant=tenant, amount_micros=300, purpose="model")
    samples = scrape()
    parts = {
        part: value(samples, "agentplatform_region_slice_balance_micros", tenant=tenant.slug, part=part)
        for part in ("limit", "free", "reserved", "spent", "held")
    }
    assert parts == {"limit": 5_001, "free": 3_501, "reserved": 300, "spent": 0, "held": 1_200}


def test_the_home_reports_no_slice_balance_of_its_own(away, tenant):
    TenantRegions.objects.filter(tenant=tenant).update(home="frankfurt")
    names = {name for name, _ in scrape()}  # not even an empty family: no sample at all
    assert "agentplatform_region_slice_balance_micros" not in names


def test_the_region_status_shows_each_users_slices_of_today(away, tenant, asha, ravi):
    tenant.user_daily_budget_micros = 50_000
    tenant.save()
    day = budgets.local_day(tenant)
    with transaction.atomic():  # a slice of Asha's day arrives, and 700 of it is reserved
        budgets.move_day_limit(tenant, day, 5_000)
        budgets.move_user_day_limit(tenant, day, asha.pk, 2_000)
    budgets.reserve(tenant=tenant, user=asha, amount_micros=700, purpose="tool")
    client = APIClient()
    client.force_authenticate(ravi)
    body = client.get("/v1/regions/status").json()
    assert body["user_days"] == [
        {
            "user": asha.pk,
            "username": "asha",
            "limit_micros": 2_000,  # opened empty away from home: only the slice
            "reserved_micros": 700,
            "spent_micros": 0,
            "held_micros": 0,
        }
    ]
