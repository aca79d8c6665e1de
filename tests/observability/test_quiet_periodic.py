"""Celery's INFO lines about a sweeper or notify pass that found nothing are dropped; the rest stay."""

from __future__ import annotations

import logging

from observability.logs import QuietPeriodicTasks


def record(level: int, **args) -> logging.LogRecord:
    made = logging.LogRecord("celery.app.trace", level, __file__, 1, "Task %(name)s", None, None)
    made.args = args
    return made


def test_it_drops_only_what_says_nothing_happened():
    keep = QuietPeriodicTasks().filter
    assert not keep(record(logging.INFO, name="runs.tasks.sweep", id="1"))  # received
    assert not keep(record(logging.INFO, name="runs.tasks.sweep", id="1", return_value="{}"))
    assert not keep(
        record(
            logging.INFO, name="notifications.tasks.notify", id="1", return_value="{'created': 0, 'sent': 0}"
        )
    )
    assert keep(record(logging.INFO, name="runs.tasks.sweep", id="1", return_value="{'requeued': ['a1b2']}"))
    assert keep(record(logging.ERROR, name="runs.tasks.sweep", id="1"))
    assert keep(record(logging.INFO, name="runs.tasks.advance_run", id="1"))
