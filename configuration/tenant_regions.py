"""`tenant.regions`: where a tenant's runs may execute, its home, and its revocation reach
(regions.TenantRegions; DESIGN.md section 9, docs/regions.md).

    tenant:
      regions:
        home: mumbai                      # required: the region whose ledger is authoritative
        allowed: [mumbai, frankfurt]      # where runs may start; the home among them (default: the home)
        revocation_reach: 5               # seconds (default 5)
        slice: 10.00                      # what a region asks for at once (default: a tenth of the day)
        away_share_percent: 50            # the most of the day one other region holds at once

Left out of the file: the stored regions stay as they are (the file cannot remove them: a region
holding slices must give them back first; the admin removes the row). The checks here need the
database or this deployment's settings, so they run in the write phase:

| check                                                        | refused at                 |
|--------------------------------------------------------------|----------------------------|
| the home among the allowed regions                           | tenant.regions.allowed     |
| a region this deployment knows (REGION, REGION_PEERS)        | tenant.regions.home/allowed[i] |
| away from home: no tenant field, user, group, grant or policy (replicated from the home) | their own paths |
| the home given here is this deployment (apply at the home)  | tenant.regions.home        |
| the home moved, or a region dropped, while a region holds slices | tenant.regions.home/allowed |
| the reach at least MIN_REACH_SECONDS                         | tenant.regions.revocation_reach |
| a slice no larger than the daily budget                      | tenant.regions.slice       |
"""

from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.db.models import F

from budgets.services import local_day
from configuration.report import ApplyReport
from configuration.rows import assign
from configuration.schema import TENANT, Field, Plan, Problems
from core.money import money
from regions.models import RegionDay, TenantRegions, here
from regions.services import CLOSING_DAYS
from tenants.models import Tenant

PATH = "tenant.regions"
# Twice the home's default heartbeat (REGION_HEARTBEAT_SECONDS, 0.5 s): a shorter reach would find
# every copy stale between two beats, and every tool call away from home would wait.
MIN_REACH_SECONDS = 1.0
FIELDS = {
    "region_home": ("home", "home"),
    "region_allowed": ("allowed", "allowed"),
    "revocation_reach_seconds": ("revocation_reach", "revocation_reach_seconds"),
    "slice_micros": ("slice", "slice_micros"),
    "away_share_percent": ("away_share_percent", "away_share_percent"),
}


AT_HOME = (
    "written at the tenant's home region {home!r} only (people, groups, grants, policies, the "
    "tenant and its regions are replicated from there); a file applied here may hold the "
    "tenant's slug and this region's own rows: secrets, model endpoints, tool servers, tools, "
    "agents, webhooks"
)
# What a region other than the home replicates from it: a file applied there may not write them.
AUTHORITY_SECTIONS = ("groups", "users", "grants")


def home_of(tenant: Tenant) -> str | None:
    stored = TenantRegions.of(tenant)
    return stored.home if stored is not None else None


def away_here(tenant: Tenant) -> bool:
    """Whether this deployment is a region other than the tenant's home (its authority is a copy)."""
    home = home_of(tenant)
    return bool(here()) and home is not None and home != here()


def apply(tenant: Tenant, plan: Plan, problems: Problems, report: ApplyReport) -> None:
    assert plan.tenant is not None
    item = plan.tenant
    stored = TenantRegions.of(tenant)
    if stored is not None and here() and stored.home != here():
        # Away from home only the region's own rows: the rest would diverge from the home's
        # copy (and collide with the rows replication brings).
        message = AT_HOME.format(home=stored.home)
        for key in sorted(set(item.values) - {"slug"}):
            problems.add(f"tenant.{_file_key(key)}", message)
        for section in AUTHORITY_SECTIONS:
            for entry in plan.sections.get(section, []):
                problems.add(entry.path, message)
        return
    given = {key: value for key, value in item.values.items() if key in FIELDS}
    if not given:
        return
    values = {FIELDS[key][1]: value for key, value in given.items()}
    if "home" not in values:  # reported at parse (required, or not a region's name)
        return
    home = values["home"]
    values.setdefault("allowed", [home])
    before = len(problems)
    _check(tenant, stored, values, problems)
    if len(problems) > before:
        return
    if stored is None:
        TenantRegions.objects.create(tenant=tenant, **values)
        report.record("tenant", tenant.slug, "updated", [f"regions.{FIELDS[k][0]}" for k in given])
        return
    changed = assign(stored, values)
    if changed:
        names = {target: name for name, target in FIELDS.values()}
        report.record("tenant", tenant.slug, "updated", [f"regions.{names[c]}" for c in changed])


def _check(tenant: Tenant, stored: TenantRegions | None, values: dict, problems: Problems) -> None:
    home, allowed = values["home"], values["allowed"]
    if home not in allowed:
        problems.add(f"{PATH}.allowed", f"must include the home region {home!r}")
    if here():
        known = {here(), *settings.REGION_PEERS}
        if home not in known:
            problems.add(f"{PATH}.home", f"unknown region {home!r}; {_known(known)}")
        for i, name in enumerate(allowed):
            if name not in known:
                problems.add(f"{PATH}.allowed[{i}]", f"unknown region {name!r}; {_known(known)}")
        if home != here() and home in known:
            problems.add(
                f"{PATH}.home",
                f"this deployment is {here()!r}: apply the file at the home region {home!r} "
                "(people, grants and policies are written at the home and replicated)",
            )
    reach = values.get("revocation_reach_seconds")
    if reach is not None and reach < MIN_REACH_SECONDS:
        problems.add(
            f"{PATH}.revocation_reach",
            f"must be at least {MIN_REACH_SECONDS:g} seconds (twice the home's heartbeat interval)",
        )
    size = values.get("slice_micros")
    if size is not None and size > tenant.daily_budget_micros:
        problems.add(f"{PATH}.slice", "must be at most the tenant's daily budget")
    if stored is None:
        return
    # Slices outstanding: lent at home and not given back, on a day a region may still hold.
    lent = _outstanding(tenant)
    if home != stored.home and lent:
        problems.add(
            f"{PATH}.home",
            f"the home cannot move while regions hold slices ({_slices(tenant, lent)}); "
            "move it once they have been given back",
        )
    for name in set(stored.allowed) - set(allowed):
        if name in lent:
            problems.add(
                f"{PATH}.allowed",
                f"{name!r} still holds slices ({_slices(tenant, {name: lent[name]})}); "
                "remove it once they have been given back",
            )


def _outstanding(tenant: Tenant) -> dict[str, int]:
    since = local_day(tenant) - dt.timedelta(days=CLOSING_DAYS)
    lent: dict[str, int] = {}
    for region, micros in (
        RegionDay.objects.filter(tenant=tenant, day__gte=since, granted_micros__gt=F("returned_micros"))
        .annotate(outstanding=F("granted_micros") - F("returned_micros"))
        .values_list("region", "outstanding")
    ):
        lent[region] = lent.get(region, 0) + micros
    return lent


def _slices(tenant: Tenant, lent: dict[str, int]) -> str:
    return ", ".join(f"{region} {money(micros, tenant)}" for region, micros in sorted(lent.items()))


def _known(known: set[str]) -> str:
    return f"this deployment knows {', '.join(sorted(known))} (REGION, REGION_PEERS)"


def _file_key(target: str) -> str:
    """The file's path of a tenant field (`quotas.max_active_runs` for max_active_runs)."""

    def find(spec, prefix: str) -> str | None:
        for key, rule in spec.items():
            if isinstance(rule, Field) and rule.target == target:
                return prefix + key
            if isinstance(rule, dict):
                found = find(rule, f"{prefix}{key}.")
                if found:
                    return found
        return None

    return find(TENANT, "") or target
