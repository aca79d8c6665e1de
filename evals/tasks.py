"""Thin Celery entry points of evaluations."""

from __future__ import annotations

from celery import shared_task

from evals import services


@shared_task(name="evals.tasks.execute", ignore_result=True)
def execute(evaluation_id: str) -> None:
    """Run a queued evaluation's cases (nothing when another worker has it already)."""
    services.execute(evaluation_id)
