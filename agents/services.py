"""Agent registry writes: versions are inserted, never updated; aliases move."""

from __future__ import annotations

from django.db import IntegrityError, transaction
from django.db.models import Max
from django.utils import timezone

from agents.models import AgentDefinition, AgentVersion, Alias, AliasChange
from agents.spec import validate_spec
from core.digests import digest
from core.errors import Conflict, DomainError, NotFound
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


def _version(tenant, agent: str, number: int) -> AgentVersion:
    target = AgentVersion.objects.filter(agent__tenant=tenant, agent__name=agent, number=number).first()
    if target is None:
        raise NotFound(f"version {number} of agent {agent}")
    return target


def _alias(tenant, agent: str, alias: str) -> Alias:
    found = Alias.objects.filter(agent__tenant=tenant, agent__name=agent, name=alias).first()
    if found is None:
        raise NotFound(f"alias {alias} of agent {agent}")
    return found


def move_alias(*, tenant, agent: str, alias: str, version: int, user=None, reason: str = "") -> Alias:
    """Point the alias at a version; a canary it had ends (its runs keep their versions)."""
    target = _version(tenant, agent, version)
    with transaction.atomic():
        moved, _ = Alias.objects.update_or_create(
            agent=target.agent,
            name=alias,
            defaults={"version": target, "canary_version": None, "canary_percent": 0, "canary_since": None},
        )
        AliasChange.objects.create(
            alias=moved, kind=AliasChange.Kind.MOVED, version=version, actor=user, reason=reason
        )
    return moved


CANARY_RULES = {
    # The watcher (evals/canary.py) compares the arms' runs that finished within the window, once
    # each arm has min_runs of them; a rate is the share of those runs.
    "window_seconds": 3600,
    "min_runs": 10,
    "max_failure_rate_increase": 0.2,  # failed or stopped
    "max_attention_rate_increase": 0.2,  # ended up needing a person (needs_attention)
    "max_denial_rate_increase": 0.2,  # had a call denied by a policy or grant
    "max_cost_ratio": 2.0,  # mean cost per run, canary over stable
}


def canary_rules_errors(rules) -> dict[str, list[str]]:
    if not isinstance(rules, dict):
        return {"rules": ["a mapping"]}
    errors = {}
    for key, value in rules.items():
        if key not in CANARY_RULES:
            errors[f"rules.{key}"] = ["unknown rule"]
        elif isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            errors[f"rules.{key}"] = ["a number of at least 0"]
    return errors


def start_canary(
    *, tenant, agent: str, alias: str, version: int, percent: int, rules: dict | None = None, user=None
) -> Alias:
    """Send `percent` of the alias's new runs to `version`; the rest keep the alias's version."""
    errors = canary_rules_errors(rules or {})
    if not 1 <= percent <= 100:
        errors["percent"] = ["from 1 to 100"]
    if errors:
        raise DomainError("the canary is invalid", fields=errors)
    target = _version(tenant, agent, version)
    found = _alias(tenant, agent, alias)
    if found.version_id == target.pk:
        raise DomainError("the canary is the alias's own version", fields={"version": ["another version"]})
    with transaction.atomic():
        Alias.objects.filter(pk=found.pk).update(
            canary_version=target,
            canary_percent=percent,
            canary_since=timezone.now(),
            canary_rules=rules or {},
            updated_at=timezone.now(),
        )
        AliasChange.objects.create(
            alias=found,
            kind=AliasChange.Kind.CANARY_STARTED,
            version=found.version.number,
            canary_version=version,
            canary_percent=percent,
            actor=user,
        )
    return Alias.objects.select_related("version", "canary_version").get(pk=found.pk)


def promote_canary(*, tenant, agent: str, alias: str, user=None, reason: str = "") -> Alias:
    """The canary becomes the alias's version, for every new run."""
    found = _alias(tenant, agent, alias)
    if found.canary_version_id is None:
        raise Conflict(f"{agent}@{alias} has no canary", code="no_canary")
    with transaction.atomic():
        promoted = Alias.objects.filter(pk=found.pk, canary_version_id=found.canary_version_id).update(
            version_id=found.canary_version_id,
            canary_version=None,
            canary_percent=0,
            canary_since=None,
            updated_at=timezone.now(),
        )
        if not promoted:
            raise Conflict("the canary changed meanwhile", code="canary_changed")
        number = AgentVersion.objects.get(pk=found.canary_version_id).number
        AliasChange.objects.create(
            alias=found,
            kind=AliasChange.Kind.PROMOTED,
            version=number,
            canary_version=number,
            actor=user,
            reason=reason,
        )
    return Alias.objects.select_related("version").get(pk=found.pk)


def roll_back_canary(
    alias_id: int, *, canary_version_id: int, user=None, reason: str = "", automatic: bool = False, data=None
) -> AliasChange | None:
    """End the canary: every new run takes the alias's version again. One guarded update: a person
    and the watcher rolling back together roll back once (None for the one that lost)."""
    with transaction.atomic():
        found = Alias.objects.filter(pk=alias_id, canary_version_id=canary_version_id)
        stable = found.values_list("version__number", flat=True).first()
        if not found.update(
            canary_version=None, canary_percent=0, canary_since=None, updated_at=timezone.now()
        ):
            return None
        return AliasChange.objects.create(
            alias_id=alias_id,
            kind=AliasChange.Kind.ROLLED_BACK,
            version=stable,
            canary_version=AgentVersion.objects.get(pk=canary_version_id).number,
            actor=user,
            automatic=automatic,
            reason=reason,
            data=data or {},
        )


def roll_back(*, tenant, agent: str, alias: str, user=None, reason: str = "") -> Alias:
    found = _alias(tenant, agent, alias)
    if found.canary_version_id is None or not roll_back_canary(
        found.pk, canary_version_id=found.canary_version_id, user=user, reason=reason
    ):
        raise Conflict(f"{agent}@{alias} has no canary", code="no_canary")
    return Alias.objects.select_related("version").get(pk=found.pk)


def gate_errors(gate) -> dict[str, list[str]]:
    if not isinstance(gate, dict):
        return {"gate": ["a mapping"]}
    if not gate:
        return {}
    errors: dict[str, list[str]] = {}
    for key in sorted(set(gate) - {"dataset", "min_pass_rate", "min_tag_pass_rate"}):
        errors[key] = ["unknown field"]
    if not isinstance(gate.get("dataset"), str) or not gate["dataset"]:
        errors["dataset"] = ["the dataset whose evaluation the alias needs"]
    rate = gate.get("min_pass_rate", 1.0)
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1:
        errors["min_pass_rate"] = ["a share from 0 to 1"]
    tags = gate.get("min_tag_pass_rate", {})
    if not isinstance(tags, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= 1 for v in tags.values()
    ):
        errors["min_tag_pass_rate"] = ["a share from 0 to 1 per tag"]
    return errors


def set_gate(*, tenant, agent: str, alias: str, gate: dict, user=None) -> Alias:
    """Require a passing evaluation for the alias's moves from now on ({} lifts the gate)."""
    errors = gate_errors(gate)
    if errors:
        raise DomainError("the gate is invalid", fields=errors)
    found = _alias(tenant, agent, alias)
    Alias.objects.filter(pk=found.pk).update(gate=gate, updated_at=timezone.now())
    return Alias.objects.select_related("version", "canary_version").get(pk=found.pk)
