"""Reminders and escalation of pending approvals, configured through apply, done by the sweeper,
sent through the signed webhooks and counted at a local receiver."""

from __future__ import annotations

import datetime as dt
import json
import threading

import pytest
from django.db import connection
from django.utils import timezone

from approvals.models import Approval, ApprovalStatus, ReminderRule
from configuration.apply import ConfigError, apply_config
from core.errors import Forbidden
from notifications.models import Delivery, Event
from notifications.services import scan, send_due
from runs.approval_effects import decide_approval, remind_approvals
from runs.models import RunEvent, RunStatus
from runs.recovery.sweeper import sweep
from tenants.models import User
from tests.notifications.conftest import make_webhook, parked_approval

pytestmark = pytest.mark.django_db(transaction=True)

EVENTS = [Event.APPROVAL_REMINDER, Event.APPROVAL_ESCALATED]


def notify() -> dict:
    return {**scan(), **send_due(budget_seconds=10)}


def configure(acme, **tenant) -> None:
    """acme reminds after 10 minutes and escalates to risk (meera, omar) after an hour."""
    apply_config(
        {
            "tenant": {
                "slug": "acme",
                "remind_after": "10m",
                "escalate_after": 3600,
                "escalate_to": "risk",
                **tenant,
            },
            "groups": [{"name": "risk"}],
            "users": [
                {"username": "meera", "email": "meera@bank.example", "groups": ["risk"]},
                {"username": "omar", "groups": ["risk"]},
            ],
        }
    )


def later(minutes: float) -> dt.datetime:
    return timezone.now() + dt.timedelta(minutes=minutes)


def received(receiver, event: str) -> list[dict]:
    return [json.loads(r.body) for r in receiver.requests if r.headers["X-Event"] == event]


def test_a_pending_approval_is_reminded_of_once_then_escalated_once(acme, receiver):
    configure(acme)
    make_webhook(acme.tenant, receiver.url, EVENTS)
    scan()
    approval = parked_approval(acme)

    assert sweep(now=later(9))["approvals_reminded"] == 0
    notify()
    assert receiver.requests == []

    assert sweep(now=later(11))["approvals_reminded"] == 1
    notify()
    assert sweep(now=later(12))["approvals_reminded"] == 0
    notify()
    reminders = received(receiver, "approval_reminder")
    assert len(reminders) == 1 and all(r.verified for r in receiver.requests)
    assert reminders[0]["approval"]["id"] == str(approval.pk)
    assert reminders[0]["pending_seconds"] >= 600

    counts = sweep(now=later(61))
    assert (counts["approvals_reminded"], counts["approvals_escalated"]) == (0, 1)
    notify()
    sweep(now=later(62))
    notify()
    escalations = received(receiver, "approval_escalated")
    assert len(escalations) == 1 and len(receiver.requests) == 2
    assert escalations[0]["escalated_to"] == {
        "group": "risk",
        "members": [
            {"username": "meera", "name": "", "email": "meera@bank.example"},
            {"username": "omar", "name": "", "email": ""},
        ],
    }

    kinds = list(approval.run.events.filter(kind__startswith="approval_").values_list("kind", flat=True))
    assert kinds == ["approval_requested", "approval_reminder", "approval_escalated"]
    escalated = approval.run.events.get(kind="approval_escalated")
    assert escalated.data["group"] == "risk" and escalated.data["members"] == ["meera", "omar"]
    approval.refresh_from_db()
    assert approval.reminded_at is not None and approval.escalated_at > approval.reminded_at


def test_a_member_of_the_group_may_decide_only_once_it_is_escalated(acme):
    configure(acme)
    approval = parked_approval(acme)
    meera = User.objects.get(username="meera")

    remind_approvals(now=later(11))  # reminded, not yet escalated
    with pytest.raises(Forbidden):
        decide_approval(approval_id=approval.pk, user=meera, approve=True)

    assert remind_approvals(now=later(61)) == {"reminded": 0, "escalated": 1}
    decided = decide_approval(approval_id=approval.pk, user=meera, approve=True, reason="covering for ravi")

    assert decided.status == ApprovalStatus.APPROVED and decided.decided_by == meera
    assert approval.run.events.filter(kind="approval_approved", actor=meera).exists()
    approval.run.refresh_from_db()
    assert approval.run.status == RunStatus.RUNNING


def test_a_user_outside_the_group_still_may_not_decide_an_escalated_approval(acme):
    configure(acme)
    approval = parked_approval(acme)
    remind_approvals(now=later(61))
    outsider = User.objects.create_user(username="zoe", tenant=acme.tenant)

    with pytest.raises(Forbidden):
        decide_approval(approval_id=approval.pk, user=outsider, approve=True)
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.PENDING


def test_two_sweepers_racing_remind_and_escalate_once(acme, receiver):
    configure(acme)
    make_webhook(acme.tenant, receiver.url, EVENTS)
    scan()
    approvals = [parked_approval(acme) for _ in range(3)]
    now = later(61)
    barrier = threading.Barrier(2)
    results: list[dict] = []

    def sweeper():
        try:
            barrier.wait(timeout=10)
            results.append(remind_approvals(now=now))
        finally:
            connection.close()

    threads = [threading.Thread(target=sweeper) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert sum(r["reminded"] for r in results) == 3 and sum(r["escalated"] for r in results) == 3
    notify()
    notify()
    assert len(received(receiver, "approval_reminder")) == 3
    assert len(received(receiver, "approval_escalated")) == 3
    for approval in approvals:
        assert approval.run.events.filter(kind="approval_reminder").count() == 1
        assert approval.run.events.filter(kind="approval_escalated").count() == 1


def test_an_approval_decided_before_its_reminder_sends_nothing(acme, receiver):
    configure(acme)
    make_webhook(acme.tenant, receiver.url, EVENTS)
    scan()
    approval = parked_approval(acme)
    decide_approval(approval_id=approval.pk, user=acme.ravi, approve=True)

    assert remind_approvals(now=later(61)) == {"reminded": 0, "escalated": 0}
    notify()

    assert receiver.requests == [] and not Delivery.objects.exists()
    assert not RunEvent.objects.filter(kind__in=["approval_reminder", "approval_escalated"]).exists()


def test_an_approval_decided_after_its_reminder_was_recorded_is_not_sent(acme, receiver):
    configure(acme)
    make_webhook(acme.tenant, receiver.url, EVENTS)
    scan()
    approval = parked_approval(acme)
    remind_approvals(now=later(11))
    decide_approval(approval_id=approval.pk, user=acme.ravi, approve=False, reason="no")

    notify()

    assert receiver.requests == []
    assert approval.run.events.filter(kind="approval_reminder").count() == 1  # the timeline keeps it


def test_an_expired_approval_is_neither_reminded_nor_escalated(acme, receiver):
    configure(acme, approval_ttl_seconds=7200)
    make_webhook(acme.tenant, receiver.url, EVENTS)
    scan()
    approval = parked_approval(acme)

    counts = sweep(now=later(121))  # past remind, escalate and the expiry at once

    assert counts["approvals_expired"] == 1
    assert (counts["approvals_reminded"], counts["approvals_escalated"]) == (0, 0)
    notify()
    assert receiver.requests == []
    assert Approval.objects.get(pk=approval.pk).reminded_at is None


def test_a_tool_overrides_the_tenant_and_can_turn_reminders_off(acme):
    configure(acme)
    tool = acme.tools["echo"]
    server, name = tool.name.split("__")
    apply_config(
        {
            "tenant": {"slug": "acme", "remind_after": "10m", "escalate_after": "1h", "escalate_to": "risk"},
            "tools": [{"server": server, "name": name, "remind_after": None, "escalate_after": "2h30m"}],
        }
    )
    approval = parked_approval(acme)

    assert approval.remind_at is None
    assert (approval.escalate_at - approval.created_at).total_seconds() == pytest.approx(9000, abs=2)
    assert approval.escalate_to.name == "risk"


def errors_of(data: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        apply_config(data)
    return dict(caught.value.errors)


def test_apply_refuses_bad_reminder_settings_with_the_field_named(acme):
    server, name = acme.tools["echo"].name.split("__")
    tenant = {"slug": "acme", "remind_after": "10m", "escalate_after": "1h", "escalate_to": "risk"}

    assert errors_of({"tenant": tenant}) == {"tenant.escalate_to": "no group named 'risk' in this tenant"}
    groups = [{"name": "risk"}]
    assert errors_of({"tenant": {**tenant, "remind_after": "soon"}, "groups": groups}) == {
        "tenant.remind_after": 'must be whole seconds or a duration such as "90s", "30m", "2h", "1h30m", "1d"'
    }
    assert errors_of({"tenant": {**tenant, "escalate_after": "5m"}, "groups": groups}) == {
        "tenant.escalate_after": "must be later than remind_after (600 s): remind first"
    }
    assert errors_of({"tenant": {**tenant, "escalate_to": None}, "groups": groups}) == {
        "tenant.escalate_to": "required with escalate_after: the group the approval goes to"
    }
    assert errors_of({"tenant": {**tenant, "approval_ttl_seconds": 1800}, "groups": groups}) == {
        "tenant.escalate_after": "must be shorter than the approval's lifetime "
        "(approval_ttl_seconds 1800 s): it would expire first"
    }
    tool = {"server": server, "name": name, "escalate_to": "audit"}
    assert errors_of({"tenant": tenant, "groups": groups, "tools": [tool]}) == {
        "tools[0].escalate_to": "no group named 'audit' in this tenant"
    }
    assert not ReminderRule.objects.exists()


def test_the_example_of_docs_policies_md_applies_and_schedules_as_it_says(acme):
    """The YAML of docs/policies.md's "Reminders and escalation", on acme's tools in place of the bank's."""
    import re

    import yaml

    from approvals.reminders import schedule_for
    from tests.servers import ROOT

    doc = (ROOT / "docs" / "policies.md").read_text()
    section = doc[doc.index("## Reminders and escalation") :]
    data = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
    data["tenant"]["slug"] = "acme"
    for tool, ours in zip(data["tools"], ["echo", "noop"], strict=True):
        tool.update(server="platform", name=ours)
    data["groups"] = [{"name": "duty-managers"}]
    apply_config(data)

    refund, lookup = (schedule_for(acme.tools[name]) for name in ("echo", "noop"))
    assert (refund.remind_after, refund.escalate_after, refund.escalate_to.name) == (
        1800,
        2700,
        "duty-managers",
    )
    assert (lookup.remind_after, lookup.escalate_after, lookup.escalate_to.name) == (
        None,
        7200,
        "duty-managers",
    )


def test_the_api_shows_the_times_and_lists_the_approval_to_the_group_once_escalated(acme):
    from rest_framework.test import APIClient

    configure(acme)
    approval = parked_approval(acme)
    client = APIClient()
    client.force_authenticate(User.objects.get(username="meera"))
    assert client.get("/v1/approvals").json()["results"] == []

    remind_approvals(now=later(11))
    remind_approvals(now=later(61))

    listed = client.get("/v1/approvals").json()["results"]
    assert [a["id"] for a in listed] == [str(approval.pk)]
    assert listed[0]["escalated_to"] == "risk"
    assert listed[0]["reminded_at"] is not None and listed[0]["escalated_at"] is not None
    answer = client.post(f"/v1/approvals/{approval.pk}/deny", {"reason": "not today"}, format="json")
    assert answer.status_code == 200 and answer.json()["status"] == "denied"
