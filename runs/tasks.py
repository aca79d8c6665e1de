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


@shared_task(
    name="runs.tasks.advance_run",
    acks_late=True,
    reject_on_worker_lost=True,
    ignore_result=True,
    autoretry_for=(OperationalError, InterfaceError),
    retry_backoff=1,
    retry_backoff_max=30,
    max_retries=None,
)
def advance_run(run_id: str, enqueued_at: str | None = None) -> dict:
    """Perform at most one step of the run (database errors: retried; the claim makes it safe).

    The result says what happened (step, kind, tool, outcome, run status) and where the run's
    admin page is: Flower and the worker's log show it even though no result backend stores it.
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
    return result


# send_events=False: a pass every few seconds would bury the engine's tasks in Flower. Its own
# queue (settings.SWEEP_QUEUE): a backlog of steps does not delay recovery. Counted in /metrics.
@shared_task(name="runs.tasks.sweep", ignore_result=True, send_events=False)
def sweep() -> dict:
    """One sweeper pass; the result lists only what it found."""
    close_old_connections()
    return observe.swept(run_sweep())
