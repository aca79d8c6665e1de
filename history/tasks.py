"""Thin Celery entry points of the run history."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from history.checkpoints import take_checkpoint
from history.partitions import ensure_months
from history.retention import purge_due, purge_skeletons
from history.shredding import shred_forgotten
from history.subjects import index_due


@shared_task(
    name="history.tasks.checkpoint", ignore_result=True, send_events=False
)  # housekeeping: not in Flower
def checkpoint() -> int | None:
    """Sign a checkpoint over the runs' chain heads (none when no head moved); its number."""
    taken = take_checkpoint()
    return taken.number if taken else None


@shared_task(name="history.tasks.purge", ignore_result=True, send_events=False)  # housekeeping: not in Flower
def purge() -> int:
    """Remove the content of runs whose content period ended, then delete the runs whose skeleton
    period ended (a batch per tenant each); how many runs were touched."""
    content = purge_due(batch=settings.HISTORY_PURGE_BATCH)
    skeletons = purge_skeletons(batch=settings.HISTORY_PURGE_BATCH)
    return len(content.purged) + len(skeletons.purged)


@shared_task(name="history.tasks.shred_keys", ignore_result=True, send_events=False)  # not in Flower
def shred_keys() -> int:
    """Destroy the content keys of runs whose content is gone that are still in the key store
    (history/shredding.py); how many."""
    return shred_forgotten()


@shared_task(name="history.tasks.prepare_partitions", ignore_result=True, send_events=False)  # not in Flower
def prepare_partitions() -> int:
    """Make the month partitions of the coming months (history/partitions.py); how many."""
    return len(ensure_months(ahead=settings.HISTORY_PARTITION_MONTHS_AHEAD))


@shared_task(name="history.tasks.index_subjects", ignore_result=True, send_events=False)  # not in Flower
def index_subjects() -> int:
    """Index the words of ended runs the data subject search's index does not cover yet
    (history/subjects.py); how many runs."""
    return index_due(batch=settings.HISTORY_SUBJECT_INDEX_BATCH)
