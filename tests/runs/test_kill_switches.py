"""Kill switches driven in-process against real PostgreSQL (runs/kill_switches.py): a killed agent
or tenant starts no run; a killed tool or endpoint is never called (its runs pause at the claim);
turning the switch off resumes what it paused, oldest first."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from runs.engine import advance
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
    from runs import pausing

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
