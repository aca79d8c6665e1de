"""Declarative tenant configuration: `manage.py apply FILE.yaml` (see docs/configuration.md).

Entry points: apply_config, load_file, load_text, ConfigError. Three phases, so that nothing is half-applied and no transaction is open across a network call:

1. parse: shapes and types of the whole file, without the database; then the URLs of servers and
   endpoints against the tenant's egress hosts (egress.py), so discovery contacts no other host;
2. discover: list the tools of MCP and builtin servers, outside any transaction;
3. write: one transaction that creates or updates rows and checks every reference against the
   database as it now stands (agent specs go through agents.spec.validate_spec). Any error from
   any phase, or a dry run, rolls the whole transaction back.

Items with errors are left out of phase 3, which still runs so that errors that need the
database are reported in the same answer; references to items left out are not reported twice.

Reading the file (size, duplicate keys, aliases, text) is in loading.py; phase 1 is in schema.py
(field values through convert.py), phase 2 in discovery.py, phase 3 in
writing.py; report.py holds what apply_config returns or raises.
"""

from __future__ import annotations

from django.db import DataError, transaction

from configuration import datasets, policies, tenant_regions
from configuration.discovery import discover
from configuration.egress import check_egress
from configuration.loading import load_file, load_text
from configuration.report import ApplyReport, ConfigError
from configuration.schema import Problems, expand_env, parse
from configuration.writing import write
from tenants.models import Tenant

__all__ = ["ApplyReport", "ConfigError", "apply_config", "load_file", "load_text"]


# --- entry points --------------------------------------------------------------------------------


def apply_config(data: dict, *, dry_run: bool = False, source: str | None = None) -> ApplyReport:
    """Create or update one tenant from `data`, all or nothing; raise ConfigError with every error.

    `source`: the file `data` was read from (policies may name `.cedar` files beside it)."""
    problems = Problems()
    source = source or getattr(data, "source", None)
    data = expand_env(data, problems)
    if isinstance(data, dict) and "policies" in data:
        data = dict(data)
        spec = policies.read(data.pop("policies"), data.get("groups"), problems, source)
    else:
        spec = None
    cases = []
    if isinstance(data, dict) and "datasets" in data:
        data = dict(data)
        cases = datasets.read(data.pop("datasets"), problems)
    plan = parse(data, problems)
    check_egress(plan, problems)
    remote = discover(plan, problems)
    if plan.tenant is None:
        raise ConfigError(problems.in_file_order())
    try:
        with transaction.atomic():
            report = write(plan, remote, problems)
            tenant = Tenant.objects.filter(slug=plan.tenant.key).first()
            if tenant is not None and spec is not None and tenant_regions.away_here(tenant):
                problems.add("policies", tenant_regions.AT_HOME.format(home=tenant_regions.home_of(tenant)))
            elif tenant is not None:
                policies.apply(tenant, spec, problems, report)
                datasets.apply(tenant, cases, problems, report)
            if problems:
                raise ConfigError(problems.in_file_order())
            if dry_run:
                transaction.set_rollback(True)
    except DataError as exc:
        # Parsing bounds every value a column holds; this is the net under that, never a traceback.
        raise ConfigError(
            [*problems.in_file_order(), ("", f"the database refused a value: {exc}".strip())]
        ) from None
    report.dry_run = dry_run
    return report
