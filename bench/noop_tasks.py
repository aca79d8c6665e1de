"""A raw Celery chain of no-op tasks: the ceiling of one-task-per-step on this broker and worker.

Each task enqueues the next one of its chain, like advance_run does, with the same delivery
options (acks_late, reject_on_worker_lost, no result). The last task of a chain pushes its
finish time to a Redis list that bench/engine.py waits on.
"""
from __future__ import annotations

import time

from celery import shared_task
from django.conf import settings

_redis = None


def _client():
    global _redis
    if _redis is None:
        import redis
        _redis = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    return _redis


@shared_task(name="bench.noop_step", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def noop_step(done_key: str, chain: int, remaining: int) -> None:
    if remaining > 1:
        noop_step.apply_async((done_key, chain, remaining - 1))
    else:
        _client().rpush(done_key, f"{chain} {time.time()}")
