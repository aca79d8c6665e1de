"""`tenant.regions` in the configuration file (configuration/tenant_regions.py, docs/regions.md):
the tenant's home, where its runs may start, its revocation reach; every mistake a `path: message`
line and nothing applied."""

from __future__ import annotations

import datetime as dt

import pytest

from budgets.services import local_day
from configuration.apply import ConfigError, apply_config
from regions.models import RegionDay, TenantRegions
from tenants.models import Tenant
from tests.configuration.test_apply import SLUG, config

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _mumbai(settings):
    """This deployment is Mumbai, which knows Frankfurt."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.REGION_NAME = "mumbai"
    settings.REGION_PEERS = {"frankfurt": "http://frankfurt.invalid"}
    settings.REGION_KEYS = {"frankfurt": "k"}


def with_regions(**regions) -> dict:
    data = config()
    data["tenant"]["regions"] = regions
    return data


def errors(data: dict) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as refused:
        apply_config(data)
    return refused.value.errors


def test_it_stores_the_tenants_regions_and_reports_what_changed():
    report = apply_config(with_regions(home="mumbai", allowed=["mumbai", "frankfurt"], revocation_reach=2))
    stored = TenantRegions.objects.get(tenant__slug=SLUG)
    assert (stored.home, stored.allowed, stored.revocation_reach_seconds) == (
        "mumbai",
        ["mumbai", "frankfurt"],
        2.0,
    )
    assert (stored.slice_micros, stored.away_share_percent) == (0, 50)  # the defaults
    assert f"created tenant {SLUG}" in report.changes

    report = apply_config(with_regions(home="mumbai", allowed=["mumbai", "frankfurt"], revocation_reach=2))
    assert not [c for c in report.changes if "regions." in c]  # the same file again: unchanged

    report = apply_config(
        with_regions(home="mumbai", allowed=["mumbai", "frankfurt"], revocation_reach=0.5 + 4, slice=2.5)
    )
    stored.refresh_from_db()
    assert (stored.revocation_reach_seconds, stored.slice_micros) == (4.5, 2_500_000)
    assert [c for c in report.changes if "regions." in c] == [
        f"updated tenant {SLUG} (regions.revocation_reach, regions.slice)"
    ]


def test_the_allowed_regions_default_to_the_home_and_a_file_without_regions_keeps_them():
    apply_config(with_regions(home="mumbai"))
    assert TenantRegions.objects.get(tenant__slug=SLUG).allowed == ["mumbai"]
    apply_config(config())  # no regions section: as stored
    assert TenantRegions.objects.get(tenant__slug=SLUG).allowed == ["mumbai"]


@pytest.mark.parametrize(
    "regions, path, message",
    [
        ({"allowed": ["mumbai"]}, "tenant.regions.home", "required"),
        ({"home": "Mumbai!"}, "tenant.regions.home", "must be a region's name"),
        ({"home": "mumbai", "allowed": ["frankfurt"]}, "tenant.regions.allowed", "must include the home"),
        ({"home": "mumbai", "allowed": "mumbai"}, "tenant.regions.allowed", "must be a list"),
        ({"home": "mumbai", "allowed": ["mumbai", "mumbai"]}, "tenant.regions.allowed[1]", "listed twice"),
        ({"home": "mumbai", "allowed": ["mumbai", "paris"]}, "tenant.regions.allowed[1]", "unknown region 'paris'"),
        ({"home": "paris"}, "tenant.regions.home", "unknown region 'paris'"),
        ({"home": "frankfurt", "allowed": ["frankfurt"]}, "tenant.regions.home", "apply the file at the home"),
        ({"home": "mumbai", "revocation_reach": 0}, "tenant.regions.revocation_reach", "greater than 0"),
        ({"home": "mumbai", "revocation_reach": 0.2}, "tenant.regions.revocation_reach", "at least 1"),
        ({"home": "mumbai", "revocation_reach": "5s"}, "tenant.regions.revocation_reach", "must be a number"),
        ({"home": "mumbai", "revocation_reach": 7200}, "tenant.regions.revocation_reach", "at most 3600"),
        ({"home": "mumbai", "slice": 30}, "tenant.regions.slice", "at most the tenant's daily budget"),
        ({"home": "mumbai", "slice": -1}, "tenant.regions.slice", "must not be negative"),
        ({"home": "mumbai", "away_share_percent": 101}, "tenant.regions.away_share_percent", "at most 100"),
        ({"home": "mumbai", "where": "x"}, "tenant.regions.where", "unknown field"),
    ],
)  # fmt: skip
def test_a_bad_region_field_is_refused_at_its_path_and_nothing_is_applied(regions, path, message):
    found = errors(with_regions(**regions))
    assert [p for p, m in found if p == path and message in m], found
    assert not Tenant.objects.filter(slug=SLUG).exists()


def test_the_home_does_not_move_nor_a_region_go_while_it_holds_slices():
    apply_config(with_regions(home="mumbai", allowed=["mumbai", "frankfurt"]))
    tenant = Tenant.objects.get(slug=SLUG)
    RegionDay.objects.create(
        tenant=tenant,
        region="frankfurt",
        day=local_day(tenant),
        granted_micros=3_000_000,
        returned_micros=1_000_000,
    )
    found = errors(with_regions(home="mumbai", allowed=["mumbai"]))
    assert [m for p, m in found if p == "tenant.regions.allowed" and "'frankfurt' still holds slices" in m], (
        found
    )
    assert TenantRegions.objects.get(tenant=tenant).allowed == ["mumbai", "frankfurt"]
    # Given back: now it may go.
    RegionDay.objects.filter(tenant=tenant).update(returned_micros=3_000_000)
    apply_config(with_regions(home="mumbai", allowed=["mumbai"]))
    assert TenantRegions.objects.get(tenant=tenant).allowed == ["mumbai"]
    # A slice of a day long closed does not hold anything back.
    RegionDay.objects.create(
        tenant=tenant, region="frankfurt", day=local_day(tenant) - dt.timedelta(days=30), granted_micros=5
    )
    apply_config(with_regions(home="mumbai", allowed=["mumbai", "frankfurt"]))


def test_away_from_home_a_file_may_write_only_the_regions_own_rows(settings):
    apply_config(with_regions(home="mumbai", allowed=["mumbai", "frankfurt"]))
    settings.REGION_NAME = "frankfurt"  # the same database read as Frankfurt's replicated copy
    settings.REGION_PEERS = {"mumbai": "http://mumbai.invalid"}
    data = config()
    data["tenant"]["name"] = "Renamed in the wrong region"
    found = dict(errors(data))
    # The tenant's fields, its people and their grants are the home's: refused at their paths.
    for path in ("tenant.name", "tenant.quotas.max_active_runs", "users[0]", "groups[0]", "grants[0]"):
        assert "written at the tenant's home region 'mumbai' only" in found.get(path, ""), (path, found)
    assert Tenant.objects.get(slug=SLUG).name == "Acme Test"
    # The region's own rows (endpoints, servers, tools, agents) by a file holding only them.
    local = config()
    local["tenant"] = {"slug": SLUG}
    for section in ("users", "groups", "grants"):
        del local[section]
    local["agents"][0]["versions"].append(
        dict(local["agents"][0]["versions"][0], instructions="Frankfurt's.")
    )
    report = apply_config(local)
    assert any(change.startswith("created versions helper") for change in report.changes), report.changes


def test_without_regions_configured_here_any_well_formed_names_are_stored(settings):
    settings.REGION_NAME = ""
    settings.REGION_PEERS = {}
    apply_config(with_regions(home="mumbai", allowed=["mumbai", "frankfurt"]))
    assert TenantRegions.objects.get(tenant__slug=SLUG).home == "mumbai"
