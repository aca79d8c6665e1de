"""The admin's pause and resume: the run page's buttons next to Cancel, and the list actions with a
reason typed in the actions bar (runs/controls/admin.py)."""

from __future__ import annotations

import pytest

from runs.models import BulkAction, Run, RunEvent
from tests.admin.helpers import park_on_approval

RUNS = "/admin/runs/run/"

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_run_page_pauses_and_resumes_next_to_cancel(as_ravi, acme):
    approval = park_on_approval(acme.asha, "refunder")
    page = as_ravi.get(f"{RUNS}{approval.run_id}/change/").content.decode()
    assert 'id="pause"' in page and 'id="cancel"' in page
    answer = as_ravi.post(f"{RUNS}{approval.run_id}/pause/", {"reason": "core banking degraded"}, follow=True)
    assert answer.status_code == 200
    run = Run.objects.get(pk=approval.run_id)
    assert (run.status, run.pause_reason, run.paused_by_id) == (
        "paused",
        "core banking degraded",
        acme.ravi.pk,
    )
    page = as_ravi.get(f"{RUNS}{run.pk}/change/").content.decode()
    assert 'id="resume"' in page and "core banking degraded" in page
    as_ravi.post(f"{RUNS}{run.pk}/resume/", {"reason": "back"})
    assert Run.objects.get(pk=run.pk).status == "running"


def test_the_list_actions_need_a_reason_and_leave_one_audit_record(as_ravi, acme):
    runs = [park_on_approval(acme.asha, "refunder").run_id for _ in range(2)]
    post = {"action": "pause_selected", "_selected_action": [str(r) for r in runs], "index": 0}
    as_ravi.post(RUNS, {**post, "reason": ""}, follow=True)
    assert not Run.objects.filter(status="paused").exists()
    as_ravi.post(RUNS, {**post, "reason": "hold refunds"}, follow=True)
    assert Run.objects.filter(pk__in=runs, status="paused").count() == 2
    action = BulkAction.objects.get()
    assert (action.kind, action.count, action.actor_id) == ("pause", 2, acme.ravi.pk)
    assert RunEvent.objects.filter(kind="paused", skeleton__bulk_action=action.pk).count() == 2
    as_ravi.post(RUNS, {**post, "action": "resume_selected", "reason": "back"}, follow=True)
    assert Run.objects.filter(pk__in=runs, status="running").count() == 2


def test_a_support_user_sees_no_pause_button(client, acme):
    from tests import factories

    sam = factories.make_user(acme.tenant, "sam", staff=True, view_runs=False)
    approval = park_on_approval(acme.asha, "refunder")
    client.force_login(sam)
    assert client.post(f"{RUNS}{approval.run_id}/pause/", {"reason": "x"}).status_code in (302, 403, 404)
    assert Run.objects.get(pk=approval.run_id).status == "waiting_approval"


def test_the_switches_page_flips_a_switch_with_a_reason(as_ravi, acme):
    from runs.models import KillSwitch, KillSwitchChange

    page = "/admin/runs/killswitch/"
    echo = acme.tools["echo"].name
    bad = as_ravi.post(f"{page}add/", {"scope": "tool", "target": "nope", "on": "on", "reason": "x"})
    assert bad.status_code == 200 and not KillSwitch.objects.exists()  # the form's error
    as_ravi.post(f"{page}add/", {"scope": "tool", "target": echo, "on": "on", "reason": "echo leaks"})
    switch = KillSwitch.objects.get()
    assert (switch.on, switch.reason, switch.changed_by_id) == (True, "echo leaks", acme.ravi.pk)
    assert "echo leaks" in as_ravi.get(page).content.decode()
    as_ravi.post(f"{page}{switch.pk}/change/", {"reason": "patched"})  # the box unticked: off
    switch.refresh_from_db()
    assert (switch.on, switch.reason) == (False, "patched")
    assert KillSwitchChange.objects.count() == 2


def test_the_bulk_form_pauses_and_resumes_every_matching_run_and_lists_the_record(as_ravi, acme):
    page = "/admin/runs/bulkaction/"
    runs = [park_on_approval(acme.asha, "refunder").run_id for _ in range(3)]
    form = as_ravi.get(f"{page}add/").content.decode()
    assert (
        'name="agent"' in form and 'name="until"' in form and 'name="tenant"' not in form
    )  # a supervisor's own
    asked = {"kind": "pause", "reason": "refunds on hold", "agent": "refunder"}
    answer = as_ravi.post(f"{page}add/", asked)  # first a preview: nothing moves yet
    assert "Preview: this would pause 3 runs now" in answer.content.decode()
    assert not Run.objects.filter(status="paused").exists() and not BulkAction.objects.exists()
    previewed = answer.context["adminform"].form["previewed"].value()
    answer = as_ravi.post(f"{page}add/", {**asked, "previewed": previewed}, follow=True)
    assert answer.status_code == 200 and "3 runs paused" in answer.content.decode()
    assert Run.objects.filter(pk__in=runs, status="paused").count() == 3
    action = BulkAction.objects.get()
    assert (action.kind, action.count, action.actor_id, action.filters) == (
        "pause",
        3,
        acme.ravi.pk,
        {"agent": "refunder", "tenant": acme.tenant.slug},
    )
    assert "refunds on hold" in as_ravi.get(page).content.decode()
    back = {"kind": "resume", "reason": "back", "agent": "refunder"}
    previewed = as_ravi.post(f"{page}add/", back).context["adminform"].form["previewed"].value()
    as_ravi.post(f"{page}add/", {**back, "previewed": previewed})
    assert Run.objects.filter(pk__in=runs, status="paused").count() == 0
    assert BulkAction.objects.filter(kind="resume", count=3).exists()
    assert as_ravi.post(f"{page}{action.pk}/change/", {"reason": "rewritten"}).status_code == 403
    assert BulkAction.objects.get(pk=action.pk).reason == "refunds on hold"


def test_the_run_page_pause_can_be_given_an_end_in_the_tenants_zone(as_ravi, acme):
    import datetime as dt

    from django.utils import timezone

    approval = park_on_approval(acme.asha, "refunder")
    page = as_ravi.get(f"{RUNS}{approval.run_id}/change/").content.decode()
    assert 'name="until"' in page
    local = (
        (timezone.now() + dt.timedelta(days=1)).astimezone(acme.tenant.zone).replace(second=0, microsecond=0)
    )
    as_ravi.post(
        f"{RUNS}{approval.run_id}/pause/",
        {"reason": "until tomorrow", "until": local.strftime("%Y-%m-%dT%H:%M")},
    )
    run = Run.objects.get(pk=approval.run_id)
    assert (run.status, run.paused_until) == ("paused", local)
    assert as_ravi.post(f"{RUNS}{approval.run_id}/resume/", {"reason": ""}).status_code == 302
    answer = as_ravi.post(
        f"{RUNS}{approval.run_id}/pause/", {"reason": "x", "until": "2001-01-01T00:00"}, follow=True
    )
    assert "the pause would end before it began" in answer.content.decode()
    assert Run.objects.get(pk=approval.run_id).status != "paused"
