"""Operator controls through the API (runs/controls): the tenant operator role flips its tools' and
endpoints' switches, every flip is kept, every pause, resume, cancel and flip is in the admin's
Recent actions attributed to the person, and a bulk action can be previewed, or cancel with a
reason."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import ADDITION, CHANGE, LogEntry
from django.contrib.contenttypes.models import ContentType
from rest_framework.test import APIClient

from runs.models import BulkAction, KillSwitch, Run, RunEvent, RunStatus
from runs.services import start_run
from tenants.roles import permissions_for
from tests import factories

pytestmark = pytest.mark.django_db(transaction=True)


def api(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


@pytest.fixture
def agent(tenant, asha, builtins):
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    return factories.make_agent(
        tenant,
        tools=[echo],
        turns=[{"tool_calls": [{"name": echo.name, "arguments": {"say": "hi"}}]}, {"text": "all done"}],
    )


@pytest.fixture
def olga(tenant):
    """The tenant's operator (the config file's `operator` role), not a supervisor."""
    user = factories.make_user(tenant, "olga", staff=True, view_runs=False)
    user.user_permissions.add(*permissions_for(["operator"]))
    return user


def entries(obj) -> list[tuple[str, int, str]]:
    rows = LogEntry.objects.filter(
        content_type=ContentType.objects.get_for_model(obj), object_id=str(obj.pk)
    ).order_by("action_time", "pk")
    return [(row.user.username, row.action_flag, row.change_message) for row in rows]


def test_the_tenant_operator_flips_a_tools_switch_but_not_an_agents(tenant, olga, builtins, agent):
    echo = builtins["echo"].name
    on = api(olga).post(
        "/v1/kill-switches",
        {"scope": "tool", "target": echo, "on": True, "reason": "echo leaks"},
        format="json",
    )
    assert on.status_code == 200, on.json()
    assert KillSwitch.objects.get().changed_by_id == olga.pk
    refused = api(olga).post(
        "/v1/kill-switches", {"scope": "agent", "target": "agent", "on": True, "reason": "x"}, format="json"
    )
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "not_permitted"
    assert not KillSwitch.objects.filter(scope="agent").exists()
    assert api(olga).get("/v1/kill-switches").status_code == 200
    # A plain user of the tenant still may not flip anything.
    plain = factories.make_user(tenant, "pat")
    assert (
        api(plain)
        .post(
            "/v1/kill-switches", {"scope": "tool", "target": echo, "on": False, "reason": "x"}, format="json"
        )
        .status_code
        == 403
    )


def test_every_flip_is_kept_and_in_recent_actions(ravi, olga, builtins, agent):
    echo = builtins["echo"].name
    for user, on, reason in [(olga, True, "leaks"), (ravi, False, "patched"), (olga, True, "leaks again")]:
        answer = api(user).post(
            "/v1/kill-switches", {"scope": "tool", "target": echo, "on": on, "reason": reason}, format="json"
        )
        assert answer.status_code == 200, answer.json()
    listed = api(ravi).get("/v1/kill-switches").json()
    assert len(listed) == 1
    history = [(h["on"], h["actor"], h["reason"]) for h in listed[0]["history"]]
    assert history == [(True, "olga", "leaks again"), (False, "ravi", "patched"), (True, "olga", "leaks")]
    switch = KillSwitch.objects.get()
    assert entries(switch) == [
        ("olga", ADDITION, "Turned on: leaks"),
        ("ravi", CHANGE, "Turned off: patched"),
        ("olga", CHANGE, "Turned on: leaks again"),
    ]


def test_pause_resume_and_cancel_through_the_api_are_in_recent_actions(asha, ravi, agent):
    run, _ = start_run(user=asha, agent="agent", input={"case": "C-1"})
    assert (
        api(ravi).post(f"/v1/runs/{run.pk}/pause", {"reason": "bank degraded"}, format="json").status_code
        == 200
    )
    assert api(ravi).post(f"/v1/runs/{run.pk}/resume", {"reason": "back"}, format="json").status_code == 200
    assert (
        api(ravi)
        .post(f"/v1/runs/{run.pk}/cancel", {"reason": "customer withdrew"}, format="json")
        .status_code
        == 200
    )
    assert entries(run) == [
        ("ravi", CHANGE, "Paused: bank degraded"),
        ("ravi", CHANGE, "Resumed: back"),
        ("ravi", CHANGE, "Cancelled: customer withdrew"),
    ]


def test_a_bulk_preview_counts_without_changing_anything(asha, ravi, agent):
    runs = [start_run(user=asha, agent="agent", input={"n": n})[0] for n in range(3)]
    answer = api(ravi).post("/v1/runs/pause", {"agent": "agent", "preview": True}, format="json")
    assert answer.status_code == 200, answer.json()
    body = answer.json()
    assert (body["kind"], body["count"]) == ("pause", 3)
    assert body["runs"] == [str(run.pk) for run in runs]  # the order they would move in
    assert body["filters"]["agent"] == "agent"
    assert not BulkAction.objects.exists() and not Run.objects.filter(status=RunStatus.PAUSED).exists()
    assert (
        api(ravi).post("/v1/runs/cancel", {"agent": "nope", "preview": True}, format="json").json()["count"]
        == 0
    )
    # Without preview, a reason is needed.
    refused = api(ravi).post("/v1/runs/pause", {"agent": "agent"}, format="json")
    assert refused.status_code == 400 and "reason" in refused.json()["error"]["fields"]


def test_bulk_cancel_needs_a_reason_and_cancels_every_match_once(asha, ravi, agent):
    runs = [start_run(user=asha, agent="agent", input={"n": n})[0] for n in range(3)]
    refused = api(ravi).post("/v1/runs/cancel", {"agent": "agent", "reason": " "}, format="json")
    assert refused.status_code == 400 and "reason" in refused.json()["error"]["fields"]
    assert not Run.objects.filter(cancel_requested=True).exists()
    answer = api(ravi).post("/v1/runs/cancel", {"agent": "agent", "reason": "agent recalled"}, format="json")
    assert answer.status_code == 200, answer.json()
    assert (answer.json()["kind"], answer.json()["count"]) == ("cancel", 3)
    assert Run.objects.filter(status=RunStatus.CANCELLED).count() == 3
    action = BulkAction.objects.get()
    assert RunEvent.objects.filter(kind="cancel_requested", skeleton__bulk_action=action.pk).count() == 3
    assert all(entries(run) == [("ravi", CHANGE, "Cancelled: agent recalled")] for run in runs)
    again = api(ravi).post("/v1/runs/cancel", {"agent": "agent", "reason": "again"}, format="json")
    assert again.json()["count"] == 0


def test_bulk_cancel_is_for_supervisors_and_their_own_tenant(asha, olga, agent):
    start_run(user=asha, agent="agent", input={})
    assert api(olga).post("/v1/runs/cancel", {"reason": "x"}, format="json").status_code == 403
    other = factories.make_tenant("globex")
    gina = factories.make_user(other, "gina", staff=True)
    answer = api(gina).post("/v1/runs/cancel", {"reason": "x", "tenant": "acme"}, format="json")
    assert answer.status_code in (403, 400)
    assert not Run.objects.filter(cancel_requested=True).exists()
