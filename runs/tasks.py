"""Thin Celery entry points: take ids, call services."""

from __future__ import annotations

import datetime as dt
import logging

from celery import shared_task
from django.db import InterfaceError, OperationalError, close_old_connections

from observability import observe
from runs.engine import advance
from runs.recovery.sweeper import sweep as run_sweep

log = logging.getLogger(__name__)


class StepNotSettled(Exception):
    """What the engine task raises after a step it could not settle: a tool call whose outcome is
    unknown (no answer within its timeout, or a worker lost mid-call), a run that now needs a
    person, or the engine's own error. The step is recorded either way; raising only makes the
    task's state FAILURE in Flower and the task events, with this message and the step's report,
    instead of a SUCCESS that hides it. Expected (the task's `throws`): the worker logs it at
    INFO without a traceback, and it is never retried (the run's state decides what comes next)."""

    def __init__(self, result: dict):
        self.result = result
        what = f"step {result['step']}" if "step" in result else "the run"
        if result.get("tool"):
            what += f" (tool {result['tool']})"
        outcome = str(result.get("outcome", "")).replace("_", " ")
        run = (
            f"; run {str(result.get('run_status', '')).replace('_', ' ')}" if result.get("run_status") else ""
        )
        super().__init__(f"{what}: {outcome or 'not settled'}{run}; {result}")

    def __reduce__(self):
        # Celery pickles a task's exception for its result and events: rebuilt from the report.
        return (type(self), (self.result,))


# What a step's report says when it did not plainly happen (observability/observe.py's StepReport).
UNSETTLED_OUTCOMES = {"outcome_unknown", "engine error", "lost"}


def unsettled(result) -> bool:
    return isinstance(result, dict) and (
        result.get("outcome") in UNSETTLED_OUTCOMES or result.get("run_status") == "needs_attention"
    )


@shared_task(
    name="runs.tasks.advance_run",
    acks_late=True,
    reject_on_worker_lost=True,
    ignore_result=True,
    autoretry_for=(OperationalError, InterfaceError),
    retry_backoff=1,
    retry_backoff_max=30,
    max_retries=None,
    throws=(StepNotSettled,),
)
def advance_run(run_id: str, enqueued_at: str | None = None) -> dict:
    """Perform at most one step of the run (database errors: retried; the claim makes it safe).

    The result says what happened (step, kind, tool, outcome, run status) and where the run's
    admin page is: Flower and the worker's log show it even though no result backend stores it.
    A step not settled (outcome unknown, a lost call, a run needing a person) ends the task as a
    FAILURE with StepNotSettled carrying the same report, never a plain SUCCESS.
    """
    close_old_connections()
    try:
        result = advance(run_id, enqueued_at=dt.datetime.fromisoformat(enqueued_at) if enqueued_at else None)
    except (OperationalError, InterfaceError) as exc:
        # Retried below (a database restart passes); said at WARNING because one that does not pass
        # (SQLite reports a statement it cannot run as an OperationalError too) leaves the run queued.
        log.warning("run %s: the database refused the step, retrying: %s", run_id, exc)
        raise
    if isinstance(result, dict):
        result = {**result, "admin": f"/admin/runs/run/{run_id}/change/"}
    if unsettled(result):
        raise StepNotSettled(result)
    return result


# send_events=False: a pass every few seconds would bury the engine's tasks in Flower. Its own
# queue (settings.SWEEP_QUEUE): a backlog of steps does not delay recovery. Counted in /metrics.
@shared_task(name="runs.tasks.sweep", ignore_result=True, send_events=False)
def sweep() -> dict:
    """One sweeper pass; the result lists only what it found."""
    close_old_connections()
    return observe.swept(run_sweep())
