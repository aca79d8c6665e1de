"""The production Celery app, for benchmark workers: only the default queue changes.

BENCH_QUEUE gives the benchmark a private queue, so a test worker or another benchmark on the
same Redis database never takes (and loses) its messages, and its worker takes none of theirs.
"""
from __future__ import annotations

import os

from agentplatform.celery import app

__all__ = ["app"]

if os.environ.get("BENCH_QUEUE"):
    app.conf.task_default_queue = os.environ["BENCH_QUEUE"]

if os.environ.get("BENCH_SWITCH_INTERVAL"):
    import sys
    sys.setswitchinterval(float(os.environ["BENCH_SWITCH_INTERVAL"]))
