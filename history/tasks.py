"""Thin Celery entry points of the run history."""

from __future__ import annotations

from celery import shared_task

from history.checkpoints import take_checkpoint


@shared_task(name="history.tasks.checkpoint", ignore_result=True)
def checkpoint() -> int | None:
    """Sign a checkpoint over the runs' chain heads (none when no head moved); its number."""
    taken = take_checkpoint()
    return taken.number if taken else None
