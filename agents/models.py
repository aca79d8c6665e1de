from __future__ import annotations

from django.conf import settings
from django.db import models


class AgentDefinition(models.Model):
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="agents")
    name = models.SlugField(max_length=100)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="uniq_agent_name")]
        # Object permission (guardian, user or group): who may start runs of this agent.
        permissions = [("run_agent", "Start runs of the agent")]

    def __str__(self) -> str:
        return self.name


class AgentVersion(models.Model):
    """Immutable once stored: services only ever insert versions, never update them."""

    agent = models.ForeignKey(AgentDefinition, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    spec = models.JSONField()
    content_hash = models.CharField(max_length=64)
    model_endpoint = models.ForeignKey("llm.ModelEndpoint", on_delete=models.PROTECT, related_name="+")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["agent", "number"], name="uniq_agent_version")]
        ordering = ["agent", "number"]

    def __str__(self) -> str:
        return f"{self.agent.name} v{self.number}"


class Alias(models.Model):
    agent = models.ForeignKey(AgentDefinition, on_delete=models.CASCADE, related_name="aliases")
    name = models.SlugField(max_length=50)
    version = models.ForeignKey(AgentVersion, on_delete=models.PROTECT, related_name="aliases")
    # A canary (docs/evaluations.md#canary): `canary_percent` of the alias's new runs take
    # `canary_version` (the run records its arm); the rest take `version`. Watched from
    # `canary_since` against the stable arm, rolled back by hand or automatically past `canary_rules`.
    canary_version = models.ForeignKey(
        AgentVersion, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    canary_percent = models.PositiveSmallIntegerField(default=0)
    canary_since = models.DateTimeField(null=True, blank=True)
    canary_rules = models.JSONField(default=dict, blank=True)
    # A gate (docs/evaluations.md#gates): moving the alias to a version, starting a canary of it or
    # promoting it needs a finished evaluation of that version on `dataset`'s latest cases with at
    # least `min_pass_rate` overall and `min_tag_pass_rate` per tag ({"safety": 1.0}); {}: no gate.
    gate = models.JSONField(default=dict, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["agent", "name"], name="uniq_agent_alias")]
        verbose_name_plural = "aliases"

    def __str__(self) -> str:
        return f"{self.agent.name}@{self.name}"


class AliasChange(models.Model):
    """Every move of an alias and of its canary, by whom (none: the platform's watcher) and why."""

    class Kind(models.TextChoices):
        MOVED = "moved"
        CANARY_STARTED = "canary_started"
        PROMOTED = "promoted"
        ROLLED_BACK = "rolled_back"

    alias = models.ForeignKey(Alias, on_delete=models.CASCADE, related_name="changes")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    version = models.PositiveIntegerField(null=True, blank=True)  # the stable version after the change
    canary_version = models.PositiveIntegerField(null=True, blank=True)
    canary_percent = models.PositiveSmallIntegerField(default=0)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    automatic = models.BooleanField(default=False)
    reason = models.TextField(blank=True)
    data = models.JSONField(default=dict, blank=True)
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-at"]

    def __str__(self) -> str:
        return f"{self.alias} {self.kind}"
