"""A run starts only in its tenant's allowed regions; a region's day opens empty away from home."""

from __future__ import annotations

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from budgets import services as budgets
from regions.models import Heartbeat, TenantRegions
from runs.models import Run
from tests import factories

pytestmark = pytest.mark.django_db


@pytest.fixture
def bank(tenant, asha, settings):
    factories.make_agent(tenant, turns=[{"text": "ok"}])
    TenantRegions.objects.create(tenant=tenant, home="mumbai", allowed=["mumbai", "frankfurt"])
    Heartbeat.objects.create(region="mumbai", beat_at=timezone.now())  # a fresh copy of authority
    return tenant


def _start(user):
    client = APIClient()
    client.force_authenticate(user)
    return client.post("/v1/runs", {"agent": "agent", "input": {}}, format="json")


def test_it_refuses_a_run_in_a_region_the_tenant_does_not_allow_naming_its_regions(bank, asha, settings):
    settings.REGION_NAME = "paris"
    response = _start(asha)
    assert response.status_code == 421
    error = response.json()["error"]
    assert error["code"] == "region_not_allowed"
    assert "'mumbai', 'frankfurt'" in error["message"] and error["fields"]["regions"] == [
        "mumbai",
        "frankfurt",
    ]
    assert not Run.objects.exists()


@pytest.mark.parametrize("region", ["mumbai", "frankfurt", ""])
def test_it_starts_a_run_in_an_allowed_region(bank, asha, settings, region):
    settings.REGION_NAME = region
    assert _start(asha).status_code == 201


def test_a_day_opens_empty_away_from_home_and_whole_at_home(bank, settings):
    day = budgets.local_day(bank)
    settings.REGION_NAME = "frankfurt"
    assert budgets.tenant_day_account(bank, day).limit_micros == 0
    assert budgets.set_day_limit(bank, day, 10) is False  # a region's limit is its slices, nothing else
    assert budgets.tenant_day_account(bank, day).limit_micros == 0


def test_the_home_opens_its_day_less_what_it_lent(bank, settings):
    from regions.models import RegionDay

    settings.REGION_NAME = "mumbai"
    day = budgets.local_day(bank)
    RegionDay.objects.create(
        tenant=bank, region="frankfurt", day=day, granted_micros=700, returned_micros=200
    )
    assert budgets.tenant_day_account(bank, day).limit_micros == bank.daily_budget_micros - 500
    assert budgets.set_day_limit(bank, day, 10_000) is True
    assert budgets.tenant_day_account(bank, day).limit_micros == 10_000 - 500


def test_it_refuses_a_run_away_from_home_on_a_copy_of_authority_older_than_the_reach(bank, asha, settings):
    import datetime as dt

    from regions.models import Heartbeat

    settings.REGION_NAME = "frankfurt"
    Heartbeat.objects.filter(region="mumbai").update(beat_at=timezone.now() - dt.timedelta(seconds=6))
    response = _start(asha)
    assert response.status_code == 503 and response.json()["error"]["code"] == "authority_stale"
    assert "more than the tenant's revocation reach of 5 s" in response.json()["error"]["message"]
    settings.REGION_NAME = "mumbai"  # at home the copy is the original
    assert _start(asha).status_code == 201
