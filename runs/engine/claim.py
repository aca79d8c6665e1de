"""Claim: take the run's lease, decide its next step and commit the intent (runs/engine/__init__.py).

It reads as: read, decide, apply, act.

    read     the run row, locked once with its tenant, version, user and endpoint; the step
             window (runs/statements.step_window: the open steps and the log's tail, a handful of
             rows at any length of run); the tool of a step in flight
    decide   runs/engine/decisions.py: what the run does next, as one frozen decision
    apply    runs/engine/writer.py for what needs no network (stops, parks, denials, replays,
             platform tools, scheduled retries); a model or tool call is reserved and committed
             as `dispatching` (runs/engine/dispatch.reserve_and_mark) and handed on as a
             frozen plan (runs/engine/types.py)
    act      the caller (runs.engine.advance) makes the call, outside any transaction

Everything here runs in the claim's one short transaction and needs no network, but for the
model call's one round trip to the endpoint's shared quota in Redis (runs/engine/model_step.quota_wait),
asked before anything is reserved so that a call told to wait leaves nothing to undo.
"""

from __future__ import annotations

import datetime as dt
import random
import uuid

from django.conf import settings
from django.utils import timezone

from approvals import services as approvals
from approvals.models import TenantPolicies
from connections.selectors import state_for
from llm import breaker, fallback
from llm import gateway as model_gateway
from observability import observe
from regions.models import HomeAnswer
from runs import statements
from runs.approval_effects import request_approval
from runs.authority_copy import home_answer, pause_for_stale_authority, stale_authority
from runs.controls import kill_switches
from runs.engine import (
    compacted,
    conversation,
    decisions,
    loops,
    model_step,
    platform_tools,
    summaries,
    writer,
)
from runs.engine.dispatch import let_go, reserve_and_mark
from runs.engine.types import Intent, Lease, LostModelCall, ModelPlan, Plan, ToolCall, ToolPlan, tool_of
from runs.models import ClaimReads, Run, RunStatus, Step, StepKind, StepStatus
from runs.policy_events import record_shadow
from runs.queueing import continue_run, lease_seconds_for
from runs.transitions import atomic_with_events, lock_run, transition_run, transition_step, write_run_at_end
from tools import checks, offer
from tools.models import IN_PROGRESS_PATIENCE, MIN_IN_PROGRESS_PATIENCE, Tool, ToolServer

MAX_MODEL_FAILURES = decisions.MAX_MODEL_FAILURES
PLATFORM_TOOLS = frozenset(offer.PLATFORM_TOOLS)
MODEL_FINISHED = (StepStatus.SUCCEEDED, StepStatus.FAILED, StepStatus.OUTCOME_UNKNOWN)


def claim(run_id, enqueued_at: dt.datetime | None = None) -> Plan | None:
    """The step's first transaction. A Plan for a call committed as `dispatching` (or a lookup or
    a lost model call to settle first); None when there is nothing to call now."""
    with atomic_with_events():
        try:
            # With the user who started it and the model endpoint: read fresh, in this one statement.
            run = lock_run(run_id, for_step=True)
        except Run.DoesNotExist:
            return None
        observe.bind(tenant=run.tenant.slug, evaluation=run.evaluation)
        if (
            enqueued_at is not None
            and run.last_enqueued_at is not None
            and enqueued_at < run.last_enqueued_at
        ):
            return None  # superseded: a newer message for this run is on its way
        now = timezone.now()
        upto = conversation.kept_upto(run.pk)
        window = statements.step_window(run, after=upto)
        log = [view_of_step(s) for s in window]
        inflight = decisions.in_flight(log)
        inflight_step = next((s for s in window if inflight and s.seq == inflight.seq), None)
        tool = _tool_of(inflight_step) if inflight_step is not None and inflight_step.tool_id else None
        decision = decisions.next_move(
            view_of(run),
            log,
            now,
            platform_tools=PLATFORM_TOOLS,
            max_crashes=settings.MAX_STEP_CRASHES,
            tool=tool,
            jitter=random.uniform(0.5, 1.0),
        )
        if isinstance(decision, decisions.Quiet):
            return None
        if run.lease_token is not None:  # expired, or the decision would have been Quiet
            writer.take_over(run)
        if run.status == RunStatus.QUEUED and not isinstance(decision, (decisions.Cancel, decisions.Stop)):
            transition_run(run, RunStatus.RUNNING, started_at=now)
        if inflight_step is not None and inflight_step.next_attempt_at is None:
            writer.count_crash(run, inflight_step)  # found dispatching, nothing scheduled: worker lost
        planned = _apply(run, decision, window, inflight_step, now, upto)
        if planned is None:
            return None
        if isinstance(planned, (LostModelCall, ToolCall)):
            # Nothing is sent before the lost call is settled or the provider asked: lease only.
            lease = planned.lease
            write_run_at_end(
                run, lease_token=lease.token, lease_expires_at=now + dt.timedelta(seconds=lease.seconds)
            )
            return planned
        plan = reserve_and_mark(run, planned)
        if plan is None:
            return None
    let_go(plan)
    return plan


def view_of(run: Run) -> decisions.RunView:
    return decisions.RunView(
        status=run.status,
        cancel_requested=run.cancel_requested,
        pause_requested=run.pause_requested,
        deadline_at=run.deadline_at,
        leased=run.lease_token is not None,
        lease_expires_at=run.lease_expires_at,
        last_enqueued_at=run.last_enqueued_at,
        step_count=run.step_count,
        tool_call_count=run.tool_call_count,
        max_steps=run.limits["max_steps"],
        max_tool_calls=run.limits["max_tool_calls"],
        engine_errors=run.engine_errors,
    )


def view_of_step(step: Step) -> decisions.StepView:
    result = step.result if isinstance(step.result, dict) else {}
    return decisions.StepView(
        seq=step.seq,
        kind=step.kind,
        status=step.status,
        tool_name=step.tool_name,
        tool_id=step.tool_id,
        args_digest=step.args_digest,
        attempts=step.attempts,
        crashes=step.crashes,
        next_attempt_at=step.next_attempt_at,
        dispatched_at=step.dispatched_at,
        has_tool_calls=bool(result.get("tool_calls")),
        output_refused=bool(result.get("output_errors")),
        error=step.error if step.kind == "model" else "",
        endpoint_id=step.model_endpoint_id,
        error_class=step.error_class,
    )


def tool_view(tool: Tool) -> decisions.ToolView:
    return decisions.ToolView(
        effect=tool.effect_class,
        max_attempts=tool.max_attempts,
        timeout_seconds=tool.timeout_seconds,
        settle_seconds=tool.settle_window,
        backoff_seconds=tool.backoff_seconds,
        patience_seconds=max(tool.settle_window * IN_PROGRESS_PATIENCE, MIN_IN_PROGRESS_PATIENCE),
    )


def _tool_of(step: Step) -> decisions.ToolView:
    # With its server: a retry is sent from this row, and the call itself holds no connection.
    if step.tool_id is None:
        raise TypeError(f"step {step.seq} has no tool")
    tool = Tool.objects.select_related("server", "server__delegation").get(pk=step.tool_id)
    step.tool = tool
    return tool_view(tool)


def _lease(run: Run, timeout: float) -> Lease:
    """A new lease token for a call of this timeout (taken when the claim commits its intent)."""
    return Lease(run.pk, uuid.uuid4(), lease_seconds_for(timeout))


def _apply(
    run: Run, decision, window: list[Step], inflight: Step | None, now: dt.datetime, upto: int | None
) -> Intent | ToolCall | LostModelCall | None:
    """Apply a decision of next_move: an Intent when a call is to be reserved and made; a plan
    that takes only the lease when a lost call is to be settled or its provider asked first."""
    match decision:
        case decisions.Cancel() | decisions.Stop() | decisions.FailRun() | decisions.Finish():
            writer.end(run, decision)
        case decisions.Park():
            writer.park(run, decision)
        case decisions.Pause():
            writer.pause(run)
        case decisions.WaitForRetry():
            continue_run(run, countdown=decision.countdown)
        case decisions.Poison():
            writer.poison(run, inflight, decision)
        case decisions.RecoverModel():
            assert inflight is not None
            writer.model_lost(run, inflight)
            return LostModelCall(_lease(run, 5), run, inflight.pk)
        case decisions.Retry():
            assert inflight is not None and inflight.tool is not None
            switch = kill_switches.killed(tool_id=inflight.tool_id, reads=run.claim_reads)
            if switch is not None:
                # Neither the retry nor a status lookup is sent to a killed tool: the step waits,
                # kept as a retry due now, for the switch to go off (or a person to resume).
                writer.keep_retry(inflight)
                kill_switches.pause_by(run, switch)
                return None
            writer.recovery_event(run, inflight, decision, effect=inflight.tool.effect_class)
            inflight.run = run
            call = ToolPlan(step=inflight)
            lease = _lease(run, inflight.tool.timeout_seconds)
            if decision.lookup_first:
                return ToolCall(lease, run, call, reconcile_first=True)
            return Intent(lease, tool=call)
        case decisions.WaitToSettle() | decisions.AskPerson() | decisions.GiveUp():
            assert inflight is not None
            writer.after_unknown(run, inflight, decision)
        case decisions.OpenToolCall():
            step = next(s for s in window if s.seq == decision.seq)
            if decision.platform:
                platform_tools.answer(run, step)
                return None
            # Away from home, a tool call (and the use of its approval) needs a copy of the
            # home's grants, policies and kill switches no older than the tenant's reach, or the
            # home's own answer for this call asked within the reach (the keeper asks it for the
            # runs paused here); the policies are then evaluated here, on the home's version.
            stale = stale_authority(run.tenant_id, reads=run.claim_reads)
            if stale is not None:
                answer = home_answer(run, step.seq)
                if answer is not None and answer.verdict == HomeAnswer.Verdict.DENY:
                    writer.deny(run, step, answer.reason)
                    return None
                if (
                    answer is None
                    or answer.verdict != HomeAnswer.Verdict.ACT
                    or answer.policy_version != _policy_version(run)
                ):
                    pause_for_stale_authority(run, stale if answer is None else f"{stale}; {answer.reason}")
                    return None
            switch = kill_switches.killed(tool_id=step.tool_id, reads=run.claim_reads)
            if switch is None:
                return _open_tool_call(run, step, window)
            # A killed tool is never called. A call never sent is answered as unavailable where
            # the tenant chose so; otherwise (and for a retry a person asked for) the run pauses.
            if step.status != StepStatus.RETRIED and kill_switches.answers_unavailable(run):
                writer.unavailable(run, step, kill_switches.describe(switch))
            else:
                kill_switches.pause_by(run, switch)
        case decisions.CallModel():
            switch = kill_switches.killed(endpoint_id=run.version.model_endpoint_id, reads=run.claim_reads)
            if switch is not None:
                kill_switches.pause_by(run, switch)
                return None
            return _plan_model(run, window, decision.seq, upto)
    return None


def _claim_reads(run: Run) -> ClaimReads:
    if run.claim_reads is None:
        raise TypeError("the run was not locked for a step (runs.transitions.lock_run)")
    return run.claim_reads


def _plan_model(run: Run, window: list[Step], seq: int, upto: int | None) -> Intent | None:
    chain = fallback.chain_of(run.version)
    history = model_history(window)
    choice = fallback.choose(chain, history)
    chosen = chain.endpoints[choice.index]
    stop = decisions.model_turn(
        view_of(run),
        [view_of_step(s) for s in window],
        user_active=run.created_by.is_active,
        # Starting a run needs run_agent, and so does every model turn: a revoked grant (direct
        # or through a group) stops the run here, before anything is reserved for the call.
        may_run_agent=_claim_reads(run).may_run_agent,
        username=run.created_by.username,
        endpoint_id=chosen.pk if chain.fallbacks and chosen is not None else None,
    )
    if stop is not None:
        writer.end(run, stop)
        return None
    route = fallback.route(
        chain, choice, previous=history[-1].endpoint_id if history else None, admit=breaker.admit
    )
    if isinstance(route, fallback.Wait):
        writer.wait_for_circuit(run, route)
        return None
    endpoint = route.endpoint
    if route.index:
        switch = kill_switches.killed(endpoint_id=endpoint.pk, reads=run.claim_reads)
        if switch is not None:
            kill_switches.pause_by(run, switch)  # the fallback is killed: paused like a killed primary
            return None
    if route.moved is not None:
        writer.model_moved(run, seq, route)
    permitted = offer.permitted_tools(run, user=run.created_by)  # the user row this claim read
    offered = offer.offered_tools(run, user=run.created_by, permitted=permitted)
    messages, results, summarised = conversation.conversation(run, window, upto)
    request, shaped = model_gateway.shaped_request(
        run,
        messages,
        results,
        offered,
        endpoint=endpoint,
        resume=conversation.plan_of(run.pk),
        summaries=summarised,
    )
    conversation.keep_plan(run.pk, shaped.plan)
    fold = shaped.new_fold
    if fold is not None and fold.at not in summarised:
        # The version's summariser, if any, summarises the fold first, on a step of its own; this
        # call is planned again on the next claim, at the same call point, with the summary.
        summary_call = summaries.plan(run, window, messages, fold, seq)
        if summary_call is not None:
            tokens = model_gateway.estimate_input_tokens(summary_call.request) + summaries.SUMMARY_TOKENS
            if model_step.quota_wait(run, summary_call.endpoint, seq, tokens=tokens) is None:
                return Intent(_lease(run, summary_call.endpoint.timeout_seconds), model=summary_call)
            # The summariser waits for its quota: the fold keeps its deterministic record.
    if endpoint.secret_id:
        endpoint.secret  # noqa: B018 -- read now: the call itself then needs no database connection
    input_tokens = model_gateway.estimate_input_tokens(request)
    # Providers count a request's tokens as its input and its output cap, as the reservation does.
    wait = model_step.quota_wait(run, endpoint, seq, tokens=input_tokens + request.max_output_tokens)
    if wait is not None:
        writer.wait_for_quota(run, wait)
        return None
    summary = model_gateway.request_summary(request, input_tokens=input_tokens)
    summary["endpoint"] = endpoint.name
    if shaped.new_fold is not None:
        compacted.record(run, seq, shaped.new_fold)
    return Intent(
        _lease(run, endpoint.timeout_seconds),
        model=ModelPlan(
            # At this endpoint's prices: a fallback that costs more reserves more, and a budget
            # that cannot carry it stops the run before anything is sent.
            request=request,
            estimate=model_gateway.estimate_cost_micros(endpoint, request, input_tokens=input_tokens),
            endpoint=endpoint,
            seq=seq,
            summary=summary,
            chain=chain,
            history=history,
            probe=route.probe,
            tools={tool.name: tool for tool in permitted},
        ),
    )


def _authorization(run: Run, step: Step) -> decisions.WaitForAuthorization | decisions.Refuse | None:
    tool = tool_of(step)
    if tool.server.kind != ToolServer.Kind.MCP:
        return None  # only MCP servers are connected per user
    state = state_for(run.created_by_id, tool.server)
    return decisions.authorization_turn(
        step.seq,
        decisions.ConnectionView(protected=state.protected, active=state.active, revoked_at=state.revoked_at),
        server=tool.server.name,
        run_created_at=run.created_at,
    )


def model_history(window: list[Step]) -> tuple[fallback.Attempt, ...]:
    """The run's finished model calls in the window (those since the last tool call, and the
    answer before it): where each went and how it failed, for llm/fallback.choose."""
    return tuple(
        fallback.Attempt(
            s.model_endpoint_id,
            "" if s.status == StepStatus.SUCCEEDED else (s.error_class or "failed"),
        )
        for s in window
        if s.kind == StepKind.MODEL and s.status in MODEL_FINISHED
    )


def _policy_version(run: Run) -> int | None:
    """The tenant's policy version this claim read with the run's lock (or now)."""
    if run.claim_reads is not None:
        return run.claim_reads.policy_version
    return TenantPolicies.objects.filter(tenant_id=run.tenant_id).values_list("version", flat=True).first()


def _open_tool_call(run: Run, step: Step, window: list[Step]) -> Intent | None:
    """A proposed, approved or retried call: the gateway's checks with fresh rows, then a denial,
    a replay, an approval request, a stop for the run's limits, or the dispatch."""
    # Fresh rows: the user and the run this claim read under the lock; the tool, its server and
    # the permission in one statement; the call's offer from the proposing model step (in the window).
    denial = checks.check_dispatch(run, step, user=run.created_by, steps=window)
    record_shadow(run, step)  # shadow-mode policy sets: on the timeline, never enforced
    if denial:
        writer.deny(run, step, denial)
        return None
    # Only a call the model proposed is answered from the record: an approved or retried one is a
    # person's decision to make this call, with its own idempotency key.
    prior_seq = loops.prior_success(run, step) if step.status == StepStatus.PROPOSED else None
    if prior_seq is not None:
        prior = (
            Step.objects.filter(run_id=run.pk, seq=prior_seq)
            .order_by()
            .only("seq", "result", "observation")
            .get()
        )
        writer.replay(run, step, prior)
        return None
    # The user's own authority at the server, after the grants (a second lock, never the first)
    # and before an approval is asked for: a person approves only a call that can be sent.
    authorization = _authorization(run, step)
    if isinstance(authorization, decisions.Refuse):
        writer.deny(run, step, authorization.reason)
        return None
    if isinstance(authorization, decisions.WaitForAuthorization):
        writer.wait_for_authorization(run, step, authorization)
        return None
    if step.status == StepStatus.PROPOSED:
        decision = approvals.decision_for(run, tool_of(step), step.arguments or {}, step=step)
        if decision.required:
            request_approval(run, step, decision)
            transition_step(
                step,
                StepStatus.AWAITING_APPROVAL,
                message=f"step {step.seq} {step.tool_name}: approval required ({decision.reason})",
            )
            transition_run(
                run, RunStatus.WAITING_APPROVAL, message=f"waiting for approval of {step.tool_name}"
            )
            return None
    elif step.status == StepStatus.APPROVED:
        problem = approvals.verify_for_dispatch(step)
        if problem:
            writer.deny(run, step, problem)
            return None
    stop = decisions.tool_turn(view_of(run))
    if stop is not None:
        writer.end(run, stop)
        return None
    call = ToolPlan(step=step, may_be_corrected=step.status != StepStatus.PROPOSED)
    return Intent(_lease(run, tool_of(step).timeout_seconds), tool=call)
