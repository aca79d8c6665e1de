"""Starting a run (admission, quotas, idempotency, limits) and cancelling one: the writes the API
and the admin make on runs (runs/transitions.py does the moves)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from agents.selectors import may_run_agent, resolve_arm
from agents.spec import DEFAULT_LIMITS, LIMIT_CAPS, spec_for
from approvals import calls, cedar
from approvals.models import TenantPolicies
from artifacts import services as artifacts
from budgets.services import create_run_account
from core import chain
from core.digests import digest
from core.errors import Conflict, DomainError, Forbidden
from regions.models import TenantRegions, here
from runs import admission
from runs.authority_copy import home_start_answer, stale_authority
from runs.controls import audit, kill_switches
from runs.engine.decisions import start_here
from runs.models import (
    TERMINAL,
    Run,
    RunReplay,
    RunStatus,
    Step,
    StepKind,
    StepStatus,
)
from runs.queueing import enqueue
from runs.transitions import (
    atomic_with_events,
    end_run,
    lock_run,
    record_event,
    transition_run,
    transition_step,
)
from vault import keyed_search


def effective_limits(spec_limits: dict, tenant) -> dict:
    """The version's limits, filled with defaults and capped by the tenant: never unbounded."""
    limits = {}
    for name, default in DEFAULT_LIMITS.items():
        cap = getattr(tenant, LIMIT_CAPS[name])
        limits[name] = min(int(spec_limits.get(name, min(default, cap))), cap)
    return limits


@dataclass(frozen=True)
class Replay:
    """An evaluation's run (evals/, docs/evaluations.md): its tools answered from `recordings`, a call
    they do not cover answered as `uncovered` says, its calls reserved on the evaluation's budget
    account. Such a run is admitted at once and counts toward no quota: it is not the tenant's work."""

    recordings: list
    uncovered: str
    budget_account_id: int


def _marks(*, evaluation: bool, arm: str) -> dict[str, Any]:
    """What the created event says of an evaluation's run, and of the canary arm a run took."""
    return {**({"evaluation": True} if evaluation else {}), **({"arm": arm} if arm else {})}


def _check_quotas(*, tenant, user, now: dt.datetime) -> None:
    active = Run.objects.filter(tenant=tenant, evaluation=False).exclude(status__in=TERMINAL).count()
    if active >= tenant.max_active_runs:
        raise DomainError(
            f"tenant has {active} active runs (quota {tenant.max_active_runs})",
            code="active_run_quota_exceeded",
            status=429,
            retry_after=30,
        )
    recent = Run.objects.filter(
        created_by=user, evaluation=False, created_at__gte=now - dt.timedelta(minutes=1)
    ).count()
    if recent >= tenant.max_starts_per_minute:
        raise DomainError(
            f"{recent} runs started in the last minute (limit {tenant.max_starts_per_minute})",
            code="start_rate_exceeded",
            status=429,
            retry_after=60,
        )


def start_run(
    *,
    user,
    agent: str,
    alias: str | None = None,
    version: int | None = None,
    input,
    metadata: dict | None = None,
    idempotency_key: str | None = None,
    wait: bool = True,
    files: list[artifacts.Given] | None = None,
    replay: Replay | None = None,
) -> tuple[Run, bool]:
    """Start a run as `user`. Returns (run, created); replays the same run for a repeated key.

    The run is admitted (queued) if the tenant's day can carry its expected cost on top of what
    admitted runs are still expected to spend, or if nothing of the tenant runs and budget remains
    (runs/admission.py); otherwise it waits in `waiting_budget`, or with wait=False the call
    answers 429 with Retry-After. A run expected to cost more than a whole day is refused (422).
    `files` are stored with the run in its creating transaction (all of them or, on a refusal,
    neither they nor the run); the model's first message describes them. `replay`: an evaluation's
    run (Replay), checked like any run (grants, policies, kill switches) but never queued for budget.
    """
    tenant = user.tenant
    if tenant is None:
        raise DomainError("user belongs to no tenant", code="no_tenant", status=403)
    stale = _refuse_other_region(tenant)
    metadata = metadata or {}
    files = files or []
    hashed: dict = {"agent": agent, "alias": alias, "version": version, "input": input, "metadata": metadata}
    if files:
        hashed["files"] = [[f.name, f.media_type, f.sha256] for f in files]
    request_hash = digest(hashed)
    if idempotency_key:
        existing = Run.objects.filter(tenant=tenant, created_by=user, idempotency_key=idempotency_key).first()
        if existing is not None:
            if existing.request_hash != request_hash:
                raise DomainError(
                    "this Idempotency-Key was used with a different request body",
                    code="idempotency_key_reused",
                    status=422,
                )
            return existing, False
    pinned, arm = resolve_arm(tenant=tenant, agent=agent, alias=alias, version=version)
    if stale is not None:
        _start_on_the_homes_answer(tenant, user, pinned.agent_id, *stale)
    if not may_run_agent(user, pinned.agent_id):
        if stale is not None:  # the home said it is held: its grant has not reached the copy yet
            raise DomainError(
                f"{stale[1]}; run_agent is held at the home region but not yet in this region's copy",
                code="authority_stale",
                status=503,
                retry_after=5,
            )
        raise Forbidden(
            f"you may not start runs of {agent}: run_agent is not granted to you", code="not_permitted"
        )
    kill_switches.refuse_start(tenant, pinned.agent_id)
    refused = cedar.evaluate_start(
        tenant_id=tenant.pk,
        user=user,
        groups=lambda: calls.groups_of(user),
        agent_name=pinned.agent.name,
        version_number=pinned.number,
        input=input,
        metadata=metadata,
    )
    if refused is not None:
        raise Forbidden(f"you may not start this run: {refused}", code="policy_denied")
    artifacts.check_given(tenant, files)
    # Before the transaction: the tenant's word key may come from the key store.
    search_words = keyed_search.document(tenant.pk, input, metadata)
    now = timezone.now()
    limits = effective_limits(dict(spec_for(pinned).limits), tenant)
    expected, source = admission.expectation(version=pinned, limits=limits, tenant=tenant)
    if replay is not None:
        expected = 0  # spends the evaluation's budget, not the day's: takes no room from admitted runs
    if expected > tenant.daily_budget_micros:
        # Room could never be found for it: refuse now rather than leave it waiting forever.
        raise DomainError(
            f"a run of {pinned} is expected to cost {expected} micros ({source}), more than the "
            f"tenant's whole daily budget of {tenant.daily_budget_micros} micros: lower the version's "
            "expected_cost_micros or limits.max_cost_micros, or raise the daily budget",
            code="expected_cost_exceeds_daily_budget",
            status=422,
        )
    try:
        with atomic_with_events():
            # Admissions of one tenant queue on its row, so two starts cannot both pass a quota only
            # one of them fits. NO KEY: inserts that merely reference the tenant are not blocked.
            type(tenant).objects.select_for_update(no_key=True).filter(pk=tenant.pk).exists()
            if replay is None:
                _check_quotas(tenant=tenant, user=user, now=now)
                admitted, retry_after = admission.decide(tenant=tenant, expected=expected)
            else:
                admitted, retry_after = True, None
            if not admitted and not wait:
                raise DomainError(
                    f"the tenant's budget for today cannot carry another run now ({expected} micros "
                    "expected)",
                    code="tenant_budget_exhausted",
                    status=429,
                    retry_after=retry_after,
                )
            run = Run.objects.create(
                tenant=tenant,
                created_by=user,
                agent=pinned.agent,
                version=pinned,
                input=input,
                metadata=metadata,
                search_words=search_words,
                limits=limits,
                idempotency_key=idempotency_key or None,
                request_hash=request_hash,
                expected_cost_micros=expected,
                admitted_at=now if admitted else None,
                deadline_at=now + dt.timedelta(seconds=limits["max_wall_seconds"]) if admitted else None,
                evaluation=replay is not None,
                arm=arm,
            )
            create_run_account(run=run, limit_micros=limits["max_cost_micros"])
            if replay is not None:
                RunReplay.objects.create(
                    run=run,
                    recordings=replay.recordings,
                    uncovered=replay.uncovered,
                    budget_account_id=replay.budget_account_id,
                )
            stored = artifacts.store_given(run=run, files=files)
            given_files: dict[str, Any] = {}
            if files:
                given_files["files"] = [
                    {"artifact_id": str(a.pk), "name": a.name, "size": a.size}
                    | ({"copied_from": str(f.copied_from)} if f.copied_from else {})
                    for a, f in zip(stored, files, strict=True)
                ]
            record_event(
                run.pk,
                "created",
                f"run created by {user.username} on {pinned}",
                actor=user,
                agent=pinned.agent.name,
                version=pinned.number,
                alias=alias or "",
                **_marks(evaluation=replay is not None, arm=arm),
                limits=limits,
                expected_cost_micros=expected,
                **given_files,
                # Binds the input into the run's chain (core/chain.py).
                content=chain.content_of({"input": run.input, "metadata": run.metadata}, chain.RUN_CONTENT),
            )
            if admitted:
                enqueue(run.pk)
            else:
                # A row, not a task: the sweeper admits it in order of arrival (admission.admit_waiting).
                transition_run(
                    run,
                    RunStatus.WAITING_BUDGET,
                    message=f"waiting for budget: {expected} micros "
                    "expected, more than today's budget can carry on top of the runs already admitted",
                    event_data={"expected_cost_micros": expected, "admission": True},
                )
    except IntegrityError:
        raise Conflict(
            "a request with this Idempotency-Key is in progress", code="idempotency_key_in_flight"
        ) from None
    return run, True


def _refuse_other_region(tenant) -> tuple[str, str] | None:
    """A run lives entirely in the region where it starts: only in the tenant's allowed regions.
    Returns the home and why this region's copy of its authority is too old to act on, or None
    (read first: the grants checked after it are then at least that fresh)."""
    if not here():  # a deployment without regions
        return None
    config = TenantRegions.of(tenant)
    if config is None:
        return None
    refused = start_here(here=here(), home=config.home, allowed=tuple(config.allowed))
    if refused is not None:
        raise DomainError(
            refused, code="region_not_allowed", status=421, fields={"regions": list(config.allowed)}
        )
    stale = stale_authority(tenant.pk)
    return None if stale is None else (config.home, stale)


def _start_on_the_homes_answer(tenant, user, agent_id: int, home: str, stale: str) -> None:
    """Away from home on a copy older than the reach, as for a tool call: the home is asked now
    whether the user may start a run of the agent (active, run_agent, no tenant or agent switch),
    and its answer is as fresh as a copy that age. Refused as the home says; 503 with Retry-After
    when the home cannot be asked or its policies are not yet in the copy (the caller retries)."""
    answer = home_start_answer(tenant, home, user_id=user.pk, agent_id=agent_id)
    if answer is None:
        raise DomainError(
            f"{stale}; the home region could not be asked", code="authority_stale", status=503, retry_after=5
        )
    if not answer["may_run"]:
        raise Forbidden(
            "you may not start runs of this agent: at the home region run_agent is not held by you"
            + ("" if answer.get("active") else " (your account is inactive there)"),
            code="not_permitted",
        )
    if answer.get("switch"):
        raise DomainError(
            f"no new runs: a kill switch is on at the home region: {answer['switch']}",
            code="kill_switch_on",
            status=423,
        )
    here_version = TenantPolicies.objects.filter(tenant=tenant).values_list("version", flat=True).first()
    if answer.get("policy_version") != here_version:
        raise DomainError(
            f"{stale}; the tenant's policies changed at the home region and are not yet in this "
            "region's copy",
            code="authority_stale",
            status=503,
            retry_after=5,
        )


def cancel_run(*, run_id, actor, reason: str = "", bulk: int | None = None) -> Run:
    """Cancel now if no worker holds the run; otherwise the holder cancels when it records.

    Either way no model or tool call starts after this commits: dispatch re-checks the flag
    under the same row lock. `bulk`: the BulkAction this cancel is part of (its event says so).
    """
    with transaction.atomic():
        run = lock_run(run_id)
        if run.status == RunStatus.CANCELLED:
            return run
        if run.is_terminal:
            raise Conflict(f"run is already {run.status}", code="run_finished")
        Run.objects.filter(pk=run.pk).update(cancel_requested=True)
        run.cancel_requested = True
        extra = {"bulk_action": bulk} if bulk is not None else {}
        record_event(run.pk, "cancel_requested", reason or "cancel requested", actor=actor, **extra)
        audit.logged(actor, run, "Cancelled" + (f": {reason}" if reason else ""))
        leased = (
            run.lease_token is not None
            and run.lease_expires_at is not None
            and run.lease_expires_at > timezone.now()
        )
        if leased:
            return run
        # A tool call sent earlier whose answer never came (or waits out its settle window) may
        # still take effect: cancelling must not forget it. A person resolves it first; the run
        # then ends as cancelled at its next claim.
        inflight = Step.objects.filter(run=run, kind=StepKind.TOOL, status=StepStatus.DISPATCHING).first()
        if inflight is None:
            end_run(run, RunStatus.CANCELLED, actor=actor, message="cancelled")
        else:
            message = (
                f"step {inflight.seq} {inflight.tool_name}: outcome unknown and run cancelled; "
                "resolve it, then the run ends as cancelled"
            )
            transition_step(
                inflight,
                StepStatus.OUTCOME_UNKNOWN,
                message=message,
                error=message,
                next_attempt_at=None,
                finished_at=timezone.now(),
                actor=actor,
            )
            transition_run(run, RunStatus.NEEDS_ATTENTION, actor=actor, message="needs attention: " + message)
    return run
