"""Fifty runs started at once against a tenant day with room for about ten model calls.

Each run is admitted through the API and then driven by its own thread calling
runs.engine.advance (what a worker does), all at the same time on real PostgreSQL.
"""

from __future__ import annotations

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from budgets import services as budgets
from budgets.models import Reservation
from llm import gateway
from runs.engine import advance
from runs.models import WAITING, Run, Step
from runs.recovery import sweeper
from tests import factories
from tests.budgets.conftest import assert_books_balance, in_threads
from tools import offer

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(600)]

RUNS = 50


def _model_call_estimate(run) -> int:
    request = gateway.build_request(run, [], offer.offered_tools(run))
    return gateway.estimate_cost_micros(run.version.model_endpoint, request)


def _drive(run_id) -> Run:
    for _ in range(30):
        advance(run_id)
        run = Run.objects.get(pk=run_id)
        if run.is_terminal or run.status in WAITING:
            return run
    return run


def test_fifty_runs_at_once_finish_what_starts_and_never_spend_more_than_the_tenant_day(
    tenant, asha, builtins
):
    """Admission (runs/admission.py): with a day worth about ten model calls and runs of three,
    the runs let start all finish, the others wait in arrival order or are refused with 429 (the
    odd ones asked not to wait), and the settled total stays under the limit. Before admission,
    all fifty started, shared the day and stopped part-way."""
    echo = builtins["echo"]
    echo.price_micros = 700
    echo.save()
    factories.grant(echo, use=[asha])
    probe = factories.make_agent(tenant, name="probe", tools=[echo], limits={"max_output_tokens": 200})
    per_call = _model_call_estimate(
        Run(tenant=tenant, created_by=asha, version=probe, input={"i": 0}, limits={"max_output_tokens": 200})
    )
    # A run: three model calls (the later ones carry more history) and two tool calls.
    expected = 4 * per_call + 2 * 700
    factories.make_agent(
        tenant,
        tools=[echo],
        limits={"max_output_tokens": 200},
        expected_cost_micros=expected,
        turns=[
            {"tool_calls": [{"name": echo.name, "arguments": {"n": 1}}]},
            {"tool_calls": [{"name": echo.name, "arguments": {"n": 2}}]},
            {"text": "done"},
        ],
    )
    tenant.daily_budget_micros = 10 * per_call + per_call // 2  # room for about ten model calls
    tenant.max_active_runs = 100
    tenant.max_starts_per_minute = 100
    tenant.save()

    def start_and_drive(i: int):
        client = APIClient()
        client.force_authenticate(asha)
        response = client.post(
            "/v1/runs", {"agent": "agent", "input": {"i": i}, "wait": i % 2 == 0}, format="json"
        )
        if response.status_code != 201:
            return (
                "refused",
                response.status_code,
                response.json()["error"]["code"],
                response.get("Retry-After"),
            )
        body = response.json()
        if body["status"] == "waiting_budget":
            return "waiting", body["status"], "", body["id"]
        run = _drive(body["id"])
        return "ran", run.status, run.stop_reason, body["id"]

    outcomes = in_threads(RUNS, start_and_drive)

    ran = [o for o in outcomes if o[0] == "ran"]
    waiting = [o for o in outcomes if o[0] == "waiting"]
    refused = [o for o in outcomes if o[0] == "refused"]
    assert len(ran) + len(waiting) + len(refused) == RUNS, outcomes
    assert ran and waiting and refused, outcomes
    assert {o[1:3] for o in ran} == {("succeeded", "")}, outcomes
    assert {o[1:3] for o in refused} == {(429, "tenant_budget_exhausted")}, outcomes
    assert all(int(o[3]) > 0 for o in refused)
    assert all(Run.objects.get(pk=o[3]).input["i"] % 2 == 0 for o in waiting)  # only those who would wait

    # The sweeper admits waiting runs, oldest first, as finished runs leave room they did not use;
    # when nothing runs and budget remains, the head alone (the progress rule): that one run may
    # stop part-way on the day's budget, and then the day is done.
    while True:
        admitted = sweeper._admit_waiting_runs(timezone.now())
        if not admitted:
            break
        for run in Run.objects.filter(tenant=tenant, status="queued"):
            alone = run.events.filter(kind="status", skeleton__alone=True).exists()
            assert _drive(run.pk).status in (("succeeded", "stopped") if alone else ("succeeded",))

    runs = Run.objects.filter(tenant=tenant)
    started = runs.filter(admitted_at__isnull=False)
    stopped = list(runs.filter(status="stopped"))
    assert len(stopped) <= 1 and all(r.stop_reason == "tenant_budget_exhausted" for r in stopped)
    assert set(started.exclude(status="stopped").values_list("status", flat=True)) == {"succeeded"}
    still_waiting = runs.filter(status="waiting_budget")
    assert set(still_waiting.values_list("admitted_at", "started_at")) <= {(None, None)}
    assert not Step.objects.filter(run__in=still_waiting).exists()
    if still_waiting.exists():  # in order of arrival: nobody admitted later than a run still waiting
        assert max(started.values_list("created_at", flat=True)) < min(
            still_waiting.values_list("created_at", flat=True)
        )

    day = budgets.tenant_day_account(tenant, budgets.local_day(tenant))
    assert day.spent_micros <= day.limit_micros
    assert (day.reserved_micros, day.held_micros, day.overage_micros) == (0, 0, 0)
    granted = Reservation.objects.filter(tenant=tenant, purpose="model")
    assert granted.count() >= 6
    assert sum(r.actual_micros for r in granted) == sum(
        Step.objects.filter(run__tenant=tenant, kind="model").values_list("cost_micros", flat=True)
    )
    assert_books_balance(tenant)
