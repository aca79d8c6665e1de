"""A model step: call the model, then settle and record in one transaction (runs/engine/__init__.py).

Before the claim reserves the call's budget and commits the step as `dispatching`, it asks the
endpoint's shared quota (`quota_wait`); a provider's Retry-After slows every caller of the
endpoint (`_throttled`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import logging
import random

from django.db import InterfaceError, OperationalError, close_old_connections
from django.utils import timezone

from agents import output as output_contract
from agents.spec import spec_for
from budgets import services as budgets
from budgets.models import Reservation
from llm import breaker, fallback, quotas
from llm import gateway as model_gateway
from llm.models import ModelEndpoint
from llm.tokens import estimate_text
from llm.types import ProviderError, ToolCall
from observability import observe
from runs.engine import decisions, heartbeat, proposals, writer
from runs.engine.dispatch import add_settle, recorded_before, through_database_outage
from runs.engine.types import LostModelCall, ModelCall, ModelPlan, fenced
from runs.models import Run, RunStatus, Step, StepKind, StepStatus
from runs.queueing import continue_run
from runs.transitions import at_end, atomic_with_events, end_run, lock_run, record_event, transition_step
from tenants import secrets

log = logging.getLogger(__name__)


def quota_wait(run: Run, endpoint: ModelEndpoint, seq: int, *, tokens: int) -> decisions.WaitForQuota | None:
    """Ask the endpoint's shared quota for the call (llm/quotas.py): None to go now.

    In the claim's transaction, with the run row locked, before anything is reserved: a call that
    waits leaves nothing to undo. It is one Redis round trip with a short timeout (the limiter
    lets the call go if Redis does not answer), not a provider call.
    """
    admission = quotas.admit(
        endpoint, tenant=run.tenant.slug, weight=run.tenant.quota_weight, tokens=tokens, caller=str(run.pk)
    )
    return decisions.quota_turn(seq, admission.wait_seconds, admission.limit)


def _throttled(endpoint: ModelEndpoint, exc: ProviderError) -> float | None:
    """The provider said when to come back, or a call timed out (backoff with jitter): so does
    every other run calling that account. The seconds to wait, if any."""
    if exc.retryable and exc.retry_after is not None:
        quotas.slow_down(endpoint, exc.retry_after)
        return exc.retry_after
    if exc.timed_out and endpoint.timeout_backoff_seconds > 0:
        backoff = decisions.timeout_backoff(endpoint.timeout_backoff_seconds, random.random())
        quotas.slow_down(endpoint, backoff)
        return backoff
    return None


def do_model(plan: ModelCall) -> None:
    model, step = plan.model, plan.step
    try:
        # The endpoint (and its secret) the claim read: the call itself needs no database connection.
        with observe.model_call(
            run_id=plan.run_id, seq=step.seq, endpoint=model.endpoint, request=model.request
        ) as call:
            try:
                reply = model_gateway.call_model(model.endpoint, model.request)
            finally:
                quotas.release(model.endpoint, str(plan.run_id))  # its max_in_flight slot
            cost = model_gateway.cost_micros(model.endpoint, reply.usage)
            call.replied(reply, cost)
    except ProviderError as exc:
        heartbeat.untrack(plan.run_id)
        wait = _throttled(model.endpoint, exc)
        close_old_connections()
        failure = exc  # `exc` is unbound once the except block ends
        kind = fallback.error_class(failure)
        circuit = _count_for_circuit(model, kind, str(failure))
        began = timezone.now()
        through_database_outage(
            lambda retry: _record_model_failure(plan, step, failure, kind, circuit, began, wait, retry=retry),
            seconds=plan.lease_seconds,
        )
        return
    finally:
        heartbeat.untrack(plan.run_id)
    close_old_connections()
    circuit = _count_for_circuit(model, "", "", cost=cost)
    began = timezone.now()
    record = _record_summary if model.fold is not None else _record_model
    through_database_outage(
        lambda retry: record(plan, step, reply, cost, circuit, began, retry=retry),
        seconds=plan.lease_seconds,
    )


def _count_for_circuit(model: ModelPlan, kind: str, error: str, *, cost: int = 0) -> str:
    """The call's outcome at its endpoint: metrics, and its circuit breaker (outside any
    transaction; an answer writes nothing unless it was the probe). The state the circuit moved
    to, if it moved. A database that is down loses the count, never the step's outcome."""
    observe.model_endpoint_call(model.endpoint, kind or "answered", cost)
    try:
        return breaker.record(model.endpoint, error_class=kind, probe=model.probe, error=error)
    except (OperationalError, InterfaceError):
        log.warning("circuit breaker of %s not updated: database unreachable", model.endpoint.name)
        close_old_connections()
        return ""


def _record_model_failure(
    plan: ModelCall,
    step: Step,
    exc,
    kind: str,
    circuit: str,
    began: dt.datetime,
    wait: float | None = None,
    *,
    retry: bool = False,
) -> None:
    """Close the reservation and write the failure, in one transaction (run, then budget).

    `kind`: the failure's class (llm/fallback.error_class); a failure that moves the run's next
    call to a fallback sends it at once (not after this endpoint's Retry-After), and a refusal
    that a fallback takes (a prompt too long for this model) does not end the run. `circuit`: the
    state this failure moved the endpoint's circuit breaker to, if any. `began`: when recording
    was first tried (dispatch.recorded_before). `wait`: the endpoint's Retry-After or timeout
    backoff, the run's countdown before its next call."""
    # No answer after sending, or a 2xx we could not read: the provider may have charged it.
    lost = exc.sent and (exc.status is None or 200 <= exc.status < 300)
    if retry:  # the failed attempt's writes to `step` in memory were rolled back in the database
        step = Step.objects.get(run_id=step.run_id, pk=step.pk)
    with atomic_with_events():
        run = lock_run(plan.run_id, like=plan.run)
        # Closing is a no-op on a reservation already closed, so a retry repeats it safely.
        if lost:
            budgets.hold(plan.reservation_id, note=f"model response lost: {exc}")
        else:
            budgets.release(plan.reservation_id, note=f"provider refused: {exc}")
        status = StepStatus.OUTCOME_UNKNOWN if lost else StepStatus.FAILED
        what = "model call" if plan.model.fold is None else "summary"
        message = f"step {step.seq} {what} {'lost' if lost else 'failed'}: {exc}"
        if plan.model.fold is not None:
            message += "; the fold keeps its deterministic record"
        if exc.timed_out and wait:
            message += f"; no call goes to {plan.model.endpoint.name} for {wait:.1f}s (timeout backoff)"
        if not fenced(run, plan):
            if retry and recorded_before(run, step, began):
                return
            record_event(run.pk, "late_attempt", message, step_seq=step.seq)
            return
        transition_step(
            step, status, message=message, error=str(exc), finished_at=timezone.now(), error_class=kind
        )
        model = plan.model
        if circuit:
            _circuit_event(run, step, model, circuit)
        moves = model.chain is not None and fallback.moves_on(
            model.chain, model.history, fallback.Attempt(model.endpoint.pk, kind)
        )
        if run.cancel_requested:
            end_run(run, RunStatus.CANCELLED, message="cancelled")
        elif model.fold is not None:
            continue_run(run)  # a summary that failed is not tried again: the run goes on without it
        elif moves:
            continue_run(run)
        elif not exc.retryable:
            end_run(
                run,
                RunStatus.FAILED,
                error=f"model provider refused the request: {exc}",
                message="failed: model request refused",
            )
        else:
            continue_run(run, countdown=wait if wait is not None else 1.0)


def _circuit_event(run, step: Step, model: ModelPlan, state: str) -> None:
    endpoint = model.endpoint
    if state == breaker.State.OPEN:
        message = (
            f"circuit of {endpoint.name} opened: {endpoint.breaker_failures} failures within "
            f"{endpoint.breaker_window_seconds}s"
            if not model.probe
            else f"circuit of {endpoint.name} opened again: its probe failed"
        ) + f"; calls are not sent to it for {endpoint.breaker_open_seconds}s"
    else:
        message = f"circuit of {endpoint.name} closed: its probe call answered"
    record_event(run.pk, "circuit", message, step_seq=step.seq, endpoint=endpoint.name, state=state)


def _record_model(
    plan: ModelCall, step: Step, reply, cost: int, circuit: str, began: dt.datetime, *, retry: bool = False
) -> None:
    """The step's second transaction: lock the run, settle the reservation, write the reply if
    this worker still holds the lease, the step's events, and enqueue the next step on commit.
    `circuit`: "closed" when this answer was its endpoint's probe and closed the circuit.

    On a retry, from the step as stored (the failed attempt's in-memory writes were rolled back);
    `began`: when recording was first tried (dispatch.recorded_before).
    """
    if retry:
        step = Step.objects.get(run_id=step.run_id, pk=step.pk)
    with atomic_with_events():
        run = lock_run(plan.run_id, like=plan.run)
        settle = functools.partial(_settle, plan, step, cost)
        if not fenced(run, plan):
            reconciled = settle()[2]
            if retry and recorded_before(run, step, began):
                return
            record_event(
                run.pk,
                "late_attempt",
                f"step {step.seq} model reply arrived after the lease was lost"
                + (f"; its held charge is reconciled at {cost} micros" if reconciled else ""),
                step_seq=step.seq,
                cost_micros=cost,
                hold_reconciled=reconciled,
            )
            return
        # What the model said is made storable (it may send anything), and known secrets are
        # redacted from it, before it is stored or acted on.
        reply = dataclasses.replace(
            reply,
            text=proposals.storable(reply.text or ""),
            tool_calls=[
                ToolCall(id=c["id"], name=c["name"], arguments=c["arguments"])
                for c in proposals.storable_calls(
                    [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in reply.tool_calls]
                )
            ],
        )
        text, calls = secrets.redact_reply(run.tenant_id, reply, generation=run.tenant.secrets_generation)
        usage = {
            "input_tokens": reply.usage.input_tokens,
            "cached_input_tokens": reply.usage.cached_input_tokens,
            "cache_write_tokens": reply.usage.cache_write_tokens,
            "output_tokens": reply.usage.output_tokens,
        }
        if reply.usage.counted_by != "server":
            # The platform stopped reading at the output limit, or the server reported no usage:
            # these figures are the platform's own count (llm.types.Usage.counted_by).
            usage["counted_by"] = reply.usage.counted_by
        if reply.cleared_tool_uses:
            # The provider's context editing took these out of the request (neither read nor billed).
            usage["cleared_input_tokens"] = reply.cleared_input_tokens
            usage["cleared_tool_uses"] = reply.cleared_tool_uses
        cut = reply.stop_reason == "cut_at_output_limit"
        verdict, output_errors, refused = "accept", list[str](), 0
        if not calls and not run.cancel_requested:
            verdict, output_errors, refused = _check_output(run, text)
        result: dict = {"text": text, "tool_calls": calls}
        if output_errors:
            result["output_errors"] = output_errors
        event = transition_step(
            step,
            StepStatus.SUCCEEDED,
            result=result,
            usage=usage,
            cost_micros=cost,
            finished_at=timezone.now(),
            observation=text,
            message=f"step {step.seq} model call: {len(calls)} tool call(s), cost {cost} micros"
            + (
                f"; the provider cleared {reply.cleared_tool_uses} old tool result(s), "
                f"{reply.cleared_input_tokens:,} input tokens, from the request"
                if reply.cleared_tool_uses
                else ""
            )
            + (
                f"; cut at the output limit ({run.limits['max_output_tokens']} tokens): the platform "
                "stopped reading and closed the connection"
                if cut
                else ""
            ),
            defer=True,  # written with the run row and the events, in the record's last statement
        )
        if circuit:
            _circuit_event(run, step, plan.model, circuit)
        at_end(  # the settle's figures join the step's event
            lambda: add_settle(
                event, run, step, reserved=plan.model.estimate, settled=cost, balances=settle()[1]
            )
        )
        writer.recorded(run)
        # A cancel ends the run here and skips the proposed steps, reading them back: not deferred then.
        proposals.propose(
            run=run,
            parent_seq=step.seq,
            calls=calls,
            known=plan.model.tools,
            defer=not run.cancel_requested,
        )
        if run.cancel_requested:
            end_run(run, RunStatus.CANCELLED, message="cancelled")
        elif not calls and verdict == "accept":
            end_run(run, RunStatus.SUCCEEDED, message="succeeded", final_output=text)
        elif not calls and verdict == "fail":
            end_run(
                run,
                RunStatus.FAILED,
                reason="invalid_output",
                error=f"invalid_output: the final answer did not match the version's output_schema after "
                f"{refused + 1} answer(s): " + "; ".join(output_errors),
                message="failed: invalid output",
                final_output=text,
            )
        elif not calls:
            record_event(
                run.pk,
                "output_refused",
                f"step {step.seq} final answer refused (answer {refused + 1}; the model is asked again): "
                + "; ".join(output_errors),
                step_seq=step.seq,
                errors=output_errors,
            )
            if run.pause_requested:
                writer.pause(run)
            else:
                continue_run(run)
        elif run.pause_requested:
            writer.pause(run)  # its proposed calls wait, undispatched, for the resume
        else:
            continue_run(run)


def _record_summary(
    plan: ModelCall, step: Step, reply, cost: int, circuit: str, began: dt.datetime, *, retry: bool = False
) -> None:
    """A fold's summary (runs/engine/summaries.py): settle its reservation, store the summary on
    its step (the conversation shows it in the fold's record from the next call on), go on."""
    if retry:
        step = Step.objects.get(run_id=step.run_id, pk=step.pk)
    with atomic_with_events():
        run = lock_run(plan.run_id, like=plan.run)
        settle = functools.partial(_settle, plan, step, cost)
        if not fenced(run, plan):
            reconciled = settle()[2]
            if retry and recorded_before(run, step, began):
                return
            record_event(
                run.pk,
                "late_attempt",
                f"step {step.seq} summary arrived after the lease was lost",
                step_seq=step.seq,
                cost_micros=cost,
                hold_reconciled=reconciled,
            )
            return
        # What the model wrote is made storable and known secrets are redacted, as for any reply.
        reply = dataclasses.replace(reply, text=proposals.storable(reply.text or ""), tool_calls=[])
        text, _ = secrets.redact_reply(run.tenant_id, reply, generation=run.tenant.secrets_generation)
        text = " ".join(text.split())
        fold = plan.model.fold or {}
        usage = {
            "input_tokens": reply.usage.input_tokens,
            "cached_input_tokens": reply.usage.cached_input_tokens,
            "cache_write_tokens": reply.usage.cache_write_tokens,
            "output_tokens": reply.usage.output_tokens,
        }
        folded = (
            f"steps {fold['first_step']}-{fold['last_step']}" if fold.get("first_step") else "earlier turns"
        )
        summary_tokens = estimate_text(text)
        if text:
            event = transition_step(
                step,
                StepStatus.SUCCEEDED,
                result={"text": text, "at": fold["at"]},
                usage=usage,
                cost_micros=cost,
                finished_at=timezone.now(),
                observation=text,
                message=f"step {step.seq} summary of {folded} ({fold.get('turns')} model turns, "
                f"{fold.get('results')} tool results) by {plan.model.endpoint.name}: a record of "
                f"{fold.get('record_tokens', 0):,} tokens gets a summary of {summary_tokens:,} tokens "
                f"(estimated), cost {cost} micros",
                defer=True,
            )
        else:
            event = transition_step(
                step,
                StepStatus.FAILED,
                usage=usage,
                cost_micros=cost,
                finished_at=timezone.now(),
                error="the summariser answered with no text",
                error_class="empty",
                message=f"step {step.seq} summary of {folded} was empty; the fold keeps its "
                f"deterministic record (cost {cost} micros)",
                defer=True,
            )
        if circuit:
            _circuit_event(run, step, plan.model, circuit)
        at_end(
            lambda: add_settle(
                event, run, step, reserved=plan.model.estimate, settled=cost, balances=settle()[1]
            )
        )
        writer.recorded(run)
        if run.cancel_requested:
            end_run(run, RunStatus.CANCELLED, message="cancelled")
        elif run.pause_requested:
            writer.pause(run)
        else:
            continue_run(run)


def _check_output(run: Run, text: str) -> tuple[str, list[str], int]:
    """A final answer against the version's output contract (agents/output.py): the verdict
    (decisions.output_turn), the errors, and how many of the run's answers were refused before.
    Read once per final answer: the run's successful tool results, for the grounded fields."""
    contract = spec_for(run.version).output
    if contract is None:
        return "accept", [], 0
    results = []
    if contract.grounded:
        for stored in Step.objects.filter(
            run_id=run.pk,
            kind=StepKind.TOOL,
            status__in=(StepStatus.SUCCEEDED, StepStatus.RESOLVED_SUCCEEDED),
        ).values_list("result", flat=True):
            if (
                isinstance(stored, dict)
                and not stored.get("is_error")
                and isinstance(stored.get("text"), str)
            ):
                results.append(stored["text"])
    _, errors = output_contract.check(text, contract, results)
    # Counted here, not in SQL: a step's result is sealed at rest (vault/fields.py).
    refused = sum(
        isinstance(result, dict) and "output_errors" in result
        for result in Step.objects.filter(run_id=run.pk, kind=StepKind.MODEL).values_list("result", flat=True)
    )
    return decisions.output_turn(errors, refused, contract.retries), errors, refused


def _settle(plan: ModelCall, step: Step, cost: int) -> tuple[bool, object, bool]:
    """Close the call's reservation at its reported cost: (settled, the run account's balances,
    whether a hold was reconciled instead). The record calls it as its transaction's last write
    (runs.transitions.at_end), so the budget rows are locked for microseconds."""
    settled, balances = budgets.settle_reporting(plan.reservation_id, actual_micros=cost)
    reconciled = False
    if not settled:
        # Not open any more: a worker that took the run over found this call lost and held its
        # reservation. This reply carries the provider's own usage for that call, which is
        # what a hold waits for, so it clears the hold (once: reconcile moves only a held one).
        reconciled = budgets.reconcile(
            plan.reservation_id,
            actual_micros=cost,
            actor=None,
            note=f"late reply of step {step.seq}: provider-reported usage",
        )
    return settled, balances, reconciled


def recover_model(plan: LostModelCall) -> None:
    for reservation_id in Reservation.objects.filter(
        step_id=plan.step_id, status=Reservation.Status.OPEN
    ).values_list("pk", flat=True):
        budgets.hold(reservation_id, note="model call lost with its worker")
    with atomic_with_events():
        run = lock_run(plan.run_id)
        if not fenced(run, plan):
            return
        step = Step.objects.get(run_id=plan.run_id, pk=plan.step_id)
        transition_step(
            step,
            StepStatus.OUTCOME_UNKNOWN,
            error="worker lost during the call; charge held",
            finished_at=timezone.now(),
        )
        continue_run(run)
