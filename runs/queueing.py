"""The run's next message: one `advance_run` task sent after the transaction commits, carrying its
enqueue time so that an older duplicate is recognised and dropped by the claim; and the lease a
step's call holds while in flight."""

from __future__ import annotations

import math

from celery import current_app
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from runs.models import Run
from runs.transitions import update_row, write_run_columns_at_end


def enqueue(run_id, *, countdown: float | None = None, **fields) -> None:
    """Schedule one advance of the run after the current transaction commits.

    `fields` are written in the same UPDATE as last_enqueued_at (the engine clears its lease here).
    """
    now = timezone.now()
    if any(hasattr(v, "resolve_expression") for v in fields.values()):
        update_row(Run, run_id, last_enqueued_at=now, **fields)
    else:
        write_run_columns_at_end(run_id, {}, {"last_enqueued_at": now, **fields})  # with the events
    # The message carries its enqueue time: a message older than the run's latest enqueue is
    # superseded (the claim drops it), so duplicates never fork the run into two message chains.
    # robust: with the broker down the commit stands (a started run is not answered with a 500)
    # and the sweeper sends the message again later; the error is logged.
    transaction.on_commit(lambda: _publish(run_id, now, countdown), robust=True)


def resend(run_id, *, enqueued_at) -> None:
    """Send the run's last message again, unchanged: if the first copy was only slow, whichever
    copy arrives first moves the run, and the other is then older than the run's next message."""
    transaction.on_commit(lambda: _publish(run_id, enqueued_at, None), robust=True)


def _publish(run_id, enqueued_at, countdown: float | None) -> None:
    """Send the engine's task message, named rather than imported: runs/tasks.py imports the
    engine, which imports this module. The registered task object sends it (its options, and
    whatever wraps its apply_async), or the app by name where the worker's tasks were never imported.

    The task object itself, not a signature by name: a Signature costs a merge of options, a
    registry lookup and configuration reads on every publish (bench/publish_hop.py).
    """
    args = (str(run_id), enqueued_at.isoformat())
    if countdown and settings.CELERY_TASK_DEFAULT_QUEUE_TYPE == "quorum":
        # RabbitMQ's quorum queues delay a message through Celery's native delayed delivery, which
        # counts whole seconds: it truncates 1.7 s to 1 s and refuses 0 < countdown < 1 (a
        # ValueError, and the message is never sent). Rounding up keeps every wait at least as long
        # as the engine decided (a quota slot, a backoff), never shorter.
        countdown = float(math.ceil(countdown))
    task = current_app.tasks.get(ADVANCE_RUN)
    if task is not None:
        task.apply_async(args, countdown=countdown)
    else:
        current_app.send_task(ADVANCE_RUN, args, countdown=countdown)


ADVANCE_RUN = "runs.tasks.advance_run"


def lease_seconds_for(timeout: float) -> int:
    return int(timeout) + settings.LEASE_MARGIN_SECONDS


def continue_run(run: Run, *, countdown: float | None = None) -> None:
    enqueue(run.pk, countdown=countdown, lease_token=None, lease_expires_at=None)  # one UPDATE
