"""Reminders and escalation of pending approvals: when they fall due, who is asked, each done once.

An approval's `remind_at`, `escalate_at` and `escalate_to` are fixed when it is requested, from the
tenant's ReminderRule and the tool's (which overrides it key by key), as `expires_at` is: a later
apply does not move approvals already waiting. The sweeper (runs.approval_effects.remind_approvals)
marks each reminder and escalation done with one guarded UPDATE (still pending, not yet done, not
expired), under the run's lock, and writes the run event the notification scan turns into a
webhook delivery (notifications/services.py); 0 rows means another sweeper did it, or the approval
was decided or expired meanwhile, and nothing is sent.

Escalation lets the group's members decide the approval through an explicit check
(`escalated_member`), not a guardian grant: a grant of approve_tool would be standing authority
over every later call of the tool, would outlive the approval, and the next apply would remove
it as drift. The check is scoped to this one approval from the moment it was escalated.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.db.models import Q

from approvals.models import Approval, ApprovalStatus, ReminderRule
from tenants.models import TenantGroup, User
from tools.models import Tool


@dataclass(frozen=True)
class Schedule:
    remind_after: int | None  # seconds after the request; None: no reminder
    escalate_after: int | None
    escalate_to: TenantGroup | None


def schedule_for(tool: Tool) -> Schedule:
    """The tenant's rule, overridden key by key by the tool's (0 on the tool turns a key off)."""
    rules = {
        rule.tool_id: rule
        for rule in ReminderRule.objects.filter(
            Q(tool__isnull=True) | Q(tool=tool), tenant_id=tool.tenant_id
        ).select_related("escalate_to")
    }
    tenant, own = rules.get(None), rules.get(tool.pk)

    def pick(name: str) -> int | None:
        mine = getattr(own, name) if own is not None else None
        return (getattr(tenant, name) if tenant is not None else None) if mine is None else mine

    remind, escalate = pick("remind_after_seconds"), pick("escalate_after_seconds")
    group = (own.escalate_to if own is not None and own.escalate_to_id else None) or (
        tenant.escalate_to if tenant is not None else None
    )
    if not escalate or group is None:
        return Schedule(remind or None, None, None)
    return Schedule(remind or None, escalate, group)


def times_for(schedule: Schedule, *, now: dt.datetime, expires_at: dt.datetime) -> dict:
    """The approval's fields; a reminder or escalation due at or after the expiry is dropped."""
    fields: dict = {}
    if schedule.remind_after:
        at = now + dt.timedelta(seconds=schedule.remind_after)
        if at < expires_at:
            fields["remind_at"] = at
    if schedule.escalate_after:
        at = now + dt.timedelta(seconds=schedule.escalate_after)
        if at < expires_at:
            fields.update(escalate_at=at, escalate_to=schedule.escalate_to)
    return fields


def due_reminders(*, now: dt.datetime, limit: int) -> list[tuple]:
    """(approval id, run id) of pending approvals whose reminder is due and not yet sent."""
    return list(
        Approval.objects.filter(
            status=ApprovalStatus.PENDING, reminded_at__isnull=True, remind_at__lte=now, expires_at__gt=now
        )
        .order_by("remind_at")
        .values_list("pk", "run_id")[:limit]
    )


def due_escalations(*, now: dt.datetime, limit: int) -> list[tuple]:
    """(approval id, run id) of pending approvals whose escalation is due and not yet made."""
    return list(
        Approval.objects.filter(
            status=ApprovalStatus.PENDING,
            escalated_at__isnull=True,
            escalate_at__lte=now,
            escalate_to__isnull=False,
            expires_at__gt=now,
        )
        .order_by("escalate_at")
        .values_list("pk", "run_id")[:limit]
    )


def mark_reminded(approval_id, *, now: dt.datetime) -> bool:
    """Record the reminder once; False when done already, or decided or expired meanwhile."""
    return bool(
        Approval.objects.filter(
            pk=approval_id, status=ApprovalStatus.PENDING, reminded_at__isnull=True, expires_at__gt=now
        ).update(reminded_at=now)
    )


def mark_escalated(approval_id, *, now: dt.datetime) -> bool:
    """Record the escalation once; False when done already, or decided or expired meanwhile."""
    return bool(
        Approval.objects.filter(
            pk=approval_id,
            status=ApprovalStatus.PENDING,
            escalated_at__isnull=True,
            escalate_to__isnull=False,
            expires_at__gt=now,
        ).update(escalated_at=now)
    )


def members(approval: Approval) -> list[User]:
    """Who the escalation asks: the group's active members, less the requester (who may not decide)."""
    if approval.escalate_to_id is None:
        return []
    return list(
        User.objects.filter(
            groups__tenant_link__pk=approval.escalate_to_id, is_active=True, tenant_id=approval.tenant_id
        )
        .exclude(pk=approval.requested_by_id)
        .order_by("username")
    )


def escalated_member(user, approval: Approval) -> bool:
    """Whether `user` may decide `approval` because it was escalated to a group they belong to
    (read fresh: a member removed from the group since no longer may)."""
    if approval.escalated_at is None or approval.escalate_to_id is None:
        return False
    return user.groups.filter(tenant_link__pk=approval.escalate_to_id).exists()
