from __future__ import annotations

import uuid

from agentplatform.errors import NotFound
from approvals.models import Approval
from tenants import permissions
from tools.models import Tool


def approvable_tools(user):
    """The caller's tenant's tools on which the caller holds approve_tool (tenants.permissions)."""
    return Tool.objects.filter(
        tenant_id=user.tenant_id, pk__in=permissions.held_pks(user, "approve_tool", Tool)
    )


def approvals_for(user, *, status: str | None = None, tool: str | None = None, run: uuid.UUID | None = None):
    """Approvals in the caller's tenant for tools on which the caller holds approve_tool."""
    approvals = Approval.objects.filter(
        tenant_id=user.tenant_id, tool__in=approvable_tools(user)
    ).select_related("tool", "requested_by", "decided_by", "step", "run")
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
