from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models

from vault.fields import SealedJSONField, SealedTextField


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
    # No database key: steps are partitioned by their run (history/partitions.py), so none can
    # point at a step's id alone; Django still cascades.
    step = models.OneToOneField(
        "runs.Step", on_delete=models.CASCADE, related_name="approval", db_constraint=False
    )
    tool = models.ForeignKey("tools.Tool", on_delete=models.PROTECT, related_name="approvals")
    # Content (the call's arguments, people's texts) is sealed at rest with the run's key
    # (vault/fields.py): erasing the run destroys the key, and with it every copy.
    arguments = SealedJSONField(run="run_id", tenant="tenant_id", empty=dict)
    digest = models.CharField(max_length=64)
    policy = models.TextField()  # the tool's own approval rule (its `approval:` key), as text
    policy_version = models.PositiveIntegerField()  # the tool's, bound into the digest
    reason = models.TextField()  # why the policy fired
    # The Cedar policies that asked for approval (their @id, and their text as it was then), and
    # the version of the tenant's policies that decided (null: the tenant has none, only the
    # tool's rule decided): what the approval page and GET /v1/approvals/{id} show.
    policy_ids = models.JSONField(default=list, blank=True)
    policy_texts = models.JSONField(default=list, blank=True)
    policy_set_version = models.PositiveIntegerField(null=True, blank=True)
    # Dual control: distinct approvers needed (@approvers on the policy), none the requester.
    required_approvals = models.PositiveSmallIntegerField(default=1)
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
    decision_reason = SealedTextField(run="run_id", tenant="tenant_id")
    # An approver's correction of the call (approvals.services.correct): what the model proposed,
    # who changed it and why; `arguments` and `digest` are then the corrected call's.
    original_arguments = SealedJSONField(blank=True, run="run_id", tenant="tenant_id")
    corrected_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    correction_reason = SealedTextField(run="run_id", tenant="tenant_id")
    void_reason = SealedTextField(run="run_id", tenant="tenant_id")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(db_index=True)
    decided_at = models.DateTimeField(null=True, blank=True)
    consumed_at = models.DateTimeField(null=True, blank=True)
    # Reminders and escalation (approvals/reminders.py): when they fall due, fixed at the request
    # from the tenant's and the tool's ReminderRule like expires_at, and when each was done (once).
    remind_at = models.DateTimeField(null=True, blank=True)
    escalate_at = models.DateTimeField(null=True, blank=True)
    escalate_to = models.ForeignKey(
        "tenants.TenantGroup", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    reminded_at = models.DateTimeField(null=True, blank=True)
    escalated_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at"]
        indexes = [
            # The sweeper's two passes read only pending approvals with something still to do.
            models.Index(
                fields=["remind_at"],
                name="approval_reminder_due",
                condition=models.Q(status="pending", reminded_at__isnull=True, remind_at__isnull=False),
            ),
            models.Index(
                fields=["escalate_at"],
                name="approval_escalation_due",
                condition=models.Q(status="pending", escalated_at__isnull=True, escalate_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tool.name} for run {self.run_id} ({self.status})"


class ApprovalVote(models.Model):
    """One person's approval of a pending call (dual control): the approval moves to approved
    when it has as many distinct votes as it requires. A correction clears the votes for the
    call it replaced: each person approved a call, not a step."""

    approval = models.ForeignKey(Approval, on_delete=models.CASCADE, related_name="votes")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    digest = models.CharField(max_length=64)  # of the call this person approved
    reason = SealedTextField(run="approval.run_id", tenant="approval.tenant_id")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at", "id"]
        constraints = [
            models.UniqueConstraint(fields=["approval", "user"], name="uniq_approval_vote_per_person")
        ]


class PolicyMode(models.TextChoices):
    ENFORCE = "enforce"  # decides
    SHADOW = "shadow"  # evaluated and recorded, never enforced


class TenantPolicies(models.Model):
    """What the tenant's configuration file says about Cedar policies, besides their text: the
    declared attributes of users and tools, the argument whose total per day the platform keeps
    per tool, and whether a call no policy permits is allowed (approvals/cedar.py)."""

    tenant = models.OneToOneField("tenants.Tenant", on_delete=models.CASCADE, related_name="policies")
    default = models.CharField(max_length=8, default="permit")  # permit | deny
    user_attribute_types = models.JSONField(default=dict, blank=True)  # name -> long|string|bool|set
    user_attributes = models.JSONField(default=dict, blank=True)  # username -> {name: value}
    group_roles = models.JSONField(default=dict, blank=True)  # group name -> [role]
    tool_attribute_types = models.JSONField(default=dict, blank=True)
    tool_attributes = models.JSONField(default=dict, blank=True)  # tool name -> {name: value}
    totals = models.JSONField(default=dict, blank=True)  # tool name -> argument summed per day
    # tool name -> [argument]: the day's totals are also kept per value of each (customer_id)
    totals_by = models.JSONField(default=dict, blank=True)
    # {"input": {name: type}, "metadata": {name: type}}: the run fields start_run policies read
    run_attribute_types = models.JSONField(default=dict, blank=True)
    tool_names = models.JSONField(default=list, blank=True)  # the tools the schema was generated for
    version = models.PositiveIntegerField(default=1)  # moves on every change: the compiled cache key
    updated_at = models.DateTimeField(auto_now=True)


class PolicySet(models.Model):
    """One named set of Cedar policies of a tenant, enforced or in shadow mode."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="policy_sets")
    name = models.SlugField(max_length=100)
    mode = models.CharField(max_length=8, choices=PolicyMode.choices, default=PolicyMode.ENFORCE)
    text = models.TextField()
    source = models.CharField(max_length=500, blank=True)  # the file it came from
    first_line = models.PositiveIntegerField(default=1)  # of the text in that file
    private = models.BooleanField(default=False)  # the text is never shown outside the admin

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="uniq_policy_set")]
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.mode})"


class ToolDayTotal(models.Model):
    """Calls of a tool dispatched on one local day, and the sum of its declared argument: one row
    for the tenant (user null) and one per user. The tenant row is the lock a daily-total rule is
    decided under (approvals/totals.py)."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    tool = models.ForeignKey("tools.Tool", on_delete=models.CASCADE, related_name="+")
    day = models.DateField()
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.CASCADE, related_name="+")
    calls = models.BigIntegerField(default=0)
    amount = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "tool", "day"],
                condition=models.Q(user__isnull=True),
                name="uniq_tool_day_total_tenant",
            ),
            models.UniqueConstraint(
                fields=["tenant", "tool", "day", "user"],
                condition=models.Q(user__isnull=False),
                name="uniq_tool_day_total_user",
            ),
        ]


class ToolArgumentDayTotal(models.Model):
    """Calls of a tool dispatched on one local day for one value of a declared argument (the same
    customer_id), and the sum of the totalled argument. Locked after the tool's ToolDayTotal rows,
    which serialise every claim of the tool's day, so its creation never races (approvals/calls.py)."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    tool = models.ForeignKey("tools.Tool", on_delete=models.CASCADE, related_name="+")
    day = models.DateField()
    argument = models.CharField(max_length=200)
    value = models.CharField(max_length=200)  # the value as text; a long one by its hash
    calls = models.BigIntegerField(default=0)
    amount = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "tool", "day", "argument", "value"], name="uniq_tool_argument_day_total"
            )
        ]


class CountedCall(models.Model):
    """A tool step counted into its day's totals: once, however often it is claimed again."""

    # No database key: steps are partitioned by their run (history/partitions.py), so none can
    # point at a step's id alone; Django still cascades.
    step = models.OneToOneField(
        "runs.Step", on_delete=models.CASCADE, primary_key=True, related_name="+", db_constraint=False
    )
    total = models.ForeignKey(ToolDayTotal, on_delete=models.CASCADE, related_name="+")
    amount = models.BigIntegerField(default=0)


class ShadowDecision(models.Model):
    """What a policy set in shadow mode would have decided on one call (not enforced)."""

    class Outcome(models.TextChoices):
        ALLOW = "allow"
        DENY = "deny"
        APPROVAL = "approval"

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    run = models.ForeignKey("runs.Run", on_delete=models.CASCADE, related_name="+")
    step_seq = models.PositiveIntegerField()
    tool_name = models.CharField(max_length=200)
    policy_set = models.CharField(max_length=100)
    outcome = models.CharField(max_length=8, choices=Outcome.choices)
    policies = models.JSONField(default=list)  # ids of the policies that decided it
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)


class ReminderRule(models.Model):
    """When a pending approval is reminded of and escalated, from the tenant's configuration file:
    the tenant's rule (tool null) and a tool's, which overrides it key by key. On a tool's rule a
    null field inherits the tenant's and 0 turns it off; escalate_to goes with escalate_after."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    tool = models.ForeignKey("tools.Tool", null=True, on_delete=models.CASCADE, related_name="+")
    remind_after_seconds = models.PositiveIntegerField(null=True)
    escalate_after_seconds = models.PositiveIntegerField(null=True)
    escalate_to = models.ForeignKey(
        "tenants.TenantGroup", null=True, on_delete=models.PROTECT, related_name="+"
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant"], condition=models.Q(tool__isnull=True), name="uniq_reminder_rule_tenant"
            ),
            models.UniqueConstraint(
                fields=["tenant", "tool"],
                condition=models.Q(tool__isnull=False),
                name="uniq_reminder_rule_tool",
            ),
        ]
