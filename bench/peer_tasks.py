"""Loaded into bench/peers.py's Celery workers with `-I`: the plain chain, and the statement counter.

The plain Celery chain is the agent loop with no durability at all: one task per step (a
model call or a tool call over HTTP, bench/peer_agent.py), the conversation carried in the
message, each task enqueueing the next with the engine's delivery options (acks_late,
reject_on_worker_lost, no result). A lost message loses the run; nothing is written anywhere.
The last task of a run checks it and pushes "<run> <finish time>" to a Redis list.

When BENCH_SQLCOUNT_FILE is set (bench/peers.py sets it for every worker it starts, engine or
chain), this process counts the SQL statements it sends (bench/sqlcount.py) and writes the
counts to that file when it exits.
"""

from __future__ import annotations

import os
import threading
import time

from celery import shared_task
from django.conf import settings

from bench import peer_agent, sqlcount

if os.environ.get("BENCH_SQLCOUNT_FILE"):
    sqlcount.install()
    sqlcount.write_at_exit(os.environ["BENCH_SQLCOUNT_FILE"])

_lock = threading.Lock()
_shared: dict[str, object] = {}


def shared_client():
    """One HTTP client per worker process (the floor's tasks use it too: bench/peer_floor.py)."""
    with _lock:
        if "http" not in _shared:
            _shared["http"] = peer_agent.make_client()
        return _shared["http"]


def shared_redis():
    with _lock:
        if "redis" not in _shared:
            import redis

            _shared["redis"] = redis.Redis.from_url(
                os.environ.get("BENCH_REDIS_URL") or settings.CELERY_BROKER_URL
            )
        return _shared["redis"]


@shared_task(name="bench.peer_chain_step", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def chain_step(done_key: str, run: int, model_url: str, tool_url: str, messages: list, steps: int) -> None:
    try:
        call = peer_agent.pending_call(messages)
        if call is not None:
            key = f"chain-{done_key}-{run}-{len(messages)}"
            messages.append(peer_agent.tool_turn(shared_client(), tool_url, call, key))
        else:
            messages.append(peer_agent.model_turn(shared_client(), model_url, messages))
        if peer_agent.is_done(messages):
            peer_agent.check_run(messages, steps)
    except peer_agent.StepFailed as exc:
        # No retry and no durability: the run is lost, and the benchmark is told why.
        shared_redis().rpush(done_key, f"{run} ERROR {exc}")
        return
    if peer_agent.is_done(messages):
        shared_redis().rpush(done_key, f"{run} {time.time()}")
    else:
        chain_step.apply_async((done_key, run, model_url, tool_url, messages, steps))
