"""Gates on alias moves (docs/evaluations.md#gates): a gated alias moves to a version, starts a
canary of it, or promotes it, only with a passing evaluation of that version.

    require_passing(tenant, agent, alias, version)   raise Conflict naming what fell short

"Passing": the newest finished evaluation of that version on the gate's dataset at its latest
version has at least the gate's pass rate overall and per tag. The surfaces that move aliases (the
API and the admin) ask here first; the configuration file, which owns the alias outright, does not.
"""

from __future__ import annotations

from agents.models import Alias
from core.errors import Conflict
from evals.models import DatasetVersion, Evaluation


def require_passing(*, tenant, agent: str, alias: str, version: int) -> None:
    found = Alias.objects.filter(agent__tenant=tenant, agent__name=agent, name=alias).first()
    if found is None or not found.gate:
        return
    gate = found.gate
    latest = (
        DatasetVersion.objects.filter(dataset__tenant=tenant, dataset__name=gate["dataset"])
        .order_by("-number")
        .first()
    )
    if latest is None:
        raise Conflict(
            f"{agent}@{alias} needs an evaluation on dataset {gate['dataset']}, which has no cases",
            code="gate_not_passed",
        )
    evaluation = (
        Evaluation.objects.filter(
            tenant=tenant,
            agent_version__agent__name=agent,
            agent_version__number=version,
            dataset_version=latest,
            status=Evaluation.Status.FINISHED,
        )
        .order_by("-finished_at")
        .first()
    )
    if evaluation is None:
        raise Conflict(
            f"{agent}@{alias} needs a finished evaluation of v{version} on {latest}: none yet",
            code="gate_not_passed",
        )
    short = []
    rate = evaluation.totals.get("pass_rate", 0.0)
    if rate < gate.get("min_pass_rate", 1.0):
        short.append(f"pass rate {rate:.0%} below {gate.get('min_pass_rate', 1.0):.0%}")
    by_tag = evaluation.totals.get("by_tag", {})
    for tag, needed in sorted(gate.get("min_tag_pass_rate", {}).items()):
        got = by_tag.get(tag)
        if got is None or got < needed:
            short.append(f"{tag} cases {'none' if got is None else f'{got:.0%}'} below {needed:.0%}")
    if short:
        raise Conflict(
            f"{agent}@{alias}: evaluation {str(evaluation.pk)[:8]} of v{version} does not pass the gate: "
            + "; ".join(short),
            code="gate_not_passed",
        )
