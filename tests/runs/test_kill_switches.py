"""Kill switches driven in-process against real PostgreSQL (runs/controls/kill_switches.py): a killed agent
or tenant starts no run; a killed tool or endpoint is never called (its runs pause at the claim);
turning the switch off resumes what it paused, oldest first."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from budgets.models import Reservation
from runs.engine import advance, heartbeat
from runs.models import KillSwitchChange, Run, RunEvent, RunStatus, Step
from runs.services import start_run
from tests import factories
from tests.conftest import drive

pytestmark = pytest.mark.django_db(transaction=True)


def api(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


@pytest.fixture
def echo(tenant, asha, builtins):
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    factories.make_agent(
        tenant,
        tools=[echo],
        turns=[{"tool_calls": [{"name": echo.name, "arguments": {"say": "hi"}}]}, {"text": "all done"}],
    )
    return echo


def flip(user, **body):
    return api(user).post("/v1/kill-switches", body, format="json")


def test_a_killed_agent_starts_no_run_and_says_who_and_why(tenant, asha, ravi, echo):
    on = flip(ravi, scope="agent", target="agent", on=True, reason="refunds misbehave")
    assert on.status_code == 200, on.json()
    refused = api(asha).post("/v1/runs", {"agent": "agent", "input": {}}, format="json")
    assert refused.status_code == 423
    error = refused.json()["error"]
    assert error["code"] == "kill_switch_on"
    assert (
        "agent agent" in error["message"]
        and "ravi" in error["message"]
        and "refunds misbehave" in error["message"]
    )
    assert Run.objects.count() == 0
    assert flip(ravi, scope="agent", target="agent", on=False, reason="fixed").status_code == 200
    assert api(asha).post("/v1/runs", {"agent": "agent", "input": {}}, format="json").status_code == 201
    assert flip(asha, scope="agent", target="agent", on=True, reason="x").status_code == 403


def test_a_killed_tenant_starts_no_run(tenant, asha, ravi, echo):
    flip(ravi, scope="tenant", target="acme", on=True, reason="incident")
    assert api(asha).post("/v1/runs", {"agent": "agent", "input": {}}, format="json").status_code == 423


def test_a_killed_tool_is_never_called_and_turning_it_off_resumes_its_runs(tenant, asha, ravi, echo):
    runs = [start_run(user=asha, agent="agent", input={"n": i})[0] for i in range(3)]
    for run in runs:
        advance(run.pk)  # each is about to call echo
    assert flip(ravi, scope="tool", target=echo.name, on=True, reason="echo leaks").status_code == 200
    for run in runs:
        advance(run.pk)
    assert Run.objects.filter(pk__in=[r.pk for r in runs], status="paused").count() == 3
    assert not Step.objects.filter(run__in=runs, seq=2).exclude(status="proposed").exists()  # 0 calls
    assert Step.objects.filter(run__in=runs, seq=2, attempts__gt=0).count() == 0
    paused = RunEvent.objects.filter(run__in=runs, kind="paused")
    assert paused.count() == 3 and all("echo leaks" in e.message for e in paused)
    # A person resuming one while the switch is on: paused again at the claim, still not called.
    from runs.controls import pausing

    pausing.resume_run(run_id=runs[0].pk, actor=ravi, reason="try")
    advance(runs[0].pk)
    assert Run.objects.get(pk=runs[0].pk).status == "paused"

    off = flip(ravi, scope="tool", target=echo.name, on=False, reason="patched")
    assert off.json()["runs_resumed"] == 3
    assert KillSwitchChange.objects.count() == 2
    for run in runs:
        assert drive(run.pk).status == RunStatus.SUCCEEDED
    assert [s.attempts for s in Step.objects.filter(run__in=runs, seq=2)] == [1, 1, 1]


def test_a_killed_endpoint_is_never_called(tenant, asha, ravi, echo):
    run, _ = start_run(user=asha, agent="agent", input={})
    flip(ravi, scope="endpoint", target="scripted", on=True, reason="provider incident")
    advance(run.pk)
    run.refresh_from_db()
    assert run.status == "paused" and Step.objects.filter(run=run).count() == 0
    flip(ravi, scope="endpoint", target="scripted", on=False, reason="back")
    assert drive(run.pk).status == RunStatus.SUCCEEDED


def test_an_unknown_target_is_a_field_error(tenant, ravi, echo):
    answer = flip(ravi, scope="tool", target="nope", on=True, reason="x")
    assert answer.status_code == 400 and "target" in answer.json()["error"]["fields"]


def test_a_tenant_that_chose_unavailable_has_the_model_told_and_the_run_goes_on(tenant, asha, ravi, echo):
    tenant.on_killed_tool = tenant.OnKilledTool.UNAVAILABLE
    tenant.save()
    run, _ = start_run(user=asha, agent="agent", input={})
    advance(run.pk)  # the model proposes the call to echo
    flip(ravi, scope="tool", target=echo.name, on=True, reason="echo leaks")
    run = drive(run.pk)
    assert run.status == RunStatus.SUCCEEDED and run.final_output == "all done"
    call = Step.objects.get(run=run, seq=2)
    assert (call.status, call.attempts) == ("denied", 0)  # nothing sent
    assert "unavailable" in call.observation and "echo leaks" not in call.observation  # for the model
    assert "echo leaks" in call.error and "ravi" in call.error  # for the supervisor
    assert not RunEvent.objects.filter(run=run, kind="paused").exists()
    # The model's next turn saw the answer: its request carried the unavailable observation.
    assert Step.objects.filter(run=run, kind="model").count() == 2


def test_an_approved_call_of_a_killed_tool_is_not_consumed(tenant, asha, ravi, echo):
    from approvals.models import Approval
    from runs.approval_effects import decide_approval

    factories.grant(echo, approve=[ravi])
    echo.approval_policy = "always"
    echo.save()
    run, _ = start_run(user=asha, agent="agent", input={})
    assert drive(run.pk).status == "waiting_approval"
    approval = Approval.objects.get(step__run=run)
    flip(ravi, scope="tool", target=echo.name, on=True, reason="echo leaks")
    decide_approval(approval_id=approval.pk, user=ravi, approve=True, reason="fine")
    advance(run.pk)
    run.refresh_from_db()
    approval.refresh_from_db()
    assert (run.status, approval.status, approval.consumed_at) == ("paused", "approved", None)
    assert Step.objects.get(run=run, seq=2).attempts == 0
    flip(ravi, scope="tool", target=echo.name, on=False, reason="patched")
    assert drive(run.pk).status == RunStatus.SUCCEEDED
    assert Approval.objects.get(pk=approval.pk).status == "consumed"


def test_a_retry_of_a_call_lost_with_its_worker_is_not_sent_to_a_killed_tool(tenant, asha, ravi, echo):
    from datetime import timedelta

    from django.utils import timezone

    from runs.engine.claim import claim

    run, _ = start_run(user=asha, agent="agent", input={})
    advance(run.pk)
    plan = claim(run.pk)  # committed as dispatching; then the worker dies before sending
    assert plan is not None and plan.kind == "tool"
    heartbeat.untrack(run.pk)  # and with it the renewal of its lease
    Run.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    flip(ravi, scope="tool", target=echo.name, on=True, reason="echo leaks")
    for _ in range(2):  # the sweeper's re-send, and a duplicate
        advance(run.pk)
    run.refresh_from_db()
    call = Step.objects.get(run=run, seq=2)
    assert run.status == "paused" and run.paused_by_switch is not None and run.lease_token is None
    assert (call.status, call.attempts, call.crashes) == ("dispatching", 1, 1)
    assert call.next_attempt_at is not None  # kept as a retry due at the resume

    flip(ravi, scope="tool", target=echo.name, on=False, reason="patched")
    run = drive(run.pk)
    assert run.status == RunStatus.SUCCEEDED
    call.refresh_from_db()
    assert (call.status, call.attempts, call.crashes) == ("succeeded", 2, 1)  # the lost attempt counted once


def test_a_resend_after_a_status_lookup_is_not_sent_once_the_switch_is_on(tenant, asha, ravi, bank):
    from datetime import timedelta

    from django.utils import timezone

    from runs.engine.claim import claim
    from runs.engine.tool_step import do_tool
    from tests.recovery.conftest import REFUND, http_bank_tool, single_call_agent

    refund = http_bank_tool(tenant, bank, "issue_refund", effect_class="reconcilable", status=True)
    single_call_agent(tenant, asha, refund, REFUND, final="refunded")
    run, _ = start_run(user=asha, agent="agent", input={})
    advance(run.pk)
    claim(run.pk)  # committed as dispatching; the worker dies before sending
    ago = timezone.now() - timedelta(seconds=refund.timeout_seconds + 1)  # its settle window passed
    Step.objects.filter(run=run, seq=2).update(dispatched_at=ago)
    Run.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    plan = claim(run.pk)  # the recovery: ask the bank first
    assert plan is not None and plan.reconcile_first
    flip(ravi, scope="tool", target=refund.name, on=True, reason="ledger down")  # during the lookup
    do_tool(plan)  # the lookup finds nothing; the resend is not sent
    run.refresh_from_db()
    assert run.status == "paused" and run.paused_by_switch is not None and run.lease_token is None
    assert bank.effects("issue_refund") == []
    assert Step.objects.get(run=run, seq=2).attempts == 1
    assert not Reservation.objects.filter(run=run, status="open").exists()

    flip(ravi, scope="tool", target=refund.name, on=False, reason="ledger back")
    assert drive(run.pk).status == RunStatus.SUCCEEDED
    assert len(bank.effects("issue_refund")) == 1
