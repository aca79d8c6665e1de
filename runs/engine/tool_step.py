"""A tool step: call the tool, then settle and record in one transaction (runs/engine/__init__.py).

The claim has reserved the call's budget and committed the step as `dispatching`; a recovery
that asks the provider first (reconcile) reserves and marks after the lookup.
"""

from __future__ import annotations

import datetime as dt
import random

from django.db import close_old_connections, transaction
from django.db.models import F
from django.utils import timezone

from authority import credentials as authority
from authority.errors import AuthorityRefused, AuthorityUnavailable
from budgets import services as budgets
from connections import services as connections
from observability import observe
from runs.engine import decisions, heartbeat, writer
from runs.engine.claim import tool_view
from runs.engine.dispatch import (
    add_settle,
    close_tool_holds,
    mark_after_lookup,
    recorded_before,
    through_database_outage,
)
from runs.engine.types import ToolCall, ToolOutcome, fenced, tool_of
from runs.models import Run, RunReplay, Step, StepStatus
from runs.transitions import at_end, atomic_with_events, lock_run, record_event, transition_step, write_step
from tenants import secrets
from tools import replay, results, transports
from tools.types import ToolFailed, ToolInProgress, ToolNotSent, ToolOutcomeUnknown, ToolUnauthorized


def do_tool(plan: ToolCall) -> None:
    if plan.reconcile_first:
        step = plan.call.step
        found = _reconcile(plan, step)
        if found is not None:
            began = timezone.now()
            through_database_outage(
                lambda retry: _record_tool(plan, step, found, began, retry=retry), seconds=plan.lease_seconds
            )
            return
        resend = mark_after_lookup(plan)
        if resend is None:
            return
        plan = resend
    dispatched = plan.dispatched
    try:
        with observe.tool_call(dispatched) as call:
            outcome = _call_tool(dispatched, plan)
            call.ended(outcome.kind, price_micros=tool_of(dispatched).price_micros, error=outcome.error)
    finally:
        heartbeat.untrack(plan.run_id)
        close_old_connections()
    began = timezone.now()
    through_database_outage(
        lambda retry: _record_tool(plan, dispatched, outcome, began, retry=retry), seconds=plan.lease_seconds
    )


def _close_reservation(plan: ToolCall, step: Step, outcome: ToolOutcome):
    """Settle, hold or release this attempt's reservation (in the record's transaction, after the
    run lock). A no-op on a reservation already closed, so a retried record repeats it safely.
    Returns the run account's balances after a settle (for the budget event), else None."""
    if plan.reservation_id is None:  # the outcome came from a status lookup: nothing was reserved
        return None
    if outcome.kind == "unknown":
        budgets.hold(plan.reservation_id, note=f"tool outcome unknown: {outcome.error}")
    elif outcome.kind in ("failed", "in_progress", "denied", "not_sent", "unauthorized"):
        budgets.release(plan.reservation_id, note="this attempt provably took no effect")
    else:
        return budgets.settle_reporting(plan.reservation_id, actual_micros=charge(step, outcome))[1]
    return None


def charge(step: Step, outcome: ToolOutcome) -> int:
    """What a succeeded call is settled at: its measured cost where the tool reports one (run_python:
    CPU- and GiB-seconds), never more than what was reserved for it (the tool's price)."""
    if outcome.replayed:
        return 0
    price = tool_of(step).price_micros
    return min(results.actual_price(step, outcome.result), price)


def _replay(step: Step, plan: ToolCall) -> ToolOutcome:
    """An evaluation's call, answered from the run's recordings (tools/replay.py): never sent."""
    found = RunReplay.objects.filter(run_id=plan.run_id).first()
    recordings, uncovered = (found.recordings, found.uncovered) if found else ([], RunReplay.Uncovered.ERROR)
    earlier = Step.objects.filter(
        run_id=plan.run_id,
        tool_name=step.tool_name,
        args_digest=step.args_digest,
        seq__lt=step.seq,
        status__in=(StepStatus.SUCCEEDED, StepStatus.FAILED),
    ).count()
    replayed = replay.answer(
        recordings, step.tool_name, step.arguments or {}, earlier=earlier, uncovered=uncovered
    )
    if replayed.result is None:
        return ToolOutcome("failed", error=replayed.error, replayed=True, replay_note=replayed.note)
    return ToolOutcome("succeeded", result=replayed.result, replayed=True, replay_note=replayed.note)


def _call_tool(step: Step, plan: ToolCall) -> ToolOutcome:
    if plan.run.evaluation:
        return _replay(step, plan)
    send_by = plan.send_by
    try:
        # The user's authority for this attempt (a fresh assertion, an IdP token where configured):
        # the platform's own checks have passed in the claim; this is the provider's second lock.
        presented = authority.for_call(step, run=plan.run, approved=plan.call.may_be_corrected)
    except AuthorityRefused as exc:
        return ToolOutcome("denied", error=str(exc))
    except AuthorityUnavailable as exc:
        return ToolOutcome("not_sent", error=f"not sent: {exc}", retry_after=exc.retry_after)
    try:
        result = transports.dispatch(
            step, send_by=send_by, authority_headers=presented.headers, authority_meta=presented.meta
        )
    except ToolUnauthorized as exc:
        return ToolOutcome(
            "unauthorized",
            error=str(exc),
            challenge=exc.challenge,
            token_presented=exc.connection_id is not None,
            presented=presented.presented,
        )
    except ToolFailed as exc:
        return ToolOutcome("failed", error=presented.scrub(str(exc)), presented=presented.presented)
    except ToolNotSent as exc:  # a credential of the server's own could not be had (its OAuth token)
        return ToolOutcome("not_sent", error=f"not sent: {exc}", retry_after=exc.retry_after)
    except ToolInProgress as exc:
        return ToolOutcome(
            "in_progress",
            error=presented.scrub(str(exc)),
            retry_after=exc.retry_after,
            sent=True,
            presented=presented.presented,
        )
    except ToolOutcomeUnknown as exc:
        return ToolOutcome(
            "unknown",
            error=presented.scrub(str(exc)),
            retry_after=exc.retry_after,
            presented=presented.presented,
        )
    return ToolOutcome("succeeded", result=presented.scrub(result), presented=presented.presented)


def _reconcile(plan: ToolCall, step: Step) -> ToolOutcome | None:
    """Ask a reconcilable provider whether key K happened; None means it provably did not.

    The claim asks only once the step's settle window has passed, so "not found" is evidence.
    """
    try:
        presented = authority.for_call(step, status_lookup=True, run=plan.run)
        result = presented.scrub(
            transports.lookup_status(step, authority_headers=presented.headers, authority_meta=presented.meta)
        )
    except (AuthorityRefused, AuthorityUnavailable, ToolNotSent) as exc:
        _lookup_event(plan, step, f" not sent: {exc}", found=None, count_attempt=True)
        return ToolOutcome("unknown", error=f"status lookup not sent: {exc}")
    except ToolInProgress as exc:
        _lookup_event(plan, step, ": in progress, waiting, not retrying", found=None)
        return ToolOutcome("in_progress", error=str(exc), retry_after=exc.retry_after)
    except (ToolFailed, ToolOutcomeUnknown) as exc:
        # A failed lookup counts as an attempt: a status endpoint that stays down ends in
        # needs_attention after max_attempts instead of an endless loop of lookups.
        _lookup_event(plan, step, f" failed: {exc}", found=None, count_attempt=True)
        return ToolOutcome("unknown", error=f"status lookup failed: {exc}")
    _lookup_event(
        plan, step, ": found, not retrying" if result else ": not found, retrying", found=result is not None
    )
    if result is None:
        return None
    return ToolOutcome("succeeded", result=result, reconciled=True)


def _lookup_event(
    plan: ToolCall, step: Step, what: str, *, found: bool | None, count_attempt: bool = False
) -> None:
    with atomic_with_events():
        run = lock_run(plan.run_id)
        if fenced(run, plan):
            if count_attempt:
                Step.objects.filter(run_id=step.run_id, pk=step.pk).update(attempts=F("attempts") + 1)
            record_event(
                run.pk, "recovery", f"status lookup for step {step.seq}{what}", step_seq=step.seq, found=found
            )


def _record_tool(
    plan: ToolCall, step: Step, outcome: ToolOutcome, began: dt.datetime, *, retry: bool = False
) -> None:
    """Write the outcome under the run lock if this worker still holds the lease.

    On a retry (the first attempt's transaction failed) the step and the step log are read again:
    the in-memory ones may carry the rolled-back writes. `began`: when recording was first tried
    (dispatch.recorded_before).
    """
    now = timezone.now()
    if retry:
        step = Step.objects.select_related("tool", "tool__server").get(run_id=step.run_id, pk=step.pk)
    with atomic_with_events():
        run = lock_run(plan.run_id, like=plan.run)
        if not fenced(run, plan):
            _close_reservation(plan, step, outcome)
            if retry and recorded_before(run, step, began):
                return
            _late_tool_attempt(
                run, Step.objects.select_related("tool").get(run_id=step.run_id, pk=step.pk), outcome
            )
            return
        # While this worker holds the lease nobody else moves the run's steps: the step as marked
        # dispatching, and the step log the claim read, are still what is stored.
        _identity_event(run, step, outcome)
        if outcome.replay_note:
            record_event(
                run.pk,
                "replay_uncovered",
                f"step {step.seq} {step.tool_name}: {outcome.replay_note}",
                step_seq=step.seq,
                arguments=step.arguments,
            )
        if outcome.kind == "denied":
            at_end(lambda: _close_reservation(plan, step, outcome))
            writer.deny_after_sending_nothing(run, step, secrets.redact_text(run.tenant_id, outcome.error))
            return
        if outcome.kind == "succeeded":
            stored, observation = results.shape_result(
                run, step, outcome.answer, may_be_corrected=plan.call.may_be_corrected
            )
            event = transition_step(
                step,
                StepStatus.SUCCEEDED,
                result=stored,
                observation=observation,
                cost_micros=charge(step, outcome),
                finished_at=now,
                error="",
                message=f"step {step.seq} {step.tool_name}: "
                f"{'error reported by tool' if outcome.answer.is_error else 'succeeded'}"
                f"{' (found by status lookup)' if outcome.reconciled else ''}"
                f"{' (replayed from the recording)' if outcome.replayed else ''}"
                f"{f' as {run.created_by.username} through {outcome.answer.presented_as}' if outcome.answer.presented_as else ''}",
                defer=True,  # written with the run row and the events (loops.check may add a warning)
            )
            price = tool_of(step).price_micros

            def settle(step=step, price=price, event=event) -> None:  # its figures join the step's event
                balances = _close_reservation(plan, step, outcome)
                settled = charge(step, outcome)
                add_settle(event, run, step, reserved=price, settled=settled, balances=balances)

            at_end(settle)
            if outcome.reconciled:
                # The lookup found the lost attempt's effect: its held reservation is that call's charge.
                _close_holds_on_commit(step, happened=True)
        else:
            at_end(lambda: _close_reservation(plan, step, outcome))
        if outcome.kind == "unauthorized":
            _record_unauthorized(run, step, outcome)
            return
        if outcome.kind == "failed":
            error = secrets.redact_text(
                run.tenant_id, outcome.error, generation=run.tenant.secrets_generation
            )
            transition_step(
                step,
                StepStatus.FAILED,
                error=error,
                observation=f"ERROR: {error}",
                finished_at=now,
                message=f"step {step.seq} {step.tool_name} failed: {error}",
                defer=True,
            )
        elif outcome.kind != "succeeded":
            _record_unknown(run, step, outcome)
            return
        writer.tool_finished(run, step)  # failed calls count as repeats too


def _identity_event(run: Run, step: Step, outcome: ToolOutcome) -> None:
    """Which identity the attempt presented, so the platform's audit trail and the provider's join
    on `jti` (this attempt's assertion). Never the token: its id, subject and audience."""
    who = outcome.presented
    if not who:
        return
    token = f", IdP token for {who['token_subject'] or '?'}" if "token_subject" in who else ""
    record_event(
        run.pk,
        "identity",
        f"step {step.seq} {step.tool_name}: presented {who['subject']} to {who['audience']} (jti {who['jti']}{token})",
        step_seq=step.seq,
        **who,
    )


def _record_unauthorized(run: Run, step: Step, outcome: ToolOutcome) -> None:
    """The server answered 401 before the call ran: wait for the user to connect, or refuse
    (runs.engine.decisions.after_unauthorized)."""
    server = tool_of(step).server
    decision = decisions.after_unauthorized(step.seq, presented=outcome.token_presented, server=server.name)
    if isinstance(decision, decisions.Refuse):
        transition_step(
            step,
            StepStatus.FAILED,
            error=decision.reason,
            observation=f"ERROR: call denied: {decision.reason}",
            finished_at=timezone.now(),
            message=f"step {step.seq} {step.tool_name} denied: {decision.reason}",
        )
        writer.tool_finished(run, step)
        return
    connections.note_protected(server, outcome.challenge)
    writer.wait_for_authorization(run, step, decision)


def _close_holds_on_commit(step: Step, *, happened: bool) -> None:
    price = tool_of(step).price_micros
    transaction.on_commit(
        lambda: close_tool_holds(step.pk, happened=happened, price_micros=price), robust=True
    )


def _record_unknown(run: Run, step: Step, outcome: ToolOutcome) -> None:
    """The call's outcome is unknown, or the provider has it "in progress": the recovery table
    (runs.engine.decisions.after_unknown) says what follows; the writer applies it."""
    tool = tool_of(step)
    error = secrets.redact_text(run.tenant_id, outcome.error, generation=run.tenant.secrets_generation)
    now = timezone.now()
    in_progress = outcome.kind == "in_progress"
    if in_progress:
        sent = step.dispatched_at or step.started_at or now
        ended = sent + dt.timedelta(seconds=tool.timeout_seconds)  # the window runs from the attempt
    else:
        ended = now  # this worker saw the call end: the window runs from here
    view = tool_view(tool)
    not_sent = outcome.kind == "not_sent"
    attempt = decisions.Attempt(
        # Not sent (the IdP did not answer): nothing happened, so it is retried with backoff like
        # a read, whatever the tool's class, and fails (the model told) after max_attempts.
        effect=decisions.READ_ONLY if not_sent else view.effect,
        attempts=step.attempts,
        max_attempts=view.max_attempts,
        ended_at=ended,
        settle_seconds=0 if not_sent else view.settle_seconds,
        backoff_seconds=view.backoff_seconds,
        in_progress=in_progress,
        answered=in_progress and outcome.sent,
        retry_after=outcome.retry_after,
        cancel_requested=run.cancel_requested,
        patience_seconds=view.patience_seconds,
        jitter=random.uniform(0.5, 1.0),
    )
    decision = decisions.after_unknown(step.seq, attempt, now)
    if not isinstance(decision, decisions.GiveUp):
        write_step(step, error=error)
    writer.after_unknown(run, step, decision, error=error)


def _late_tool_attempt(run: Run, step: Step, outcome: ToolOutcome) -> None:
    """A fenced-out worker may only leave a record — unless it proves an unknown step succeeded."""
    record_event(
        run.pk,
        "late_attempt",
        f"step {step.seq} {step.tool_name}: result from a worker that lost its lease ({outcome.kind})",
        step_seq=step.seq,
        outcome=outcome.kind,
    )
    if outcome.kind == "succeeded" and step.status == StepStatus.OUTCOME_UNKNOWN:
        stored, observation = results.shape_result(run, step, outcome.answer)
        transition_step(
            step,
            StepStatus.RESOLVED_SUCCEEDED,
            result=stored,
            observation=observation,
            resolved_at=timezone.now(),
            error="",
            resolution="happened: a late result from the lost attempt proves it",
            message=f"step {step.seq} resolved automatically: the late result proves it succeeded",
        )
        _close_holds_on_commit(step, happened=True)
        writer.resume_if_resolved(run, message="resumed: unknown outcome resolved by a late result")
