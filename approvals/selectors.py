from __future__ import annotations

import uuid

from django.db.models import Q

from approvals.models import Approval
from core.errors import NotFound
from tenants import permissions
from tools.models import Tool


def approvable_tools(user):
    """The caller's tenant's tools on which the caller holds approve_tool (tenants.permissions)."""
    return Tool.objects.filter(
        tenant_id=user.tenant_id, pk__in=permissions.held_pks(user, "approve_tool", Tool)
    )


def escalated_to(user) -> Q:
    """Approvals escalated to a group the user belongs to (approvals/reminders.py)."""
    return Q(escalated_at__isnull=False, escalate_to__group__in=user.groups.all())


def approvals_for(user, *, status: str | None = None, tool: str | None = None, run: uuid.UUID | None = None):
    """Approvals in the caller's tenant for tools on which the caller holds approve_tool, and those
    escalated to one of the caller's groups."""
    approvals = Approval.objects.filter(
        Q(tool__in=approvable_tools(user)) | escalated_to(user), tenant_id=user.tenant_id
    ).select_related("tool", "requested_by", "decided_by", "step", "run", "escalate_to")
    if status:
        approvals = approvals.filter(status=status)
    if tool:
        approvals = approvals.filter(tool__name=tool)
    if run:
        approvals = approvals.filter(run_id=run)
    return approvals.order_by("created_at")


def get_approval(user, approval_id) -> Approval:
    try:
        return approvals_for(user).get(pk=uuid.UUID(str(approval_id)))
    except (Approval.DoesNotExist, ValueError):
        raise NotFound("approval") from None
