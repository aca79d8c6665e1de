"""The operators' desk in the admin (agentplatform/desk.py, runs/controls/admin.py): paused runs by
reason and the switches that are on, on the desk and in the top bar; a switch's whole history; a
bulk action previewed before it acts, and bulk cancel with a reason; pickers for targets; every
pause, resume, cancel and flip in Recent actions."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry

from runs.controls import kill_switches, pausing
from runs.models import BulkAction, KillSwitch, Run, RunStatus
from tenants.roles import permissions_for
from tests import factories
from tests.admin.helpers import park_on_approval

pytestmark = pytest.mark.django_db(transaction=True)

RUNS = "/admin/runs/run/"
SWITCHES = "/admin/runs/killswitch/"
BULK = "/admin/runs/bulkaction/"


@pytest.fixture
def olga(acme):
    user = factories.make_user(acme.tenant, "olga", staff=True, view_runs=False)
    user.user_permissions.add(*permissions_for(["operator"]))
    return user


def paused_runs(acme, reasons: list[str]) -> list:
    runs = []
    for reason in reasons:
        run_id = park_on_approval(acme.asha, "refunder").run_id
        pausing.pause_run(run_id=run_id, actor=acme.ravi, reason=reason)
        runs.append(run_id)
    return runs


def test_the_desk_and_top_bar_count_paused_runs_by_reason_and_switches_on(as_ravi, acme):
    paused_runs(acme, ["core banking degraded"] * 2 + ["customer asked"])
    park_on_approval(acme.asha, "refunder")  # not paused: not counted
    kill_switches.flip(
        actor=acme.ravi,
        tenant=acme.tenant,
        scope="tool",
        target=acme.tools["echo"].name,
        on=True,
        reason="leaks",
    )

    page = as_ravi.get("/admin/")
    html = page.content.decode()

    assert '<td id="desk-paused">3</td>' in html
    assert page.context["desk"]["paused_reasons"][:2] == [
        {
            "reason": "core banking degraded",
            "runs": 2,
            "url": "/admin/runs/run/?status__exact=paused&pause_reason=core+banking+degraded",
        },
        {
            "reason": "customer asked",
            "runs": 1,
            "url": "/admin/runs/run/?status__exact=paused&pause_reason=customer+asked",
        },
    ]
    assert '<td id="desk-switches">1</td>' in html and "leaks" in html
    assert page.context["platform_counts"] == [
        ("paused runs", 3, "/admin/runs/run/?status__exact=paused"),
        ("kill switches on", 1, "/admin/runs/killswitch/?on__exact=1"),
    ]
    # The reason's link lists exactly those runs.
    listed = as_ravi.get(page.context["desk"]["paused_reasons"][0]["url"]).context["cl"].result_list
    assert len(listed) == 2 and {run.pause_reason for run in listed} == {"core banking degraded"}


def test_a_support_user_sees_no_operator_counts(client, acme):
    paused_runs(acme, ["x"])
    sam = factories.make_user(acme.tenant, "sam", staff=True, view_runs=False)
    sam.user_permissions.add(*permissions_for(["support"]))
    client.force_login(sam)
    page = client.get("/admin/")
    assert page.context["platform_counts"] == [] and "desk-paused" not in page.content.decode()


def test_the_tenant_operator_flips_tool_switches_from_the_admin_with_pickers(client, acme, olga):
    client.force_login(olga)
    form = client.get(f"{SWITCHES}add/")
    assert form.status_code == 200
    fields = form.context["adminform"].form.fields
    assert [value for value, _ in fields["scope"].choices] == ["tool", "endpoint"]  # not tenant, agent
    tools = dict(fields["target"].choices)["Tool"]
    assert (acme.tools["echo"].name, acme.tools["echo"].name) in tools  # a picker, not free text
    echo = acme.tools["echo"].name
    client.post(f"{SWITCHES}add/", {"scope": "tool", "target": echo, "on": "on", "reason": "echo leaks"})
    switch = KillSwitch.objects.get()
    assert (switch.on, switch.changed_by_id) == (True, olga.pk)
    refused = client.post(
        f"{SWITCHES}add/", {"scope": "agent", "target": "refunder", "on": "on", "reason": "x"}
    )
    assert refused.status_code == 200 and not KillSwitch.objects.filter(scope="agent").exists()
    # The top bar shows the operator the switch count, not the paused runs (they may not pause).
    assert [label for label, *_ in client.get("/admin/").context["platform_counts"]] == ["kill switches on"]


def test_a_switchs_page_shows_every_flip_and_the_list_is_named_right(as_ravi, acme):
    echo = acme.tools["echo"].name
    for on, reason in [(True, "leaks"), (False, "patched"), (True, "leaks again")]:
        kill_switches.flip(
            actor=acme.ravi, tenant=acme.tenant, scope="tool", target=echo, on=on, reason=reason
        )
    switch = KillSwitch.objects.get()
    html = as_ravi.get(f"{SWITCHES}{switch.pk}/change/").content.decode()
    assert html.index("leaks again") < html.index("patched") < html.rindex("leaks")
    assert "History (every flip, newest first)" in html
    listing = as_ravi.get(SWITCHES).content.decode()
    assert "Kill switches" in listing and "Kill switchs" not in listing


def test_admin_pause_resume_cancel_and_flip_write_recent_actions(as_ravi, acme):
    run_id = park_on_approval(acme.asha, "refunder").run_id
    as_ravi.post(f"{RUNS}{run_id}/pause/", {"reason": "bank degraded"})
    as_ravi.post(f"{RUNS}{run_id}/resume/", {"reason": "back"})
    as_ravi.post(f"{RUNS}{run_id}/cancel/", {"reason": "customer withdrew"})
    as_ravi.post(
        f"{SWITCHES}add/", {"scope": "tool", "target": acme.tools["echo"].name, "on": "on", "reason": "leaks"}
    )
    messages = list(
        LogEntry.objects.filter(user=acme.ravi)
        .order_by("action_time", "pk")
        .values_list("change_message", flat=True)
    )
    assert messages == [
        "Paused: bank degraded",
        "Resumed: back",
        "Cancelled: customer withdrew",
        "Turned on: leaks",
    ]
    index = as_ravi.get("/admin/").content.decode()
    assert "Recent actions" in index and f"/admin/runs/run/{run_id}/change/" in index


def test_bulk_cancel_in_the_admin_is_previewed_then_needs_a_reason(as_ravi, acme):
    runs = [park_on_approval(acme.asha, "refunder").run_id for _ in range(2)]
    form = as_ravi.get(f"{BULK}add/").context["adminform"].form
    assert "cancel" in dict(form.fields["kind"].choices)
    assert ("refunder", "refunder") in form.fields["agent"].choices  # a picker
    assert ("asha", "asha") in form.fields["created_by"].choices
    asked = {"kind": "cancel", "reason": "", "agent": "refunder"}
    assert as_ravi.post(f"{BULK}add/", asked).status_code == 200  # the reason is required
    asked["reason"] = "agent recalled"
    preview = as_ravi.post(f"{BULK}add/", asked)
    assert "Preview: this would cancel 2 runs now" in preview.content.decode()
    assert not Run.objects.filter(cancel_requested=True).exists()
    key = preview.context["adminform"].form["previewed"].value()
    # Changed filters after the preview: previewed again, not applied.
    again = as_ravi.post(f"{BULK}add/", {**asked, "created_by": "ravi", "previewed": key})
    assert "Preview: this would cancel 0 runs now" in again.content.decode()
    done = as_ravi.post(f"{BULK}add/", {**asked, "previewed": key}, follow=True)
    assert "2 runs cancelled" in done.content.decode()
    assert Run.objects.filter(pk__in=runs, status=RunStatus.CANCELLED).count() == 2
    assert BulkAction.objects.get().kind == "cancel"


def test_the_run_list_cancel_action_needs_a_reason(as_ravi, acme):
    run_id = park_on_approval(acme.asha, "refunder").run_id
    post = {"action": "cancel_selected", "_selected_action": [str(run_id)], "index": 0}
    as_ravi.post(RUNS, {**post, "reason": ""}, follow=True)
    assert not Run.objects.get(pk=run_id).cancel_requested
    as_ravi.post(RUNS, {**post, "reason": "duplicate ticket"}, follow=True)
    assert Run.objects.get(pk=run_id).status == RunStatus.CANCELLED
    assert LogEntry.objects.get(object_id=str(run_id)).change_message == "Cancelled: duplicate ticket"


def test_the_flower_link_searches_for_the_run(as_ravi, acme, settings):
    settings.FLOWER_URL = "http://flower.example:5555"
    run_id = park_on_approval(acme.asha, "refunder").run_id
    page = as_ravi.get(f"{RUNS}{run_id}/change/").content.decode()
    assert f'href="http://flower.example:5555/tasks?name=runs.tasks.advance_run%20args:{run_id}"' in page
