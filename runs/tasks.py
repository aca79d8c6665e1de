"""Thin Celery entry points: take ids, call services."""
from __future__ import annotations

import logging

from celery import shared_task
from django.db import InterfaceError, OperationalError, close_old_connections

log = logging.getLogger(__name__)


@shared_task(name="runs.tasks.advance_run", acks_late=True, reject_on_worker_lost=True, ignore_result=True,
             autoretry_for=(OperationalError, InterfaceError), retry_backoff=1, retry_backoff_max=30,
             max_retries=None)
def advance_run(run_id: str) -> None:
    """Perform at most one step of the run (database errors: retried; the claim makes it safe)."""
    from runs.engine import advance

    close_old_connections()
    advance(run_id)


@shared_task(name="runs.tasks.sweep", ignore_result=True)
def sweep() -> dict:
    from runs.sweeper import sweep as run_sweep

    close_old_connections()
    return run_sweep()
