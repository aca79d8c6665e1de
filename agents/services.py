"""Agent registry writes: versions are inserted, never updated; aliases move."""

from __future__ import annotations

from django.db import IntegrityError, transaction
from django.db.models import Max

from agents.models import AgentDefinition, AgentVersion, Alias
from agents.spec import validate_spec
from core.digests import digest
from core.errors import DomainError, NotFound
from llm.models import ModelEndpoint


def create_version(*, tenant, agent: str, spec: dict, user=None) -> tuple[AgentVersion, bool]:
    """Validate and store the next version; the same spec as the latest returns that version."""
    errors = validate_spec(spec, tenant)
    if errors:
        raise DomainError("the agent spec is invalid", code="invalid_spec", fields=errors)
    content_hash = digest(spec)
    with transaction.atomic():
        try:
            with transaction.atomic():
                definition, _ = AgentDefinition.objects.get_or_create(tenant=tenant, name=agent)
        except IntegrityError:
            definition = AgentDefinition.objects.get(tenant=tenant, name=agent)
        definition = AgentDefinition.objects.select_for_update().get(pk=definition.pk)
        latest = definition.versions.order_by("-number").first()
        if latest is not None and latest.content_hash == content_hash:
            return latest, False
        number = (definition.versions.aggregate(n=Max("number"))["n"] or 0) + 1
        version = AgentVersion.objects.create(
            agent=definition,
            number=number,
            spec=spec,
            content_hash=content_hash,
            created_by=user,
            model_endpoint=ModelEndpoint.objects.get(tenant=tenant, name=spec["model"]),
        )
    return version, True


def move_alias(*, tenant, agent: str, alias: str, version: int) -> Alias:
    target = AgentVersion.objects.filter(agent__tenant=tenant, agent__name=agent, number=version).first()
    if target is None:
        raise NotFound(f"version {version} of agent {agent}")
    moved, _ = Alias.objects.update_or_create(agent=target.agent, name=alias, defaults={"version": target})
    return moved
