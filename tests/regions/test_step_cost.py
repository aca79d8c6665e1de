"""What a step costs away from home against at home, in SQL statements (the Goal's "no round trip
between regions on the step path"): the same run, driven once with no regions and once in a region
that spends a slice, counting the statements each engine task sends to the local PostgreSQL."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from budgets import services as budgets
from regions.models import Heartbeat, TenantRegions
from runs.engine import advance
from runs.models import Run
from runs.services import start_run
from tests import factories

pytestmark = pytest.mark.django_db(transaction=True)


def _fewest(user, times: int = 3) -> list[int]:
    """Per task, the fewest statements over `times` runs: a cache refreshed now and then (a
    signing key, a permission checker) adds a statement to one run's task, not to the step."""
    runs = [_statements_per_task(user) for _ in range(times)]
    return [min(counts) for counts in zip(*runs)]


def _statements_per_task(user) -> list[int]:
    run, _ = start_run(user=user, agent="agent", input={})
    counts = []
    for _ in range(10):
        with CaptureQueriesContext(connection) as queries:
            advance(run.pk)
        counts.append(len(queries))
        if Run.objects.get(pk=run.pk).is_terminal:
            break
    assert Run.objects.get(pk=run.pk).status == "succeeded"
    return counts


def test_a_step_away_from_home_sends_the_same_statements_as_at_home(tenant, asha, builtins, settings):
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    factories.make_agent(
        tenant,
        tools=[echo],
        expected_cost_micros=10_000,
        turns=[{"tool_calls": [{"name": echo.name, "arguments": {"n": 1}}]}, {"text": "done"}],
    )
    _statements_per_task(asha)  # warm: the day opened, caches filled
    at_home = _fewest(asha)

    settings.REGION_NAME = "frankfurt"
    TenantRegions.objects.create(tenant=tenant, home="mumbai", allowed=["mumbai", "frankfurt"])
    Heartbeat.objects.create(region="mumbai", beat_at=timezone.now())
    day = budgets.local_day(tenant)
    # The region's day: the same accounts (opened at home above: here its limit stands for slices
    # granted), so the reservations take the same path.
    assert budgets.tenant_day_account(tenant, day).limit_micros == tenant.daily_budget_micros
    away = _fewest(asha)
    print(f"statements per engine task (model, tool, model): at home {at_home}, away {away}")
    # model call, tool call, model call: the same statements. The tool call's reach check (the
    # tenant's home and reach, the home's heartbeat) is read in the statement that locks the run.
    assert away == at_home
