from __future__ import annotations

from celery import shared_task
from django.conf import settings
from django.db import close_old_connections

from notifications.services import scan, send_due


# Celery beat every NOTIFY_INTERVAL_SECONDS, on the sweeper's queue (settings.CELERY_TASK_ROUTES).
# send_events=False, like the sweeper: a pass every few seconds would bury the engine's tasks in Flower.
@shared_task(name="notifications.tasks.notify", ignore_result=True, send_events=False)
def notify() -> dict:
    """One pass: create the deliveries events call for, then send what is due for one interval."""
    close_old_connections()
    found = scan()
    sent = send_due(budget_seconds=settings.CELERY_BEAT_SCHEDULE["notify"]["schedule"])
    return {**found, **sent}
