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
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["agent", "name"], name="uniq_agent_alias")]
        verbose_name_plural = "aliases"

    def __str__(self) -> str:
        return f"{self.agent.name}@{self.name}"
