from __future__ import annotations

import random
from collections.abc import Callable

from agents.models import AgentDefinition, AgentVersion, Alias
from core.errors import DomainError, NotFound
from tenants.permissions import holds


def get_agent(*, tenant, name: str) -> AgentDefinition:
    agent = AgentDefinition.objects.filter(tenant=tenant, name=name).first()
    if agent is None:
        raise NotFound(f"agent {name}")
    return agent


def resolve_version(
    *, tenant, agent: str, alias: str | None = None, version: int | None = None
) -> AgentVersion:
    """The version a new run pins: an explicit number, else the alias (default `prod`)."""
    return resolve_arm(tenant=tenant, agent=agent, alias=alias, version=version)[0]


def resolve_arm(
    *,
    tenant,
    agent: str,
    alias: str | None = None,
    version: int | None = None,
    draw: Callable[[], float] = random.random,
) -> tuple[AgentVersion, str]:
    """The version a new run pins and the arm it took: "" for an explicit number; through an alias
    with a canary, "canary" for `canary_percent` of the draws, else "stable"."""
    if alias and version:
        raise DomainError(
            "give alias or version, not both", fields={"version": ["give alias or version, not both"]}
        )
    definition = get_agent(tenant=tenant, name=agent)
    if version:
        pinned = definition.versions.filter(number=version).select_related("agent", "model_endpoint").first()
        if pinned is None:
            raise NotFound(f"version {version} of agent {agent}")
        return pinned, ""
    name = alias or "prod"
    found = (
        Alias.objects.filter(agent=definition, name=name)
        .select_related(
            "version",
            "version__agent",
            "version__model_endpoint",
            "canary_version",
            "canary_version__agent",
            "canary_version__model_endpoint",
        )
        .first()
    )
    if found is None:
        raise NotFound(f"alias {name} of agent {agent}")
    if found.canary_version is not None and draw() * 100 < found.canary_percent:
        return found.canary_version, "canary"
    return found.version, "stable" if found.canary_version is not None else ""


def versions_of(*, tenant, agent: str):
    return AgentVersion.objects.filter(agent=get_agent(tenant=tenant, name=agent)).order_by("number")


def may_run_agent(user, agent_id) -> bool:
    """Whether `user` holds run_agent on the agent (django-guardian, through its group or directly)."""
    return holds(user, "run_agent", AgentDefinition, agent_id)
