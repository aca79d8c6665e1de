"""Thin Celery entry points of the run history."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from history.checkpoints import take_checkpoint
from history.retention import purge_due


@shared_task(name="history.tasks.checkpoint", ignore_result=True)
def checkpoint() -> int | None:
    """Sign a checkpoint over the runs' chain heads (none when no head moved); its number."""
    taken = take_checkpoint()
    return taken.number if taken else None


@shared_task(name="history.tasks.purge", ignore_result=True)
def purge() -> int:
    """Remove the content of runs whose retention period ended (a batch per tenant); how many."""
    return len(purge_due(batch=settings.HISTORY_PURGE_BATCH).purged)
