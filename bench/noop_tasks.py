"""A raw Celery chain of no-op tasks: the ceiling of one-task-per-step on this broker and worker.

Each task enqueues the next one of its chain, like advance_run does, with the same delivery
options (acks_late, reject_on_worker_lost, no result). The last task of a chain pushes its
finish time to a Redis list that bench/engine.py waits on.
"""

from __future__ import annotations

import os
import time

from celery import shared_task
from django.conf import settings

_redis = None


def _client():
    global _redis
    if _redis is None:
        import redis

        # The finish list: a Redis of the benchmark's own when the broker is RabbitMQ (bench/peers.py).
        _redis = redis.Redis.from_url(os.environ.get("BENCH_REDIS_URL") or settings.CELERY_BROKER_URL)
    return _redis


@shared_task(name="bench.noop_step", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def noop_step(done_key: str, chain: int, remaining: int) -> None:
    if remaining > 1:
        noop_step.apply_async((done_key, chain, remaining - 1))
    else:
        _client().rpush(done_key, f"{chain} {time.time()}")


FLOOR_TABLE = "bench_floor"


def create_floor_table(chains: int) -> None:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(f"DROP TABLE IF EXISTS {FLOOR_TABLE}")
        cur.execute(
            f"CREATE TABLE {FLOOR_TABLE} (chain int PRIMARY KEY, step int NOT NULL DEFAULT 0,"
            " state text NOT NULL DEFAULT 'idle', lease uuid)"
        )
        cur.execute(f"INSERT INTO {FLOOR_TABLE} (chain) SELECT generate_series(0, %s)", [chains - 1])


@shared_task(name="bench.floor_step", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def floor_step(done_key: str, chain: int, remaining: int) -> None:
    """The least a durable step can do: three single-statement transactions, each its own commit.

    claim (take a lease), mark dispatching (committed before the call), record (fenced by the
    lease), with the connection handed back to the pool around the (empty) call, as the engine
    does. No model instances, no events, no budget: this is the floor under the engine, not a
    second engine.
    """
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            f"UPDATE {FLOOR_TABLE} SET lease = gen_random_uuid() WHERE chain = %s AND state = 'idle'"
            " RETURNING lease",
            [chain],
        )
        lease = cur.fetchone()[0]
        cur.execute(
            f"UPDATE {FLOOR_TABLE} SET state = 'dispatching' WHERE chain = %s AND lease = %s", [chain, lease]
        )
    connection.close()  # the call happens here, holding no connection
    with connection.cursor() as cur:
        cur.execute(
            f"UPDATE {FLOOR_TABLE} SET state = 'idle', step = step + 1, lease = NULL"
            " WHERE chain = %s AND lease = %s",
            [chain, lease],
        )
    connection.close()
    if remaining > 1:
        floor_step.apply_async((done_key, chain, remaining - 1))
    else:
        _client().rpush(done_key, f"{chain} {time.time()}")
