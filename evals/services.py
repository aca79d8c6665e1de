"""Datasets and evaluations (docs/evaluations.md, DESIGN.md section 13).

    save_dataset(tenant, dataset, cases)       store the next version of a dataset (the same cases
                                               as its latest: that version)
    add_run(tenant, dataset, run_id)           a finished run becomes a case of the next version: its
                                               input, user, recorded tool results and approvals
    start_evaluation(user, agent, version, dataset, against=...)
                                               an evaluation (two, compared, with `against`), queued
    execute(evaluation_id)                     run every case through the engine (evals/replay.py),
                                               judge the checks, store the results and the totals

Versions of a dataset are inserted, never updated, under the dataset's row lock (like agent
versions: agents/services.py). An evaluation moves queued -> running -> finished | failed, each
move one guarded UPDATE: two workers given the same evaluation run it once. A case's result is
unique per evaluation, and its run is started with an idempotency key of the evaluation and the
case: an evaluation resumed after its worker died picks up its cases' runs where they are.
"""

from __future__ import annotations

import logging
import re

from django.db import IntegrityError, transaction
from django.db.models import Max
from django.utils import timezone

from agents.selectors import resolve_version
from budgets import services as budgets
from core.digests import digest
from core.errors import Conflict, DomainError, NotFound
from core.ids import short
from evals import checks as check_rules
from evals import replay
from evals.models import Case, CaseResult, Dataset, DatasetVersion, Evaluation
from runs.models import TERMINAL, Run, StepKind
from tenants.models import User

log = logging.getLogger(__name__)

DECISIONS = ("approve", "deny", "expire")
NAME = re.compile(r"^[-a-zA-Z0-9_]{1,100}$")
DEFAULT_BUDGET_MICROS = 1_000_000  # USD 1.00 per evaluation unless one is given


# --- datasets --------------------------------------------------------------------------------


def case_errors(case, tenant, *, where: str = "") -> dict[str, list[str]]:
    """Field errors of one case as given (API or configuration file), keyed by path."""
    at = f"{where}." if where else ""
    if not isinstance(case, dict):
        return {where or "case": ["a mapping"]}
    errors: dict[str, list[str]] = {}
    unknown = set(case) - {"name", "input", "user", "recordings", "approvals", "approver", "checks", "tags"}
    for key in sorted(unknown):
        errors[f"{at}{key}"] = ["unknown field"]
    if not isinstance(case.get("name"), str) or not NAME.match(case["name"]):
        errors[f"{at}name"] = ["letters, digits, - and _ (at most 100)"]
    if "input" not in case:
        errors[f"{at}input"] = ["required"]
    for field in ("user", "approver"):
        name = case.get(field)
        if name is None and field == "approver":
            continue
        if not isinstance(name, str) or not User.objects.filter(tenant=tenant, username=name).exists():
            errors[f"{at}{field}"] = [f"no user {name!r} in this tenant"]
    recordings = case.get("recordings", [])
    if not isinstance(recordings, list):
        errors[f"{at}recordings"] = ["a list of recorded calls"]
    else:
        for i, recording in enumerate(recordings):
            problem = _recording_problem(recording)
            if problem:
                errors[f"{at}recordings.{i}"] = [problem]
    approvals = case.get("approvals", {})
    if not isinstance(approvals, dict) or not all(
        isinstance(k, str) and v in DECISIONS for k, v in approvals.items()
    ):
        errors[f"{at}approvals"] = ["a mapping of tool (or *) to approve, deny or expire"]
    tags = case.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        errors[f"{at}tags"] = ["a list of names"]
    for key, problems in check_rules.validate(case.get("checks", [])).items():
        errors[f"{at}{key}"] = problems
    return errors


def _recording_problem(recording) -> str:
    if not isinstance(recording, dict) or not isinstance(recording.get("tool"), str):
        return "a mapping with tool, arguments and result (or error)"
    if not isinstance(recording.get("arguments", {}), dict):
        return "arguments must be a mapping"
    if ("result" in recording) == ("error" in recording):
        return "exactly one of result or error"
    result = recording.get("result")
    if "result" in recording and not isinstance(result, dict | str):
        return "result: a text or {text, structured, is_error}"
    return ""


def _stored(case: dict) -> dict:
    """A case as it is hashed and stored: every field, defaults filled."""
    return {
        "name": case["name"],
        "input": case["input"],
        "user": case["user"],
        "recordings": case.get("recordings", []),
        "approvals": case.get("approvals", {}),
        "approver": case.get("approver"),
        "checks": case.get("checks", []),
        "tags": case.get("tags", []),
    }


def save_dataset(
    *, tenant, dataset: str, cases: list, description: str = "", user=None, source_runs: dict | None = None
) -> tuple[DatasetVersion, bool]:
    """Validate and store the next version of `dataset` with these cases; the latest version's
    cases again return that version (created False)."""
    if not isinstance(dataset, str) or not NAME.match(dataset):
        raise DomainError("the dataset name is invalid", fields={"name": ["letters, digits, - and _"]})
    if not isinstance(cases, list) or not cases:
        raise DomainError("a dataset needs cases", fields={"cases": ["at least one case"]})
    errors: dict[str, list[str]] = {}
    for i, case in enumerate(cases):
        errors.update(case_errors(case, tenant, where=f"cases.{i}"))
    names = [c.get("name") for c in cases if isinstance(c, dict)]
    for name in {n for n in names if names.count(n) > 1}:
        errors.setdefault(f"cases.{names.index(name)}.name", []).append(f"{name} is named twice")
    if errors:
        raise DomainError("the dataset is invalid", code="invalid_dataset", fields=errors)
    stored = [_stored(c) for c in cases]
    content_hash = digest(stored)
    source_runs = source_runs or {}
    with transaction.atomic():
        try:
            with transaction.atomic():
                found, _ = Dataset.objects.get_or_create(tenant=tenant, name=dataset)
        except IntegrityError:
            found = Dataset.objects.get(tenant=tenant, name=dataset)
        found = Dataset.objects.select_for_update().get(pk=found.pk)
        if description and description != found.description:
            Dataset.objects.filter(pk=found.pk).update(description=description)
        latest = found.versions.order_by("-number").first()
        if latest is not None and latest.content_hash == content_hash:
            return latest, False
        number = (found.versions.aggregate(n=Max("number"))["n"] or 0) + 1
        version = DatasetVersion.objects.create(
            dataset=found, number=number, content_hash=content_hash, created_by=user
        )
        users = {u.username: u for u in User.objects.filter(tenant=tenant)}
        Case.objects.bulk_create(
            Case(
                version=version,
                name=c["name"],
                input=c["input"],
                user=users[c["user"]],
                recordings=c["recordings"],
                approvals=c["approvals"],
                approver=users.get(c["approver"]) if c["approver"] else None,
                checks=c["checks"],
                tags=c["tags"],
                source_run_id=source_runs.get(c["name"]),
            )
            for c in stored
        )
    return version, True


def case_as_data(case: Case) -> dict:
    return {
        "name": case.name,
        "input": case.input,
        "user": case.user.username,
        "recordings": case.recordings,
        "approvals": case.approvals,
        "approver": case.approver.username if case.approver else None,
        "checks": case.checks,
        "tags": case.tags,
    }


def case_from_run(run: Run, *, name: str, checks: list | None = None) -> dict:
    """A finished run as a case: its input and user, each call it sent with the result it got
    (a recording), how its approvals were decided and by whom, and (unless given) checks that
    hold the run to what it did: its status, the calls it sent in order, the approvals it asked
    for and the calls the gateway denied."""
    recordings, approvals, approver = [], {}, None
    sent, asked, denied = [], [], []
    steps = run.steps.filter(kind=StepKind.TOOL).select_related("approval__decided_by").order_by("seq")
    for step in steps:
        approval = getattr(step, "approval", None)
        if approval is not None:
            asked.append(step.tool_name)
            decision = {"approved": "approve", "consumed": "approve", "denied": "deny", "expired": "expire"}
            if approval.status in decision:
                approvals[step.tool_name] = decision[approval.status]
                approver = approver or (approval.decided_by.username if approval.decided_by_id else None)
        if step.status == "denied":
            denied.append(step.tool_name)
        if step.dispatched_at is None:
            continue
        sent.append(step.tool_name)
        if step.result is not None:
            recordings.append(
                {"tool": step.tool_name, "arguments": step.arguments or {}, "result": step.result}
            )
        elif step.error:
            recordings.append(
                {"tool": step.tool_name, "arguments": step.arguments or {}, "error": step.error}
            )
    if checks is None:
        checks = [{"status": run.status}]
        checks += [{"order": sent}] if len(sent) > 1 else [{"called": t} for t in sent]
        checks += [{"approval_asked": t} for t in dict.fromkeys(asked)]
        checks += [{"policy_denied": t} for t in dict.fromkeys(denied)]
        checks += [{"never_called": t} for t in dict.fromkeys(denied) if t not in sent]
    case = {
        "name": name,
        "input": run.input,
        "user": run.created_by.username,
        "recordings": recordings,
        "approvals": approvals,
        "checks": checks,
    }
    if approver:
        case["approver"] = approver
    return case


def add_run(
    *, tenant, dataset: str, run_id, name: str = "", checks: list | None = None, user=None
) -> DatasetVersion:
    """Add a finished run to `dataset` as a case: the next version holds the latest's cases and it."""
    run = Run.objects.filter(pk=run_id, tenant=tenant).select_related("created_by").first()
    if run is None:
        raise NotFound("run")
    if run.status not in TERMINAL:
        raise Conflict(
            f"the run is {run.status}: only a finished run becomes a case", code="run_not_finished"
        )
    if run.evaluation:
        raise Conflict("an evaluation's run does not become a case", code="evaluation_run")
    name = name or f"run-{short(run.pk)}"
    found = Dataset.objects.filter(tenant=tenant, name=dataset).first()
    latest = found.versions.order_by("-number").first() if found else None
    cases = [case_as_data(c) for c in latest.cases.select_related("user", "approver")] if latest else []
    sources = {c.name: c.source_run_id for c in latest.cases.all()} if latest else {}
    if any(c["name"] == name for c in cases):
        raise DomainError(f"the dataset has a case {name}", fields={"name": [f"{name} is taken"]})
    cases.append(case_from_run(run, name=name, checks=checks))
    version, _ = save_dataset(
        tenant=tenant, dataset=dataset, cases=cases, user=user, source_runs={**sources, name: run.pk}
    )
    return version


def dataset_version(*, tenant, dataset: str, number: int | None = None) -> DatasetVersion:
    found = Dataset.objects.filter(tenant=tenant, name=dataset).first()
    if found is None:
        raise NotFound(f"dataset {dataset}")
    versions = found.versions.order_by("-number")
    version = versions.filter(number=number).first() if number else versions.first()
    if version is None:
        raise NotFound(f"version {number} of dataset {dataset}")
    return version


# --- evaluations -----------------------------------------------------------------------------


def start_evaluation(
    *,
    user,
    agent: str,
    version: int,
    dataset: str,
    dataset_number: int | None = None,
    against: int | None = None,
    budget_micros: int | None = None,
    uncovered: str = Evaluation.Uncovered.ERROR,
) -> Evaluation:
    """Queue an evaluation of `agent` v`version` on the dataset (its latest version unless
    numbered); with `against`, a second of that version on the same cases, compared with it.
    Each has its own budget account of `budget_micros`, apart from the tenant's day."""
    tenant = user.tenant
    if uncovered not in Evaluation.Uncovered.values:
        raise DomainError("uncovered is error or nearest", fields={"uncovered": ["error or nearest"]})
    budget = DEFAULT_BUDGET_MICROS if budget_micros is None else budget_micros
    if budget < 0:
        raise DomainError("the budget is negative", fields={"budget": ["at least 0"]})
    cases = dataset_version(tenant=tenant, dataset=dataset, number=dataset_number)
    pinned = resolve_version(tenant=tenant, agent=agent, version=version)
    other = resolve_version(tenant=tenant, agent=agent, version=against) if against else None
    with transaction.atomic():
        baseline = _new(tenant, other, cases, user, budget, uncovered) if other else None
        evaluation = _new(tenant, pinned, cases, user, budget, uncovered, against=baseline)
    return evaluation


def _new(tenant, version, cases, user, budget, uncovered, against=None) -> Evaluation:
    account = budgets.open_evaluation_account(tenant=tenant, limit_micros=budget)
    return Evaluation.objects.create(
        tenant=tenant,
        agent_version=version,
        dataset_version=cases,
        against=against,
        budget_micros=budget,
        budget_account=account,
        uncovered=uncovered,
        started_by=user,
    )


def _move(evaluation_id, to: str, **fields) -> bool:
    allowed_from = [s for s, targets in Evaluation.TRANSITIONS.items() if to in targets]
    return bool(
        Evaluation.objects.filter(pk=evaluation_id, status__in=allowed_from).update(status=to, **fields)
    )


def execute(evaluation_id) -> Evaluation | None:
    """Run the evaluation (and the one it is compared against first); None if another worker has it."""
    evaluation = Evaluation.objects.select_related("against").get(pk=evaluation_id)
    if evaluation.against is not None and evaluation.against.status == Evaluation.Status.QUEUED:
        execute(evaluation.against.pk)
    if not _move(evaluation.pk, Evaluation.Status.RUNNING):
        return None
    try:
        cases = list(evaluation.dataset_version.cases.select_related("user", "approver").order_by("id"))
        for case in cases:
            if not CaseResult.objects.filter(evaluation=evaluation, case=case).exists():
                replay.run_case(evaluation, case)
    except Exception as exc:
        log.exception("evaluation %s failed", evaluation.pk)
        _move(
            evaluation.pk,
            Evaluation.Status.FAILED,
            error=f"{type(exc).__name__}: {exc}",
            finished_at=timezone.now(),
        )
        raise
    _move(evaluation.pk, Evaluation.Status.FINISHED, totals=totals_of(evaluation), finished_at=timezone.now())
    return Evaluation.objects.get(pk=evaluation.pk)


def totals_of(evaluation: Evaluation) -> dict:
    """Pass rate over cases and over deterministic checks, the judges' apart; cost, steps and
    latency summed and averaged; per tag (safety) the pass rate of its cases."""
    results = list(evaluation.results.select_related("case"))
    checks = [c for r in results for c in r.checks if not c.get("graded")]
    graded = [c for r in results for c in r.checks if c.get("graded")]
    cases = len(results)
    passed = sum(r.passed for r in results)
    tags: dict[str, list[bool]] = {}
    for r in results:
        for tag in r.case.tags:
            tags.setdefault(tag, []).append(r.passed)
    return {
        "cases": cases,
        "cases_passed": passed,
        "pass_rate": round(passed / cases, 4) if cases else 0.0,
        "checks": len(checks),
        "checks_passed": sum(c["passed"] for c in checks),
        "graded_checks": len(graded),
        "graded_passed": sum(c["passed"] for c in graded),
        "cost_micros": sum(r.cost_micros for r in results),
        "steps": sum(r.steps for r in results),
        "mean_latency_ms": round(sum(r.latency_ms for r in results) / cases) if cases else 0,
        "uncovered_calls": sum(len(r.uncovered) for r in results),
        "by_tag": {t: round(sum(v) / len(v), 4) for t, v in sorted(tags.items())},
    }


def comparison(evaluation: Evaluation) -> dict:
    """The evaluation beside the one it is compared against: per case, per check, both verdicts."""
    other = evaluation.against
    mine = {r.case.name: r for r in evaluation.results.select_related("case", "run")}
    theirs = {r.case.name: r for r in other.results.select_related("case", "run")} if other else {}
    rows = []
    for case in evaluation.dataset_version.cases.order_by("id"):
        a, b = mine.get(case.name), theirs.get(case.name)
        names = [c["check"] for c in (a.checks if a else [])] or [c["check"] for c in (b.checks if b else [])]
        rows.append(
            {
                "case": case.name,
                "tags": case.tags,
                "passed": a.passed if a else None,
                "against_passed": b.passed if b else None,
                "run": str(a.run_id) if a and a.run_id else None,
                "against_run": str(b.run_id) if b and b.run_id else None,
                "checks": [
                    {
                        "check": name,
                        "passed": _verdict(a, name),
                        "against_passed": _verdict(b, name),
                    }
                    for name in names
                ],
            }
        )
    return {
        "version": evaluation.agent_version.number,
        "against_version": other.agent_version.number if other else None,
        "totals": evaluation.totals,
        "against_totals": other.totals if other else None,
        "cases": rows,
    }


def _verdict(result: CaseResult | None, name: str) -> bool | None:
    if result is None:
        return None
    return next((c["passed"] for c in result.checks if c["check"] == name), None)
