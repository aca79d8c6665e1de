"""Thin Celery entry points of evaluations."""

from __future__ import annotations

from celery import shared_task

from evals import canary, services


@shared_task(name="evals.tasks.execute", ignore_result=True)
def execute(evaluation_id: str) -> None:
    """Run a queued evaluation's cases (nothing when another worker has it already)."""
    services.execute(evaluation_id)


@shared_task(
    name="evals.tasks.watch_canaries", ignore_result=True, send_events=False
)  # housekeeping: not in Flower
def watch_canaries() -> list[str]:
    """Compare every canary with its stable version; roll back those past their thresholds."""
    return canary.watch()
