"""What the engine calls to be observable: one scope per step, transitions, calls, sweeps.

Each call is one line in the engine. Logs and counters of a transition are written when its
transaction commits (a transaction retried through a database outage is counted once), and
never raise into the engine: observing must not change what the engine does.

    step_scope(run_id)     around one engine step: binds the run id to every log line, collects
                           what the step did into the task's result (shown by Flower)
    bind(...)              add tenant / step seq / tool to the scope (the claim knows them)
    run_moved / step_moved every run and step transition: a log line (WARNING for needs_attention,
                           failures, stops, budget pauses, denied calls) and the counters
    model_call / tool_call around the call itself: the GenAI span, the latency histogram, tokens
                           and spend by tenant
    swept(found)           a sweeper pass: recoveries by kind
"""

from __future__ import annotations

import contextvars
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import urlparse

from django.db import transaction
from opentelemetry.trace import SpanKind, Status, StatusCode

from observability import logs, metrics, tracing
from runs.models import RunStatus, StepStatus, StopReason

log = logging.getLogger("agentplatform.runs")
sweeper_log = logging.getLogger("agentplatform.sweeper")

BUDGET_STOPS = {StopReason.BUDGET_EXHAUSTED, StopReason.TENANT_BUDGET_EXHAUSTED}
# Statuses a person or an alert should hear about.
WARN_RUN = {RunStatus.NEEDS_ATTENTION, RunStatus.FAILED, RunStatus.STOPPED, RunStatus.WAITING_BUDGET}
# Keyed by str: a transition's `to` comes as a plain string.
WARN_RUN_WHAT: dict[str, str] = {
    RunStatus.NEEDS_ATTENTION: "run needs attention",
    RunStatus.FAILED: "run failed",
    RunStatus.WAITING_BUDGET: "run paused by budget",
}
WARN_STEP = {StepStatus.DENIED, StepStatus.OUTCOME_UNKNOWN}
# A step's outcome: what the steps counter counts.
OUTCOMES = {
    StepStatus.SUCCEEDED,
    StepStatus.FAILED,
    StepStatus.OUTCOME_UNKNOWN,
    StepStatus.DENIED,
    StepStatus.REJECTED,
    StepStatus.EXPIRED,
    StepStatus.SKIPPED,
    StepStatus.RESOLVED_SUCCEEDED,
    StepStatus.RESOLVED_FAILED,
}
# Sweeper findings that mean something was lost (a worker, a message); the rest is routine.
LOSSES = {"expired_leases", "lost_messages", "orphan_reservations", "lost_attempts_held"}


@dataclass
class StepReport:
    """What one engine task did, for its Celery result: the step it moved and where the run went."""

    run_id: str
    step: dict = field(default_factory=dict)
    run_status: str = ""

    def summary(self) -> dict:
        result = {"run": self.run_id, **self.step}
        if self.run_status:
            result["run_status"] = self.run_status
        if not self.step and not self.run_status:
            result["outcome"] = "nothing to do"  # waiting, ended, leased elsewhere, or a superseded message
        return result


_report: contextvars.ContextVar[StepReport | None] = contextvars.ContextVar(
    "agentplatform_step_report", default=None
)


@contextmanager
def step_scope(run_id):
    report = StepReport(str(run_id))
    token = _report.set(report)
    try:
        with logs.scope(run_id=str(run_id)):
            yield report
    finally:
        _report.reset(token)


def bind(
    *,
    tenant: str | None = None,
    step_seq: int | None = None,
    tool: str | None = None,
    evaluation: bool = False,
) -> None:
    """`evaluation`: the step is of an evaluation's run (evals/): logged and traced, but left out of
    the metrics of real work (steps, spend, tokens, latency, run transitions)."""
    logs.bind(tenant=tenant, step_seq=step_seq, tool=tool or None, evaluation=evaluation or None)


def _real_work() -> bool:
    return not logs.current().get("evaluation")


# --- transitions -----------------------------------------------------------------------------


def _tenant_of(run) -> str | None:
    """The tenant's slug if it is at hand (the engine's run carries its tenant); never a query."""
    if type(run).tenant.is_cached(run):
        return run.tenant.slug
    return logs.current().get("tenant")


def run_moved(run, old: str, to: str, *, reason: str = "", message: str = "") -> None:
    tenant, run_id = _tenant_of(run), str(run.pk)
    counted = not getattr(run, "evaluation", False)

    def committed() -> None:
        if counted:
            metrics.RUN_TRANSITIONS.labels(tenant or "", to, reason or "").inc()
        if to in WARN_RUN:
            what = WARN_RUN_WHAT.get(to, "run stopped by budget" if reason in BUDGET_STOPS else "run stopped")
            level = logging.WARNING
        else:
            what, level = "run", logging.INFO
        log.log(
            level,
            "%s: %s -> %s%s: %s",
            what,
            old,
            to,
            f" ({reason})" if reason else "",
            message,
            extra={
                "tenant": tenant,
                "run_id": run_id,
                "event": {"kind": "run_status", "from": old, "to": to, "reason": reason},
            },
        )
        report = _report.get()
        if report is not None and report.run_id == run_id:
            report.run_status = to

    transaction.on_commit(committed, robust=True)


def step_moved(step, old: str, to: str, *, error: str = "", message: str = "") -> None:
    run_id, seq, kind, tool = str(step.run_id), step.seq, step.kind, step.tool_name or None
    counted = _real_work()

    def committed() -> None:
        if to in OUTCOMES and counted:
            metrics.STEPS.labels(kind, tool or "", to).inc()
        level = logging.WARNING if to in WARN_STEP else logging.INFO
        what = "call denied" if to == StepStatus.DENIED else "step"
        log.log(
            level,
            "%s: %s",
            what,
            message or f"step {seq} {tool or kind}: {old} -> {to}",
            extra={
                "run_id": run_id,
                "step_seq": seq,
                "tool": tool,
                "event": {
                    "kind": "step_status",
                    "step_kind": kind,
                    "from": old,
                    "to": to,
                    **({"error": error} if error else {}),
                },
            },
        )
        report = _report.get()
        if report is not None and report.run_id == run_id and report.step.get("step") in (None, seq):
            report.step = {"step": seq, "kind": kind, **({"tool": tool} if tool else {}), "outcome": to}

    transaction.on_commit(committed, robust=True)


# --- calls -----------------------------------------------------------------------------------


class _Call:
    def __init__(self, span, kind: str):
        self.span = span
        self.kind = kind
        self.outcome = "succeeded"


class ModelCall(_Call):
    model = ""

    def replied(self, reply, cost_micros: int) -> None:
        usage = reply.usage
        self.span.set_attributes(
            {
                "gen_ai.usage.input_tokens": usage.total_input,
                "gen_ai.usage.output_tokens": usage.output_tokens,
                "gen_ai.usage.cache_read.input_tokens": usage.cached_input_tokens,
                "gen_ai.usage.cache_creation.input_tokens": usage.cache_write_tokens,
                "gen_ai.response.finish_reasons": [reply.stop_reason] if reply.stop_reason else [],
                "agentplatform.cost_micros": cost_micros,
                "agentplatform.tool_calls": len(reply.tool_calls),
            }
        )
        tenant = logs.current().get("tenant") or ""
        if not _real_work():
            return
        for kind, count in (
            ("input", usage.input_tokens),
            ("cached_input", usage.cached_input_tokens),
            ("cache_write", usage.cache_write_tokens),
            ("output", usage.output_tokens),
        ):
            if count:
                metrics.MODEL_TOKENS.labels(tenant, self.model, kind).inc(count)
        if cost_micros:
            metrics.SPEND.labels(tenant, "model").inc(cost_micros)


class ToolCall(_Call):
    def ended(self, outcome: str, *, price_micros: int = 0, error: str = "") -> None:
        """`outcome`: succeeded, failed, unknown or in_progress (runs.engine.ToolOutcome.kind)."""
        self.outcome = outcome
        self.span.set_attribute("agentplatform.step.outcome", outcome)
        if outcome != "succeeded":
            self.span.set_attribute("error.type", outcome)
            self.span.set_status(Status(StatusCode.ERROR, outcome))
        elif price_micros and _real_work():
            metrics.SPEND.labels(logs.current().get("tenant") or "", "tool").inc(price_micros)


@contextmanager
def _call(
    call_class,
    kind: str,
    name: str,
    *,
    run_id,
    seq: int,
    span_kind: SpanKind,
    attributes: dict,
    **call_fields,
):
    bound = logs.current()
    attributes = {
        **attributes,
        "gen_ai.conversation.id": str(run_id),
        "agentplatform.run.id": str(run_id),
        "agentplatform.step.seq": seq,
        "agentplatform.tenant": bound.get("tenant") or "",
    }
    started = time.perf_counter()
    with tracing.tracer().start_as_current_span(
        name,
        context=tracing.run_context(run_id),
        kind=span_kind,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        call = call_class(span, kind)
        for name_, value in call_fields.items():
            setattr(call, name_, value)
        try:
            yield call
        except BaseException as exc:
            # Provider errors say whether the request may have been received (`sent`, `status`):
            # no status after sending means the answer was lost, not that the call failed.
            status = getattr(exc, "status", None)
            call.outcome = "lost" if getattr(exc, "sent", False) and status is None else "failed"
            span.set_attribute("error.type", str(status) if status else type(exc).__name__)
            span.set_attribute("agentplatform.step.outcome", call.outcome)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        else:
            if kind == "model":
                span.set_attribute("agentplatform.step.outcome", call.outcome)
        finally:
            if _real_work():
                metrics.STEP_SECONDS.labels(kind, call.outcome).observe(time.perf_counter() - started)


def model_call(*, run_id, seq: int, endpoint, request):
    """Around one model call: a `chat {model}` client span (GenAI semantic conventions)."""
    bind(step_seq=seq)
    logs.bind(tool=None)
    model = endpoint.model or endpoint.name
    attributes = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": endpoint.kind,
        "gen_ai.system": endpoint.kind,
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": request.max_output_tokens,
    }
    if endpoint.base_url:
        url = urlparse(endpoint.base_url)
        attributes.update(
            {
                "server.address": url.hostname or "",
                "server.port": url.port or (443 if url.scheme == "https" else 80),
            }
        )
    return _call(
        ModelCall,
        "model",
        f"chat {model}",
        run_id=run_id,
        seq=seq,
        span_kind=SpanKind.CLIENT,
        attributes=attributes,
        model=model,
    )


def tool_call(step):
    """Around one tool call: an `execute_tool {tool}` span (GenAI semantic conventions).

    Reads only what the step already holds: the call runs with no database connection.
    """
    bind(step_seq=step.seq, tool=step.tool_name)
    attributes = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": step.tool_name,
        "gen_ai.tool.call.id": step.call_id,
        "agentplatform.step.attempt": step.attempts,
        "agentplatform.idempotency_key": step.idempotency_key,
    }
    if type(step).tool.is_cached(step) and step.tool is not None:
        attributes["agentplatform.tool.effect_class"] = step.tool.effect_class
        if type(step.tool).server.is_cached(step.tool):
            attributes["gen_ai.tool.type"] = "function" if step.tool.server.kind == "builtin" else "extension"
    return _call(
        ToolCall,
        "tool",
        f"execute_tool {step.tool_name}",
        run_id=step.run_id,
        seq=step.seq,
        span_kind=SpanKind.INTERNAL,
        attributes=attributes,
    )


# --- sweeper ---------------------------------------------------------------------------------


def engine_error(exc: BaseException) -> None:
    metrics.ENGINE_ERRORS.labels(type(exc).__name__).inc()
    report = _report.get()
    if report is not None:
        report.step = {
            **report.step,
            "outcome": "engine error",
            "error": f"{type(exc).__name__}: {exc}"[:500],
        }


def swept(found: dict[str, int]) -> dict[str, int]:
    """Count a sweeper pass; return only what it found (the task's result)."""
    metrics.SWEEPS.inc()
    found = {kind: count for kind, count in found.items() if count}
    for kind, count in found.items():
        metrics.SWEEPER_RECOVERIES.labels(kind).inc(count)
    if found:
        level = logging.WARNING if LOSSES & found.keys() else logging.INFO
        sweeper_log.log(
            level,
            "sweeper: %s",
            ", ".join(f"{kind}={count}" for kind, count in sorted(found.items())),
            extra={"event": {"kind": "sweep", **found}},
        )
    return found


def model_moved(run, before: str, after: str, reason: str) -> None:
    """A run's model call went to another endpoint of its chain than its previous one."""
    metrics.MODEL_FALLBACKS.labels(_tenant_of(run) or "", before, after, reason).inc()
    log.info("model call moved from %s to %s (%s)", before, after, reason)


def model_endpoint_call(endpoint, outcome: str, cost_micros: int = 0) -> None:
    """One model call's outcome at its endpoint (`outcome`: answered, or the failure class)."""
    tenant = logs.current().get("tenant") or ""
    if not _real_work():
        return
    metrics.MODEL_ENDPOINT_CALLS.labels(tenant, endpoint.name, outcome).inc()
    if cost_micros:
        metrics.MODEL_ENDPOINT_SPEND.labels(tenant, endpoint.name).inc(cost_micros)
