"""Watching canaries (docs/evaluations.md#canary): the canary arm of an alias against its stable
arm, over a window, rolled back by the platform past the alias's thresholds.

    verdict(stable, canary, rules)   why to roll back, or None (pure: tested from tables)
    watch()                          every alias with a canary, compared and rolled back if due

A run's arm is fixed when it starts (runs.Run.arm), so the arms are the runs each version
served. Only runs that started since the canary did, within the window, and have come to an end
or to a person (needs_attention) count. The rollback is one guarded update
(agents.services.roll_back_canary): a person promoting or rolling back at the same moment wins or
loses cleanly; it writes an AliasChange row, a warning log line and a metric.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import asdict, dataclass

from django.db.models import Exists, OuterRef, Q, Sum
from django.utils import timezone

from agents import services as agents
from agents.models import Alias
from observability import metrics
from runs.models import TERMINAL, Run, RunStatus, Step, StepStatus

log = logging.getLogger("agentplatform.canary")


@dataclass(frozen=True)
class ArmStats:
    runs: int = 0
    failed: int = 0  # failed or stopped
    attention: int = 0  # needs_attention
    denied: int = 0  # had a call denied
    cost_micros: int = 0

    def rate(self, count: int) -> float:
        return count / self.runs if self.runs else 0.0


def verdict(stable: ArmStats, canary: ArmStats, rules: dict) -> str | None:
    """Why the canary does worse than the stable arm past a threshold; None while it does not, or
    while it has served fewer than min_runs."""
    rules = {**agents.CANARY_RULES, **rules}
    if canary.runs < rules["min_runs"]:
        return None
    for name, what, count in (
        ("max_failure_rate_increase", "failure rate", lambda a: a.failed),
        ("max_attention_rate_increase", "needs_attention rate", lambda a: a.attention),
        ("max_denial_rate_increase", "policy denial rate", lambda a: a.denied),
    ):
        worse = canary.rate(count(canary)) - stable.rate(count(stable))
        if worse > rules[name]:
            return (
                f"{what} {canary.rate(count(canary)):.0%} on the canary against "
                f"{stable.rate(count(stable)):.0%} on the stable version (at most {rules[name]:.0%} more)"
            )
    if stable.runs and stable.cost_micros:
        ratio = (canary.cost_micros / canary.runs) / (stable.cost_micros / stable.runs)
        if ratio > rules["max_cost_ratio"]:
            return f"cost per run {ratio:.1f}x the stable version's (at most {rules['max_cost_ratio']}x)"
    return None


def arm_stats(alias: Alias, arm: str, *, now: dt.datetime) -> ArmStats:
    rules = {**agents.CANARY_RULES, **alias.canary_rules}
    since = max(alias.canary_since or now, now - dt.timedelta(seconds=rules["window_seconds"]))
    runs = Run.objects.filter(
        agent_id=alias.agent_id, arm=arm, evaluation=False, created_at__gte=since
    ).filter(Q(status__in=TERMINAL) | Q(status=RunStatus.NEEDS_ATTENTION))
    if arm == "stable":
        runs = runs.filter(version_id=alias.version_id)
    else:
        runs = runs.filter(version_id=alias.canary_version_id)
    totals = runs.aggregate(spent=Sum("budget__spent_micros"))
    return ArmStats(
        runs=runs.count(),
        failed=runs.filter(status__in=[RunStatus.FAILED, RunStatus.STOPPED]).count(),
        attention=runs.filter(status=RunStatus.NEEDS_ATTENTION).count(),
        denied=runs.filter(
            Exists(Step.objects.filter(run_id=OuterRef("pk"), status=StepStatus.DENIED))
        ).count(),
        cost_micros=totals["spent"] or 0,
    )


def watch(*, now: dt.datetime | None = None) -> list[str]:
    """Compare every canary with its stable arm; roll back those past their thresholds. Returns
    what was rolled back ("agent@alias: reason")."""
    now = now or timezone.now()
    rolled = []
    for alias in Alias.objects.filter(canary_version__isnull=False).select_related(
        "agent__tenant", "canary_version"
    ):
        stable, canary = arm_stats(alias, "stable", now=now), arm_stats(alias, "canary", now=now)
        why = verdict(stable, canary, alias.canary_rules)
        if why is None or alias.canary_version is None:
            continue
        change = agents.roll_back_canary(
            alias.pk,
            canary_version_id=alias.canary_version.pk,
            reason=why,
            automatic=True,
            data={"stable": asdict(stable), "canary": asdict(canary)},
        )
        if change is None:
            continue
        metrics.CANARY_ROLLBACKS.labels(alias.agent.tenant.slug, alias.agent.name, alias.name).inc()
        log.warning(
            "canary rolled back: %s@%s v%s: %s",
            alias.agent.name,
            alias.name,
            alias.canary_version.number,
            why,
            extra={"tenant": alias.agent.tenant.slug},
        )
        rolled.append(f"{alias.agent.name}@{alias.name}: {why}")
    return rolled
