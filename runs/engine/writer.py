"""The writer: applies the engine's decisions (runs/engine/decisions.py) in the step's transaction.

Every function here runs with the run row locked, inside `atomic_with_events`, and writes through
the guarded transitions and named statements of runs/transitions.py and runs/statements.py: one
conditional UPDATE plus an event per move, the run's own columns and all the events in the one
statement that ends the transaction. Nothing here decides: what to write comes in as a decision,
and the statuses it moves to are those tests/runs/test_decisions.py checks against the maps.
"""

from __future__ import annotations

import datetime as dt

from django.db import transaction
from django.utils import timezone

from budgets import services as budgets
from budgets.models import Reservation
from connections.services import connect_link
from llm import fallback
from observability import observe
from runs.engine import conversation, decisions, loops
from runs.engine.types import tool_of
from runs.models import Run, RunStatus, Step, StepKind, StepStatus, StopReason
from runs.policy_events import decision_data
from runs.queueing import continue_run
from runs.transitions import (
    end_run,
    record_event,
    transition_run,
    transition_step,
    void_approval,
    write_run_at_end,
    write_step,
)
from tenants.models import User

STOP_REASONS = {reason.value for reason in StopReason}


def take_over(run: Run) -> None:
    """The previous worker's lease ran out: record it, and give back what it reserved but never
    dispatched (now, not after budgets.release_orphans' quarantine, which is for runs nobody
    claims again)."""
    record_event(
        run.pk,
        "lease_expired",
        "previous worker's lease expired; taking over",
        expired_at=run.lease_expires_at.isoformat() if run.lease_expires_at else None,
    )
    write_run_at_end(run, lease_token=None, lease_expires_at=None)
    run_id = run.pk
    transaction.on_commit(lambda: _release_undispatched(run_id), robust=True)


def end(run: Run, decision: decisions.Cancel | decisions.Stop | decisions.FailRun | decisions.Finish) -> None:
    """A decision that ends the run."""
    conversation.forget(run.pk)
    if isinstance(decision, decisions.Cancel):
        end_run(run, RunStatus.CANCELLED, message="cancelled")
    elif isinstance(decision, decisions.Stop):
        reason = decision.reason if decision.reason in STOP_REASONS else ""
        end_run(run, RunStatus.STOPPED, reason=reason, message=decision.message)
    elif isinstance(decision, decisions.FailRun):
        end_run(run, RunStatus.FAILED, error=decision.error, message=decision.message)
    else:
        end_run(run, RunStatus.SUCCEEDED, message="succeeded")


def model_moved(run: Run, seq: int, route: fallback.Route) -> None:
    """The run's next model call goes to another endpoint than its previous one: on the timeline
    and in the metrics, once per switch (the calls after it on the same endpoint say nothing)."""
    assert route.moved is not None
    before, after, reason = route.moved
    why = {
        fallback.CIRCUIT_OPEN: f"the circuit of {', '.join(route.refused) or before} is open",
        fallback.MOVED_BACK: f"{before} answered the previous call and the chain moves back",
    }.get(reason, f"{before} failed: {reason}")
    record_event(
        run.pk,
        "model_fallback",
        f"step {seq} model call goes to {after} instead of {before}: {why}",
        step_seq=seq,
        from_endpoint=before,
        to_endpoint=after,
        reason=reason,
        probe=route.probe,
    )
    observe.model_moved(run, before, after, reason)


def wait_for_circuit(run: Run, wait: fallback.Wait) -> None:
    """Every endpoint the call may go to has an open circuit: nothing is reserved or sent, and the
    run's next message comes when a probe may go (a countdown, no worker held meanwhile)."""
    record_event(
        run.pk,
        "circuit_open",
        f"model call waits {wait.seconds:.0f}s: the circuit of {', '.join(wait.endpoints)} is open",
        endpoints=list(wait.endpoints),
        seconds=round(wait.seconds, 1),
    )
    continue_run(run, countdown=wait.seconds)


def park(run: Run, decision: decisions.Park) -> None:
    transition_run(run, decision.status, message=decision.message)


def wait_for_quota(run: Run, decision: decisions.WaitForQuota) -> None:
    """The model call waits for its endpoint's shared quota: no lease, no reservation, no step;
    the run's next message comes with the countdown and asks again."""
    record_event(
        run.pk,
        "quota_wait",
        f"step {decision.seq} model call waits {decision.countdown:.2f}s for the endpoint's quota "
        f"({QUOTA_LIMITS.get(decision.limit, decision.limit)})",
        step_seq=decision.seq,
        limit=decision.limit,
        countdown=round(decision.countdown, 3),
    )
    continue_run(run, countdown=decision.countdown)


QUOTA_LIMITS = {
    "requests": "requests per minute",
    "tokens": "tokens per minute",
    "fair_share": "other tenants' turn",
    "retry_after": "the provider asked to wait, or a call to it timed out",
    "in_flight": "the endpoint's max_in_flight calls are out",
}


def pause(run: Run) -> None:
    """An operator's pause requested during a call, taken at this step boundary: the run waits as
    a row (no lease, no message) until runs.controls.pausing.resume_run re-enqueues it."""
    paused_at = timezone.now()
    message = "paused" + (f": {run.pause_reason}" if run.pause_reason else "")
    transition_run(
        run,
        RunStatus.PAUSED,
        message=message,
        event_data={"reason": run.pause_reason},
        pause_requested=False,
        paused_at=paused_at,
    )
    record_event(
        run.pk,
        "paused",
        message,
        actor=User(pk=run.paused_by_id) if run.paused_by_id else None,
        reason=run.pause_reason,
        until=run.paused_until.isoformat() if run.paused_until else None,
        at_step_boundary=True,
    )


def count_crash(run: Run, step: Step) -> None:
    """The step was found `dispatching` with nothing scheduled: its worker was lost with the call.

    The lost attempt may have been charged: its reservation is held once this transaction commits
    (one ledger statement per transaction, and this one's may be the retry's reserve: see the
    lock order in runs/engine/__init__.py; the sweeper is the backstop). The ids are taken now: a
    retry's own reservation, made in this transaction, is linked to the same step and stays open.
    """
    lost = list(
        Reservation.objects.filter(step_id=step.pk, status=Reservation.Status.OPEN).values_list(
            "pk", flat=True
        )
    )
    transaction.on_commit(lambda: _hold(lost), robust=True)
    step.crashes += 1
    Step.objects.filter(run_id=step.run_id, pk=step.pk).update(crashes=step.crashes)


def poison(run: Run, step: Step | None, decision: decisions.Poison) -> None:
    """The step (or the engine at this step) failed too often: the step ends, the run fails. A
    step that may have taken effect is left outcome_unknown with its charge held, for a person."""
    record_event(
        run.pk,
        "recovery",
        decision.error,
        step_seq=step.seq if step is not None else None,
        action="fail_run",
    )
    if step is not None and decision.step_status is not None:
        transition_step(step, decision.step_status, error=decision.step_error, finished_at=timezone.now())
    conversation.forget(run.pk)
    end_run(run, RunStatus.FAILED, error=decision.error, message="failed: poison step")


def model_lost(run: Run, step: Step) -> None:
    record_event(
        run.pk,
        "recovery",
        f"model step {step.seq} lost with its worker: its reservation is held and the call is made again",
        step_seq=step.seq,
        action="hold_and_retry",
    )


def recovery_event(run: Run, step: Step, decision: decisions.Retry, *, effect: str) -> None:
    record_event(
        run.pk,
        "recovery",
        f"step {step.seq} {step.tool_name} {decision.why}",
        step_seq=step.seq,
        action=decisions.ACTION[effect],
        effect_class=effect,
        attempts=step.attempts,
    )


def after_unknown(run: Run, step: Step, decision, *, error: str = "") -> None:
    """Apply the recovery table's answer for a tool step whose outcome is unknown, other than a
    retry sent now (the caller dispatches that)."""
    if isinstance(decision, decisions.AskPerson):
        mark_unknown(
            run, step, f"step {step.seq} {step.tool_name}: {decision.why}" + (f" ({error})" if error else "")
        )
    elif isinstance(decision, decisions.GiveUp):
        why = decision.why + (f": {error}" if error else "")
        transition_step(
            step,
            StepStatus.FAILED,
            error=why,
            observation=f"ERROR: {step.tool_name} {why}",
            next_attempt_at=None,
            finished_at=timezone.now(),
        )
        tool_finished(run, step)
    elif isinstance(decision, decisions.WaitToSettle):
        if decision.uncount_attempt:
            # A repeat answered "in progress" did nothing: it does not use up one of max_attempts.
            step.attempts = max(step.attempts - 1, 0)
            Step.objects.filter(run_id=step.run_id, pk=step.pk).update(attempts=step.attempts)
        wait_to_settle(run, step, decision.until, decision.why + (f" ({error})" if error else ""))
    else:
        assert isinstance(decision, decisions.Retry) and decision.at is not None
        delay = max((decision.at - timezone.now()).total_seconds(), 0.0)
        write_step(step, next_attempt_at=decision.at, error=error)
        record_event(
            run.pk,
            "retry_scheduled",
            f"step {step.seq} {step.tool_name}: outcome unknown ({error}); {decision.why}",
            step_seq=step.seq,
            effect_class=tool_of(step).effect_class,
        )
        continue_run(run, countdown=delay)


def mark_unknown(run: Run, step: Step, message: str) -> None:
    transition_step(
        step,
        StepStatus.OUTCOME_UNKNOWN,
        message=message,
        error=message,
        next_attempt_at=None,
        finished_at=timezone.now(),
    )
    transition_run(run, RunStatus.NEEDS_ATTENTION, message="needs attention: " + message)


def wait_to_settle(run: Run, step: Step, until: dt.datetime, why: str) -> None:
    """Park the run as a row (no lease, no message) until `until`; the sweeper wakes it."""
    Step.objects.filter(run_id=step.run_id, pk=step.pk).update(next_attempt_at=until)
    step.next_attempt_at = until
    transition_run(
        run,
        RunStatus.WAITING_SETTLE,
        resume_at=until,
        message=f"waiting until {until.isoformat(timespec='seconds')} to ask about step {step.seq} "
        f"{step.tool_name}: {why}",
        event_data={"step_seq": step.seq, "tool": step.tool_name, "until": until.isoformat(), "reason": why},
    )


def wait_for_authorization(run: Run, step: Step, decision: decisions.WaitForAuthorization) -> None:
    """Park the step and the run until the user connects the tool's server; the timeline, the run
    stream and the webhook carry the link to connect (runs/authorization_effects.py resumes)."""
    tool = tool_of(step)
    link = connect_link(tool.server)
    user = run.created_by.username
    if step.status == StepStatus.APPROVED:
        void_approval(step, reason="the call waits for the user to connect its server; it is asked again")
    transition_step(
        step,
        StepStatus.AWAITING_AUTHORIZATION,
        next_attempt_at=None,
        message=f"step {step.seq} {step.tool_name}: waiting for {user} to connect {decision.server}",
    )
    transition_run(
        run,
        RunStatus.WAITING_AUTHORIZATION,
        message=f"waiting for {user} to connect {decision.server}: {link}",
        event_data={"step_seq": step.seq, "server": decision.server, "user": user, "connect_url": link},
    )


def deny(run: Run, step: Step, reason: str) -> None:
    """The gateway refused the call: nothing is sent; the model is told why; the run goes on."""
    _not_sent(
        run,
        step,
        message=f"step {step.seq} {step.tool_name or '?'} denied: {reason}",
        error=reason,
        observation=f"ERROR: call denied by the platform: {reason}",
        void_reason=reason,
    )


def unavailable(run: Run, step: Step, switch: str) -> None:
    """A kill switch is on for the tool and the tenant chose to tell the model: nothing is sent,
    the call is answered as unavailable (an approval it had is withdrawn, never consumed), and
    the run goes on. The operator's reason stays in the step's error, out of the model's sight."""
    _not_sent(
        run,
        step,
        message=f"step {step.seq} {step.tool_name}: not sent, the tool is unavailable ({switch})",
        error=f"tool unavailable: {switch}",
        observation=f"ERROR: the tool {step.tool_name} is unavailable right now (turned off by an "
        "operator); nothing was sent. Go on without it.",
        void_reason=f"not sent: {switch}",
    )


def deny_after_sending_nothing(run: Run, step: Step, reason: str) -> None:
    """The user's identity provider refused a token for the call: a denial the model is told, with
    the IdP's reason; nothing was sent. Like the gateway's own denial, the run goes on."""
    _not_sent(
        run,
        step,
        message=f"step {step.seq} {step.tool_name or '?'} denied: {reason}",
        error=reason,
        observation=f"ERROR: call denied: {reason}",
        next_attempt_at=None,
    )


def _not_sent(
    run: Run,
    step: Step,
    *,
    message: str,
    error: str,
    observation: str,
    void_reason: str | None = None,
    **fields,
) -> None:
    """A call answered `denied` without anything sent; an approval it had is withdrawn (never consumed)."""
    if void_reason is not None and step.status == StepStatus.APPROVED:
        void_approval(step, reason=void_reason)
    event = transition_step(
        step,
        StepStatus.DENIED,
        message=message,
        error=error,
        observation=observation,
        finished_at=timezone.now(),
        **fields,
    )
    event.data.update(decision_data(step, denied=True))  # the forbids that denied it, if any
    tool_finished(run, step)


def keep_retry(step: Step) -> None:
    """A step in flight that is not sent now (its tool is killed) is kept as a retry due now: the
    claim after the resume retries it (or asks the provider first), and does not count the lost
    attempt's worker death a second time."""
    if step.next_attempt_at is None:
        step.next_attempt_at = timezone.now()
        Step.objects.filter(run_id=step.run_id, pk=step.pk).update(next_attempt_at=step.next_attempt_at)


def replay(run: Run, step: Step, prior: Step) -> None:
    """An identical call already succeeded in this run: answer from the record, call nothing."""
    note = (
        f"[platform] This exact call was already made at step {prior.seq}; "
        f"returning the recorded result without calling the tool again."
    )
    transition_step(
        step,
        StepStatus.SUCCEEDED,
        message=f"step {step.seq} {step.tool_name}: replayed from step {prior.seq}",
        result=prior.result,
        observation=f"{prior.observation}\n{note}",
        replayed_from_seq=prior.seq,
        finished_at=timezone.now(),
    )
    tool_finished(run, step)


def answered(run: Run, step: Step, *, ok: bool, result: dict | None, text: str) -> None:
    """A platform tool answered from the run's own rows (a malformed call fails: the model is told)."""
    transition_step(
        step,
        StepStatus.SUCCEEDED if ok else StepStatus.FAILED,
        result=result if ok else None,
        error="" if ok else text,
        observation=text,
        finished_at=timezone.now(),
        message=f"step {step.seq} {step.tool_name}: {'answered by the platform' if ok else 'failed: ' + text}",
    )
    tool_finished(run, step)


def tool_finished(run: Run, step: Step) -> None:
    """After a tool step's outcome (a denial, a replay, a platform answer, a given-up call, or the
    provider's answer): stop on a loop, end a cancelled run, else go on to the next step."""
    recorded(run)
    if loops.check(run, step):
        conversation.forget(run.pk)
        return
    if run.cancel_requested:
        end(run, decisions.Cancel())
        return
    if run.pause_requested:
        pause(run)
        return
    continue_run(run)


def recorded(run: Run) -> None:
    """A step's outcome is on record: the engine's errors at this step are behind it."""
    if run.engine_errors:
        write_run_at_end(run, engine_errors=0)


def resume_if_resolved(run: Run, *, actor=None, message: str) -> None:
    """A run that needed attention goes on once no tool step's outcome is unknown any more."""
    if (
        run.status == RunStatus.NEEDS_ATTENTION
        and not Step.objects.filter(run=run, kind=StepKind.TOOL, status=StepStatus.OUTCOME_UNKNOWN).exists()
    ):
        transition_run(run, RunStatus.RUNNING, actor=actor, message=message)
        continue_run(run)


def _release_undispatched(run_id) -> None:
    """A reservation is linked to its step in the transaction that commits `dispatching`: one
    without a step paid for a call that was never sent."""
    for reservation_id in Reservation.objects.filter(
        run_id=run_id, step__isnull=True, status=Reservation.Status.OPEN
    ).values_list("pk", flat=True):
        budgets.release(reservation_id, note="its worker lost the lease before dispatching")


def _hold(reservation_ids: list) -> None:
    for reservation_id in reservation_ids:
        budgets.hold(reservation_id, note="attempt lost with its worker; it may have been charged")
