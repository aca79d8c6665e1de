"""What follows when the engine's own code raises at a run's step (a bug, an illegal transition,
a constraint the data broke): never an endless loop of tasks that die the same way.

The failed task's transaction rolled back, so nothing of it is stored. This records the exception
(type and message) as a RunEvent, counts it on the run (`Run.engine_errors`, like a worker death
counts on its step), and sends the run's next message after a growing backoff; at
MAX_STEP_CRASHES the step in flight fails (or is left outcome_unknown, its charge held, when it
may have taken effect) and the run fails with the exception's text. A successful claim resets
the count. A live lease that is not this task's is left alone: its holder records as usual.
"""

from __future__ import annotations

import uuid

from django.db import close_old_connections
from django.utils import timezone

from observability import observe
from runs.engine import decisions, heartbeat, writer
from runs.engine.claim import tool_view, view_of_step
from runs.models import Run, Step, StepStatus
from runs.queueing import continue_run
from runs.transitions import atomic_with_events, lock_run, record_event, write_run_at_end

MAX_ERROR_TEXT = 4_000
BACKOFF_SECONDS = 2.0


def engine_failed(run_id, exc: BaseException, *, max_crashes: int, token: uuid.UUID | None = None) -> None:
    """Record that the engine raised at this run's step, and decide whether it goes on."""
    heartbeat.untrack(run_id)  # a lease this task held must not be kept alive by it
    observe.engine_error(exc)
    close_old_connections()
    text = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_TEXT]
    with atomic_with_events():
        try:
            run = lock_run(run_id)
        except Run.DoesNotExist:
            return
        if run.is_terminal:
            return
        now = timezone.now()
        live = run.lease_token is not None and run.lease_expires_at is not None and run.lease_expires_at > now
        if live and run.lease_token != token:
            record_event(
                run.pk,
                "engine_error",
                f"the engine raised at this step: {text}",
                exception=type(exc).__name__,
                error=text,
            )
            return
        count = run.engine_errors + 1
        record_event(
            run.pk,
            "engine_error",
            f"the engine raised at this step ({count} of {max_crashes}): {text}",
            exception=type(exc).__name__,
            error=text,
            count=count,
        )
        if count >= max_crashes:
            _fail(run, text, count)
            return
        write_run_at_end(run, engine_errors=count)
        if run.status in ("queued", "running"):
            continue_run(run, countdown=BACKOFF_SECONDS * 2 ** (count - 1))


def _fail(run: Run, text: str, count: int) -> None:
    step = Step.objects.select_related("tool").filter(run_id=run.pk, status=StepStatus.DISPATCHING).first()
    view = view_of_step(step) if step is not None else None
    tool = tool_view(step.tool) if step is not None and step.tool is not None else None
    decision = decisions.poison_for(
        view, tool, f"the engine failed {count} times at this step: {text}", engine=True
    )
    write_run_at_end(run, engine_errors=count)
    writer.poison(run, step, decision)
