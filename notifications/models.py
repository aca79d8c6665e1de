"""Webhooks a tenant configures, and the deliveries made to them (one row per notification).

A Delivery is created once per (webhook, subject, event) by the scan (services.scan) and sent by
`services.send_due`: each attempt is claimed under a short lease and recorded as a
DeliveryAttempt, so the history of every notification is in the database.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

from tenants.crypto import decrypt, encrypt


class Event(models.TextChoices):
    APPROVAL_REQUESTED = "approval_requested"
    APPROVAL_EXPIRING = "approval_expiring"
    # A pending approval's reminder, then its escalation to another group (approvals/reminders.py).
    APPROVAL_REMINDER = "approval_reminder"
    APPROVAL_ESCALATED = "approval_escalated"
    RUN_NEEDS_ATTENTION = "run_needs_attention"
    RUN_PAUSED = "run_paused"  # an operator's or a kill switch's pause taken (runs/controls/pausing.py)
    RUN_RESUMED = "run_resumed"
    # A run waits for its user to connect a tool server (connections/): the payload has the link.
    RUN_WAITING_AUTHORIZATION = "run_waiting_authorization"
    # A canary ended (agents.AliasChange): rolled back by the watcher or by hand, or promoted.
    CANARY_ROLLED_BACK = "canary_rolled_back"
    CANARY_PROMOTED = "canary_promoted"


class Webhook(models.Model):
    """Where a tenant's notifications go. The URL is a destination: set by apply or an operator,
    and held to the tenant's egress hosts like tool servers' URLs."""

    DESTINATION_FIELDS = ["url", "signing_ciphertext"]

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="webhooks")
    name = models.SlugField(max_length=50)
    url = models.URLField(max_length=500)
    # The HMAC key, encrypted at rest with SECRET_ENCRYPTION_KEYS exactly as tenants.Secret is.
    signing_ciphertext = models.TextField()
    events = models.JSONField(default=list)  # values of Event
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="uniq_webhook_name")]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.name}"

    def set_signing_secret(self, plaintext: str) -> None:
        self.signing_ciphertext = encrypt(plaintext, settings.SECRET_ENCRYPTION_KEYS)

    def signing_secret(self) -> str:
        return decrypt(self.signing_ciphertext, settings.SECRET_ENCRYPTION_KEYS)


class DeliveryStatus(models.TextChoices):
    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"


DELIVERY_TRANSITIONS: dict[str, set[str]] = {
    DeliveryStatus.PENDING: {DeliveryStatus.DELIVERED, DeliveryStatus.FAILED},
}


class DeliveryCounter(models.Model):
    """The last delivery number given in a tenant (Delivery.number).

    Numbers are per tenant so that a receiver learns nothing of other tenants' volume (one sequence
    across tenants let it count their notifications between two of its own)."""

    tenant = models.OneToOneField(
        "tenants.Tenant", on_delete=models.CASCADE, primary_key=True, related_name="+"
    )
    last = models.PositiveBigIntegerField(default=0)


class Delivery(models.Model):
    """One notification to one webhook, sent until a 2xx answer or until it runs out of attempts.

    `attempts` is also the fencing token of a claim: only the worker that claimed attempt N may
    record its outcome, so a sender whose lease ran out changes nothing. `number` is what receivers
    see (`id`, X-Delivery-Id): increasing within the tenant, unique in it, with gaps where a
    concurrent scan made the same notification first.
    """

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    number = models.PositiveBigIntegerField()
    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="deliveries")
    event = models.CharField(max_length=32, choices=Event.choices)
    # What the notification is about: the approval's id, "<run id>:<event seq>" for a run that
    # entered needs_attention (a run can need attention more than once), or "alias_change:<id>".
    subject = models.CharField(max_length=100)
    run_id = models.UUIDField(null=True, blank=True)
    approval_id = models.UUIDField(null=True, blank=True)
    payload = models.JSONField()
    status = models.CharField(max_length=12, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    # When it may next be claimed: the next retry, or the end of the current attempt's lease.
    next_attempt_at = models.DateTimeField()
    last_status_code = models.PositiveIntegerField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "deliveries"
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(fields=["webhook", "subject", "event"], name="uniq_delivery_subject"),
            models.UniqueConstraint(fields=["tenant", "number"], name="uniq_delivery_number"),
        ]
        indexes = [
            models.Index(
                fields=["next_attempt_at"],
                name="delivery_due",
                condition=models.Q(status="pending"),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.event} {self.subject} to {self.webhook_id} ({self.status})"


class DeliveryAttempt(models.Model):
    """One POST of a delivery: written when claimed, completed when the answer (or error) is in.
    An attempt never completed is one whose sender died; its lease ran out and the next took over."""

    delivery = models.ForeignKey(Delivery, on_delete=models.CASCADE, related_name="attempt_rows")
    number = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    status_code = models.PositiveIntegerField(null=True, blank=True)
    error = models.TextField(blank=True)
    # When the next attempt was scheduled after this one failed (null: delivered, failed or unfinished).
    retry_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["delivery", "number"]
        constraints = [
            models.UniqueConstraint(fields=["delivery", "number"], name="uniq_delivery_attempt"),
        ]

    def __str__(self) -> str:
        return f"attempt {self.number} of delivery {self.delivery_id}"


class ScanCursor(models.Model):
    """How far the scan has read RunEvent ids (name "run_events") and AliasChange ids (name
    "alias_changes")."""

    name = models.CharField(max_length=40, unique=True)
    last_id = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.name} at {self.last_id}"
