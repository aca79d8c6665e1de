"""Pause and resume driven in-process against real PostgreSQL (runs/controls/pausing.py): at a step boundary,
losing nothing; refused transitions answer 409; who may; in bulk with one audit record."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core.management import call_command
from django.utils import timezone
from rest_framework.test import APIClient

from approvals.models import Approval
from budgets.models import Reservation
from runs.approval_effects import decide_approval
from runs.controls import pausing
from runs.engine import advance
from runs.engine.claim import claim
from runs.engine.model_step import do_model
from runs.engine.tool_step import do_tool
from runs.models import BulkAction, Run, RunEvent, RunStatus, Step
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
        turns=[
            {"tool_calls": [{"name": echo.name, "arguments": {"say": "$input.word"}}]},
            {"text": "all done"},
        ],
    )
    return echo


def kinds(run_id) -> list[str]:
    return list(RunEvent.objects.filter(run_id=run_id).order_by("seq").values_list("kind", flat=True))


def no_open_reservations(run_id) -> bool:
    return not Reservation.objects.filter(run_id=run_id, status=Reservation.Status.OPEN).exists()


def test_a_queued_run_pauses_at_once_stays_paused_and_resumes_where_it_stopped(tenant, asha, ravi, echo):
    run, _ = start_run(user=asha, agent="agent", input={"word": "hi"})
    deadline = run.deadline_at
    until = timezone.now() + dt.timedelta(hours=1)
    pausing.pause_run(run_id=run.pk, actor=ravi, reason="core banking degraded", until=until)
    run.refresh_from_db()
    assert (run.status, run.pause_reason, run.paused_by_id, run.paused_until) == (
        "paused",
        "core banking degraded",
        ravi.pk,
        until,
    )
    assert run.lease_token is None and no_open_reservations(run.pk)
    for _ in range(3):  # its queued message, delivered (and redelivered): dropped
        advance(run.pk)
    assert Step.objects.filter(run=run).count() == 0
    assert Run.objects.get(pk=run.pk).status == "paused"

    pausing.resume_run(run_id=run.pk, actor=ravi, reason="core banking is back")
    run.refresh_from_db()
    assert run.status == "queued" and run.deadline_at > deadline  # the pause does not count
    assert (run.pause_reason, run.paused_by_id, run.paused_at) == ("", None, None)
    run = drive(run.pk)
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert [s.attempts for s in Step.objects.filter(run=run)] == [1, 1, 1]
    assert {"paused", "resumed"} <= set(kinds(run.pk))
    paused = RunEvent.objects.get(run=run, kind="paused")
    assert paused.actor_id == ravi.pk and paused.data["reason"] == "core banking degraded"


def test_a_pause_during_a_tool_call_records_its_outcome_then_pauses(tenant, asha, ravi, echo):
    run, _ = start_run(user=asha, agent="agent", input={"word": "hi"})
    advance(run.pk)  # the model proposes the call
    plan = claim(run.pk)  # the call is committed as dispatching, the lease taken
    assert plan is not None and plan.kind == "tool"
    pausing.pause_run(run_id=run.pk, actor=ravi, reason="hold")
    run.refresh_from_db()
    assert run.status == "running" and run.pause_requested  # not yet: a call is in flight
    do_tool(plan)  # the call ends and is recorded
    run.refresh_from_db()
    tool_step = Step.objects.get(run=run, seq=2)
    assert tool_step.status == "succeeded" and tool_step.result["structured"] == {"say": "hi"}
    assert (run.status, run.pause_requested, run.lease_token) == ("paused", False, None)
    assert no_open_reservations(run.pk)
    advance(run.pk)  # a stray message changes nothing
    assert Step.objects.filter(run=run).count() == 2

    pausing.resume_run(run_id=run.pk, actor=ravi, reason="go")
    run = drive(run.pk)
    assert run.status == RunStatus.SUCCEEDED and run.final_output == "all done"
    assert Step.objects.get(run=run, seq=2).attempts == 1  # the call was never made again
    assert kinds(run.pk).count("paused") == 1


def test_a_pause_during_a_model_call_keeps_its_proposed_call_for_the_resume(tenant, asha, ravi, echo):
    run, _ = start_run(user=asha, agent="agent", input={"word": "hi"})
    plan = claim(run.pk)
    assert plan is not None and plan.kind == "model"
    pausing.pause_run(run_id=run.pk, actor=ravi, reason="hold")
    do_model(plan)
    run.refresh_from_db()
    assert run.status == "paused"
    assert list(Step.objects.filter(run=run).values_list("status", flat=True)) == ["succeeded", "proposed"]
    pausing.resume_run(run_id=run.pk, actor=ravi)
    assert drive(run.pk).status == RunStatus.SUCCEEDED


def test_the_claim_takes_a_requested_pause_before_dispatching_anything(tenant, asha, ravi, echo):
    run, _ = start_run(user=asha, agent="agent", input={"word": "hi"})
    advance(run.pk)
    Run.objects.filter(pk=run.pk).update(pause_requested=True, pause_reason="switch")  # as the record left it
    advance(run.pk)
    run.refresh_from_db()
    assert run.status == "paused" and Step.objects.get(run=run, seq=2).status == "proposed"


def test_an_approval_decided_while_paused_is_dispatched_after_the_resume(tenant, asha, ravi, echo):
    factories.grant(echo, approve=[ravi])
    echo.approval_policy = "always"
    echo.save()
    run, _ = start_run(user=asha, agent="agent", input={"word": "hi"})
    run = drive(run.pk)
    assert run.status == "waiting_approval"
    pausing.pause_run(run_id=run.pk, actor=ravi, reason="hold")
    approval = Approval.objects.get(step__run=run)
    decide_approval(approval_id=approval.pk, user=ravi, approve=True)
    run.refresh_from_db()
    assert run.status == "paused" and Step.objects.get(run=run, seq=2).status == "approved"
    advance(run.pk)
    assert Step.objects.get(run=run, seq=2).status == "approved"  # nothing dispatched while paused
    pausing.resume_run(run_id=run.pk, actor=ravi)
    run = drive(run.pk)
    assert run.status == RunStatus.SUCCEEDED
    assert Step.objects.get(run=run, seq=2).attempts == 1


def test_refused_transitions_answer_409_and_only_supervisors_may(tenant, asha, ravi, echo):
    run, _ = start_run(user=asha, agent="agent", input={"word": "hi"})
    resume = api(ravi).post(f"/v1/runs/{run.pk}/resume", {"reason": "x"}, format="json")
    assert resume.status_code == 409 and resume.json()["error"]["code"] == "run_not_paused"
    assert "not paused" in resume.json()["error"]["message"]
    mine = api(asha).post(f"/v1/runs/{run.pk}/pause", {"reason": "x"}, format="json")
    assert mine.status_code == 403  # the run's creator is no supervisor
    missing = api(ravi).post(f"/v1/runs/{run.pk}/pause", {}, format="json")
    assert missing.status_code == 400 and "reason" in missing.json()["error"]["fields"]
    ok = api(ravi).post(f"/v1/runs/{run.pk}/pause", {"reason": "hold"}, format="json")
    assert ok.status_code == 200 and ok.json()["status"] == "paused" and ok.json()["pause_reason"] == "hold"
    again = api(ravi).post(f"/v1/runs/{run.pk}/pause", {"reason": "hold"}, format="json")
    assert again.status_code == 200  # already paused: answered as it is
    assert api(ravi).post(f"/v1/runs/{run.pk}/resume", {}, format="json").json()["status"] == "queued"
    drive(run.pk)
    ended = api(ravi).post(f"/v1/runs/{run.pk}/pause", {"reason": "late"}, format="json")
    assert ended.status_code == 409 and ended.json()["error"]["code"] == "run_finished"

    other = factories.make_tenant("other")
    outsider = factories.make_user(other, "olga", staff=True)
    assert api(outsider).post(f"/v1/runs/{run.pk}/pause", {"reason": "x"}, format="json").status_code == 404
    op = factories.make_user(other, "root")
    op.is_superuser = True
    op.save()
    second, _ = start_run(user=asha, agent="agent", input={"word": "hi"})
    assert api(op).post(f"/v1/runs/{second.pk}/pause", {"reason": "x"}, format="json").status_code == 200


def test_a_paused_run_can_still_be_cancelled(tenant, asha, ravi, echo):
    run, _ = start_run(user=asha, agent="agent", input={"word": "hi"})
    pausing.pause_run(run_id=run.pk, actor=ravi, reason="hold")
    assert api(ravi).post(f"/v1/runs/{run.pk}/cancel", {}, format="json").json()["status"] == "cancelled"


def test_a_paused_run_is_not_stopped_for_its_deadline(tenant, asha, ravi, echo):
    from runs.recovery.sweeper import sweep

    run, _ = start_run(user=asha, agent="agent", input={"word": "hi"})
    pausing.pause_run(run_id=run.pk, actor=ravi, reason="hold")
    Run.objects.filter(pk=run.pk).update(deadline_at=timezone.now() - dt.timedelta(seconds=1))
    sweep()
    assert Run.objects.get(pk=run.pk).status == "paused"


def test_bulk_pause_by_tool_and_resume_in_order_with_one_audit_record(tenant, asha, ravi, echo):
    runs = [start_run(user=asha, agent="agent", input={"word": str(i)})[0] for i in range(4)]
    for run in runs[:3]:
        advance(run.pk)  # the model proposed the echo call: it is each run's next call
    answer = api(ravi).post(
        "/v1/runs/pause", {"reason": "echo is degraded", "tool": echo.name}, format="json"
    )
    assert answer.status_code == 200, answer.json()
    assert answer.json()["count"] == 3 and answer.json()["kind"] == "pause"
    assert sorted(Run.objects.filter(status="paused").values_list("pk", flat=True)) == sorted(
        r.pk for r in runs[:3]
    )
    action = BulkAction.objects.get()
    assert (action.actor_id, action.reason, action.filters, action.count) == (
        ravi.pk,
        "echo is degraded",
        {"tool": echo.name, "tenant": "acme"},
        3,
    )
    assert RunEvent.objects.filter(kind="paused", skeleton__bulk_action=action.pk).count() == 3
    for run in runs[:3]:
        advance(run.pk)
    assert Step.objects.filter(run__in=runs[:3], seq=2, status="proposed").count() == 3  # nothing sent

    resumed = api(ravi).post("/v1/runs/resume", {"reason": "echo is back"}, format="json")
    assert resumed.json()["count"] == 3
    assert not Run.objects.filter(status="paused").exists()
    for run in runs:
        assert drive(run.pk).status == RunStatus.SUCCEEDED
    assert all(s.attempts == 1 for s in Step.objects.filter(run__in=runs))
    assert api(asha).post("/v1/runs/pause", {"reason": "x"}, format="json").status_code == 403


def test_manage_py_pauses_and_resumes(tenant, asha, ravi, echo, capsys):
    run, _ = start_run(user=asha, agent="agent", input={"word": "hi"})
    call_command("pause_runs", "--reason", "maintenance", "--as", "ravi", "--agent", "agent")
    assert "pause: 1 runs" in capsys.readouterr().out
    assert Run.objects.get(pk=run.pk).status == "paused"
    call_command("resume_runs", "--reason", "done", "--as", "ravi")
    assert "resume: 1 runs" in capsys.readouterr().out
    assert drive(run.pk).status == RunStatus.SUCCEEDED


def test_a_pause_with_an_end_is_resumed_by_the_sweeper_once_it_has_passed(tenant, asha, ravi, echo):
    from runs.recovery.sweeper import sweep

    run, _ = start_run(user=asha, agent="agent", input={"word": "hi"})
    until = timezone.now() + dt.timedelta(minutes=10)
    answer = api(ravi).post(
        f"/v1/runs/{run.pk}/pause",
        {"reason": "maintenance window", "until": until.isoformat()},
        format="json",
    )
    assert answer.status_code == 200, answer.json()
    assert (answer.json()["paused_by"], answer.json()["paused_by_switch"]) == ("ravi", None)
    assert sweep()["pauses_ended"] == 0  # before its end: nothing wakes it
    assert Run.objects.get(pk=run.pk).status == "paused"

    assert sweep(now=until + dt.timedelta(seconds=1))["pauses_ended"] == 1
    run.refresh_from_db()
    assert run.status == "queued" and run.paused_until is None
    resumed = RunEvent.objects.get(run=run, kind="resumed")
    assert resumed.actor_id is None and "the platform" in resumed.message and "pause ended" in resumed.message
    assert sweep(now=until + dt.timedelta(seconds=2))["pauses_ended"] == 0  # once
    assert drive(run.pk).status == RunStatus.SUCCEEDED


def test_a_pause_without_an_end_is_never_resumed_by_the_sweeper(tenant, asha, ravi, echo):
    from runs.recovery.sweeper import sweep

    run, _ = start_run(user=asha, agent="agent", input={"word": "hi"})
    pausing.pause_run(run_id=run.pk, actor=ravi, reason="hold")
    assert sweep(now=timezone.now() + dt.timedelta(days=30))["pauses_ended"] == 0
    assert Run.objects.get(pk=run.pk).status == "paused"


def test_an_end_that_has_passed_is_a_field_error(tenant, asha, ravi, echo):
    run, _ = start_run(user=asha, agent="agent", input={"word": "hi"})
    past = (timezone.now() - dt.timedelta(minutes=1)).isoformat()
    one = api(ravi).post(f"/v1/runs/{run.pk}/pause", {"reason": "x", "until": past}, format="json")
    assert one.status_code == 400 and "until" in one.json()["error"]["fields"]
    bulk = api(ravi).post("/v1/runs/pause", {"reason": "x", "until": past}, format="json")
    assert bulk.status_code == 400 and "until" in bulk.json()["error"]["fields"]
    assert Run.objects.get(pk=run.pk).status == "queued" and not BulkAction.objects.exists()


def test_a_tenant_that_counts_paused_time_keeps_the_deadline_and_is_stopped_at_it(tenant, asha, ravi, echo):
    from runs.recovery.sweeper import sweep

    tenant.paused_time_counts = True
    tenant.save()
    run, _ = start_run(user=asha, agent="agent", input={"word": "hi"})
    deadline = run.deadline_at
    pausing.pause_run(run_id=run.pk, actor=ravi, reason="hold")
    pausing.resume_run(run_id=run.pk, actor=ravi)
    assert Run.objects.get(pk=run.pk).deadline_at == deadline  # the pause counted: not moved

    pausing.pause_run(run_id=run.pk, actor=ravi, reason="hold again")
    sweep(now=deadline - dt.timedelta(seconds=1))
    assert Run.objects.get(pk=run.pk).status == "paused"
    sweep(now=deadline + dt.timedelta(seconds=1))
    run.refresh_from_db()
    assert (run.status, run.stop_reason) == ("stopped", "deadline")
