"""Thin Celery entry points: the keeper's pass (every REGION_TEND_SECONDS) and the heartbeat."""

from __future__ import annotations

from celery import shared_task

from regions import services


@shared_task(
    name="regions.tasks.tend_slices", ignore_result=True, send_events=False
)  # as the sweeper: not in Flower
def tend_slices() -> None:
    """Ask the homes for slices, give back what is not needed, resume runs parked for a slice.

    Quiet in a deployment with no regions, and for tenants at home here.
    """
    services.tend_all()


@shared_task(name="regions.tasks.heartbeat", ignore_result=True, send_events=False)
def heartbeat() -> None:
    """This region's heartbeat row: the watermark the other regions read their copy's age by."""
    services.beat()
