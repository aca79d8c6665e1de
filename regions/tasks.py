"""Thin Celery entry point: the slice keeper's pass (beat, every REGION_TEND_SECONDS)."""

from __future__ import annotations

from celery import shared_task

from regions import services


@shared_task(name="regions.tasks.tend_slices", ignore_result=True)
def tend_slices() -> None:
    """Ask the homes for slices, give back what is not needed, resume runs parked for a slice.

    Quiet in a deployment with no regions, and for tenants at home here.
    """
    services.tend_all()
