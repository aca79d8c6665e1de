"""Run-correlated log lines: the engine binds tenant, run id, step seq and tool to the context it
works in; a filter on the handler copies them onto every record written meanwhile.

Context variables, not thread-locals: each Celery task (a thread of the threads pool) and each
request sees only what it bound, and `scope` puts back what was there before when it ends.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import json
import logging
import re
from contextlib import contextmanager
from typing import Any

FIELDS = ("tenant", "run_id", "step_seq", "tool")
_context: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "agentplatform_log_context", default=None
)


@contextmanager
def scope(**fields):
    """A fresh context for one unit of work (one engine step); what is bound inside ends with it."""
    token = _context.set({name: value for name, value in fields.items() if value is not None})
    try:
        yield
    finally:
        _context.reset(token)


def bind(**fields) -> None:
    """Add fields to the current scope. Outside one it does nothing: nothing leaks into later work."""
    current = _context.get()
    if current is not None:
        _context.set({**current, **{name: value for name, value in fields.items() if value is not None}})


def current() -> dict:
    return dict(_context.get() or {})


class RunContextFilter(logging.Filter):
    """Copy the bound fields onto the record, unless the caller passed them itself (`extra=`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        bound = _context.get() or {}
        for name in FIELDS:
            if getattr(record, name, None) is None:
                setattr(record, name, bound.get(name))
        return True


# The periodic passes (the sweeper, webhook notifications) run every few seconds; at INFO Celery
# logged four lines a pass ("received", "succeeded: {}") that say nothing happened.
PERIODIC_TASKS = {"runs.tasks.sweep", "notifications.tasks.notify"}
NOTHING_DONE = re.compile(r"^(None|\{\}|\{('[a-z_]+': (0|\[\]|\{\}))(, '[a-z_]+': (0|\[\]|\{\}))*\})$")


class QuietPeriodicTasks(logging.Filter):
    """Drop Celery's INFO lines about a periodic pass that found nothing; a pass that did
    something (its result lists it) and every warning or error still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO or not isinstance(record.args, dict):
            return True
        if record.args.get("name") not in PERIODIC_TASKS:
            return True
        if "return_value" not in record.args:  # "Task … received"
            return False
        return not NOTHING_DONE.match(str(record.args["return_value"]))


class PlainFormatter(logging.Formatter):
    """`time LEVEL logger message [tenant=… run=… step=… tool=…]`, the bracket only where known."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        known = [
            f"{label}={value}"
            for label, value in (
                ("tenant", getattr(record, "tenant", None)),
                ("run", getattr(record, "run_id", None)),
                ("step", getattr(record, "step_seq", None)),
                ("tool", getattr(record, "tool", None)),
            )
            if value
        ]
        if not known:
            return line
        head, sep, trace = line.partition("\n")  # keep a traceback after the bracket
        return f"{head} [{' '.join(known)}]{sep}{trace}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line; the four run fields are always present (null when unknown)."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            data[name] = str(value) if name == "run_id" and value is not None else value
        event = getattr(record, "event", None)
        if event:
            data["event"] = event
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str, ensure_ascii=False)
