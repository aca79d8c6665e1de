"""Fifty runs started at once against a tenant day with room for about ten model calls.

Each run is admitted through the API and then driven by its own thread calling
runs.engine.advance (what a worker does), all at the same time on real PostgreSQL.
"""
from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from budgets import services as budgets
from budgets.models import Reservation
from llm import gateway
from runs.engine import advance
from runs.models import WAITING, Run, Step
from tests import factories
from tests.budgets.conftest import assert_books_balance, in_threads

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(600)]

RUNS = 50


def _model_call_estimate(run) -> int:
    from tools import gateway as tool_gateway

    request = gateway.build_request(run, [], tool_gateway.offered_tools(run))
    return gateway.estimate_cost_micros(run.version.model_endpoint, request)


def test_fifty_runs_at_once_never_spend_more_than_the_tenant_day(tenant, asha, builtins):
    echo = builtins["echo"]
    echo.price_micros = 700
    echo.save()
    factories.grant(echo, use=[asha])
    version = factories.make_agent(tenant, tools=[echo], limits={"max_output_tokens": 200}, turns=[
        {"tool_calls": [{"name": echo.name, "arguments": {"n": 1}}]},
        {"tool_calls": [{"name": echo.name, "arguments": {"n": 2}}]},
        {"text": "done"}])
    per_call = _model_call_estimate(Run(tenant=tenant, created_by=asha, version=version, input={"i": 0},
                                        limits={"max_output_tokens": 200}))
    tenant.daily_budget_micros = 10 * per_call + per_call // 2      # room for about ten model calls
    tenant.save()

    def start_and_drive(i: int):
        client = APIClient()
        client.force_authenticate(asha)
        response = client.post("/v1/runs", {"agent": "agent", "input": {"i": i}}, format="json")
        if response.status_code != 201:
            return "refused", response.status_code, response.json()["error"]["code"], response.get("Retry-After")
        run_id = response.json()["id"]
        for _ in range(30):
            advance(run_id)
            run = Run.objects.get(pk=run_id)
            if run.is_terminal or run.status in WAITING:
                return "ran", run.status, run.stop_reason, run_id
        return "stuck", run.status, "", run_id

    outcomes = in_threads(RUNS, start_and_drive)

    ran = [o for o in outcomes if o[0] == "ran"]
    refused = [o for o in outcomes if o[0] == "refused"]
    assert len(ran) + len(refused) == RUNS, outcomes
    assert {o[1:3] for o in ran} <= {("succeeded", ""), ("stopped", "tenant_budget_exhausted")}, outcomes
    assert {o[1:3] for o in refused} <= {(429, "tenant_budget_exhausted")}, outcomes
    assert all(int(o[3]) > 0 for o in refused)
    succeeded = [o for o in ran if o[1] == "succeeded"]
    stopped = [o for o in ran if o[1] == "stopped"]
    assert succeeded and (stopped or refused), "the day's budget must have been binding"

    day = budgets.tenant_day_account(tenant, budgets.local_day(tenant))
    assert day.spent_micros <= day.limit_micros
    assert (day.reserved_micros, day.held_micros, day.overage_micros) == (0, 0, 0)
    granted = Reservation.objects.filter(tenant=tenant, purpose="model")
    assert granted.count() >= 10
    assert sum(r.actual_micros for r in granted) == sum(
        Step.objects.filter(run__tenant=tenant, kind="model").values_list("cost_micros", flat=True))
    # A stopped run made no call it could not pay for, and left nothing reserved or pending.
    for _, _, _, run_id in stopped:
        assert not Step.objects.filter(run_id=run_id, status__in=["proposed", "dispatching"]).exists()
    assert_books_balance(tenant)
