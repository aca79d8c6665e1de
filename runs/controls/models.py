"""The rows of an operator's controls over runs: a bulk pause or resume (runs/controls/pausing.py), and the
kill switches with their history (runs/controls/kill_switches.py). Part of the runs app (runs/models.py
imports them)."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class BulkAction(models.Model):
    """One operator's pause, resume or cancel of every run that matched a filter
    (runs/controls/pausing.py, cancelling.py): who, why, the filter as given and how many runs it
    moved; each run also has its own event."""

    class Kind(models.TextChoices):
        PAUSE = "pause"
        RESUME = "resume"
        CANCEL = "cancel"

    kind = models.CharField(max_length=8, choices=Kind.choices)
    tenant = models.ForeignKey(
        "tenants.Tenant", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )  # null: across tenants (a platform operator)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    reason = models.TextField()
    filters = models.JSONField(default=dict)
    count = models.PositiveIntegerField(default=0)
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-at"]

    def __str__(self) -> str:
        return f"{self.kind} {self.count} runs: {self.reason}"


class KillSwitch(models.Model):
    """An operator's stop on a tenant, an agent, a tool or a model endpoint (runs/controls/kill_switches.py):
    while on, a killed tenant or agent starts no run, and a killed tool or endpoint is never called
    (the claim pauses the run instead, with the switch as the reason). One row per target; each
    flip is a KillSwitchChange."""

    class Scope(models.TextChoices):
        TENANT = "tenant"
        AGENT = "agent"
        TOOL = "tool"
        ENDPOINT = "endpoint"

    scope = models.CharField(max_length=8, choices=Scope.choices)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    target_id = models.BigIntegerField()  # the tenant's, agent's, tool's or endpoint's id
    target_name = models.CharField(max_length=200)
    on = models.BooleanField(default=True)
    changed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    reason = models.TextField()
    changed_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["scope", "target_id"], name="uniq_kill_switch_target")]
        # What the claim probes before each call: empty while no switch is on.
        indexes = [
            models.Index(fields=["scope", "target_id"], name="kill_switch_on", condition=models.Q(on=True))
        ]
        ordering = ["-changed_at"]
        verbose_name_plural = "kill switches"

    def __str__(self) -> str:
        return f"{self.scope} {self.target_name}: {'on' if self.on else 'off'}"


class KillSwitchChange(models.Model):
    """One flip of a switch: who, why, when, and how many runs it paused or resumed then."""

    switch = models.ForeignKey(KillSwitch, on_delete=models.CASCADE, related_name="changes")
    on = models.BooleanField()
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    reason = models.TextField()
    at = models.DateTimeField(auto_now_add=True)
    runs_resumed = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-at"]
        verbose_name = "flip"

    def __str__(self) -> str:
        return f"{'on' if self.on else 'off'}: {self.reason}"
