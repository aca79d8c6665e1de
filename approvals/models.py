from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models


class ApprovalStatus(models.TextChoices):
    PENDING = "pending"
    APPROVED = "approved"
    DENIED = "denied"
    EXPIRED = "expired"
    VOIDED = "voided"
    CONSUMED = "consumed"


APPROVAL_TRANSITIONS: dict[str, set[str]] = {
    ApprovalStatus.PENDING: {
        ApprovalStatus.APPROVED,
        ApprovalStatus.DENIED,
        ApprovalStatus.EXPIRED,
        ApprovalStatus.VOIDED,
    },
    ApprovalStatus.APPROVED: {ApprovalStatus.CONSUMED, ApprovalStatus.VOIDED},
}


class Approval(models.Model):
    """Bound to one step and to the digest of the exact call; single use; expires."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="approvals")
    run = models.ForeignKey("runs.Run", on_delete=models.CASCADE, related_name="approvals")
    step = models.OneToOneField("runs.Step", on_delete=models.CASCADE, related_name="approval")
    tool = models.ForeignKey("tools.Tool", on_delete=models.PROTECT, related_name="approvals")
    arguments = models.JSONField()
    digest = models.CharField(max_length=64)
    policy = models.TextField()
    policy_version = models.PositiveIntegerField()
    reason = models.TextField()  # why the policy fired
    status = models.CharField(
        max_length=12, choices=ApprovalStatus.choices, default=ApprovalStatus.PENDING, db_index=True
    )
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="approvals_requested"
    )
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="approvals_decided",
    )
    decision_reason = models.TextField(blank=True)
    void_reason = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(db_index=True)
    decided_at = models.DateTimeField(null=True, blank=True)
    consumed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at"]

    def __str__(self) -> str:
        return f"{self.tool.name} for run {self.run_id} ({self.status})"
