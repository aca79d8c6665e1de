"""What the live run streams (runs/stream.py) wait on, and how they read, without a connection each.

PostgreSQL: a trigger on the events table (migration 0008) sends `NOTIFY run_events,
'<run_id>:<seq>'` when a batch of a run's events commits. One LISTEN connection per process
receives them and wakes the streams following that run; each woken stream reads its new rows
in two short queries through a small pool shared by all streams of the process
(RUN_STREAM_DB_POOL_MAX); the streams of one run woken together share one read. An idle stream holds no connection, no thread and no query, only an
asyncio.Event, so a process keeps thousands open.

A notification is a hint, never the data: streams read rows by `seq > last sent`, and the
events of one run commit in seq order (runs.transitions.write_events numbers them under the run's
row lock), so a late, duplicated or lost notification can delay an event, never skip or repeat
one. Notifications sent while the listener is not connected are lost; every stream re-reads
when it (re)connects.

Other databases (SQLite, the demo) have no LISTEN: `Feed.wait` then returns after
RUN_STREAM_POLL_SECONDS and the stream reads again, through the ORM on a pooled thread.

Everything here belongs to one event loop (uvicorn runs one per process); `feed()` gives the
current loop's.
"""

from __future__ import annotations

import asyncio
import logging
import types
import weakref

import psycopg
from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connections
from psycopg_pool import AsyncConnectionPool

from runs.models import Run, RunEvent

logger = logging.getLogger("agentplatform.runs.stream")

CHANNEL = "run_events"  # the trigger's channel (runs/migrations/0008_run_event_notify.py)
RECONNECT_MAX_SECONDS = 30


def listens() -> bool:
    """Whether streams are woken by NOTIFY (PostgreSQL) rather than by polling."""
    return connections["default"].vendor == "postgresql"


def _connect_params() -> dict:
    """Django's own connection parameters, for connections of our own (the same server and role)."""
    params = connections["default"].get_connection_params()
    for key in ("cursor_factory", "context", "prepare_threshold"):  # Django's adapters, not ours
        params.pop(key, None)
    return params


class Subscription:
    """One stream's wake-up: the highest seq notified for its run since it last looked."""

    def __init__(self, run_id: str, generation: int):
        self.run_id = run_id
        # Reads started at or after this generation of the feed see everything that woke this stream.
        self.generation = generation
        self.notified = 0
        self.reread = False  # read again whatever was notified (the listener (re)connected)
        self.woken = asyncio.Event()

    def wake(self, seq: int | None, generation: int) -> None:
        self.generation = generation
        if seq is None:
            self.reread = True
        else:
            self.notified = max(self.notified, seq)
        self.woken.set()


class Feed:
    """The process's LISTEN connection and the streams it wakes."""

    def __init__(self):
        self.subscribers: dict[str, set[Subscription]] = {}
        self.listener: asyncio.Task | None = None
        self.connected = asyncio.Event()
        # Counts deliveries (notifications, reconnections): a read started at generation g sees
        # every event whose notification was delivered by then.
        self.generation = 0
        self.reads: dict[tuple, tuple[int, asyncio.Future]] = {}
        self.pool: AsyncConnectionPool | None = None
        self.pool_opened: asyncio.Future | None = None

    def subscribe(self, run_id: str) -> Subscription:
        subscription = Subscription(str(run_id), self.generation)
        self.subscribers.setdefault(subscription.run_id, set()).add(subscription)
        if listens() and (self.listener is None or self.listener.done()):
            self.listener = asyncio.get_running_loop().create_task(self._listen(), name="run-events-listener")
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        followers = self.subscribers.get(subscription.run_id)
        if followers is not None:
            followers.discard(subscription)
            if not followers:
                del self.subscribers[subscription.run_id]

    async def wait(self, subscription: Subscription, *, after: int, timeout: float) -> bool:
        """Wait until events after `after` may exist (True) or `timeout` passes (False)."""
        if timeout <= 0:
            return False
        if not listens():
            await asyncio.sleep(min(timeout, settings.RUN_STREAM_POLL_SECONDS))
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(subscription.woken.wait(), remaining)
            except TimeoutError:
                return False
            subscription.woken.clear()
            reread, notified = subscription.reread, subscription.notified
            subscription.reread, subscription.notified = False, 0
            if reread or notified > after:  # an event this stream has not sent yet
                return True

    def wake_all(self) -> None:
        self.generation += 1
        for followers in self.subscribers.values():
            for subscription in followers:
                subscription.wake(None, self.generation)

    def dispatch(self, payload: str) -> None:
        run_id, _, seq = payload.partition(":")
        try:
            seq_number = int(seq)
        except ValueError:
            logger.warning("run stream: ignored a notification with payload %r", payload)
            return
        self.generation += 1
        for subscription in self.subscribers.get(run_id, ()):
            subscription.wake(seq_number, self.generation)

    async def close(self) -> None:
        """Stop listening and close the read pool (a loop that ends: tests, a server shutting down)."""
        if self.listener is not None:
            self.listener.cancel()
            await asyncio.gather(self.listener, return_exceptions=True)
        if self.pool is not None:
            await self.pool.close()

    async def _listen(self) -> None:
        """LISTEN for as long as the process lives; reconnect with backoff when the connection drops."""
        delay = 0.5
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(**_connect_params(), autocommit=True)
                async with conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    self.connected.set()
                    delay = 0.5
                    # Whatever committed before LISTEN took effect was never notified to us.
                    self.wake_all()
                    async for notification in conn.notifies():
                        self.dispatch(notification.payload)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("run stream listener: %s; reconnecting in %.1f s", exc, delay)
            self.connected.clear()
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_SECONDS)

    async def read(self, subscription: Subscription, *, after: int, limit: int) -> tuple[str | None, list]:
        """The run's status (None once deleted), then its events with seq > after, in order.

        Status first: every event committed before the status was read is then in the list, so a
        stream that sees a terminal status and an empty list has sent the run's last event.
        Streams of one run woken by one notification ask the same question at once: they share
        one read, provided it started after what woke them was delivered (else it could miss it).
        """
        key = (subscription.run_id, after, limit)
        started, read = self.reads.get(key, (-1, None))
        if read is None or started < subscription.generation:
            read = asyncio.ensure_future(self._read(subscription.run_id, after=after, limit=limit))
            self.reads[key] = (self.generation, read)

            def forget(done, key=key):
                if self.reads.get(key, (0, None))[1] is done:
                    del self.reads[key]

            read.add_done_callback(forget)
        return await asyncio.shield(read)

    async def _read(self, run_id: str, *, after: int, limit: int) -> tuple[str | None, list]:
        if not listens():
            return await sync_to_async(_read_orm, thread_sensitive=False)(run_id, after, limit)
        if self.pool is None:
            self.pool = AsyncConnectionPool(
                kwargs={**_connect_params(), "autocommit": True},
                min_size=1,
                max_size=settings.RUN_STREAM_DB_POOL_MAX,
                check=AsyncConnectionPool.check_connection,  # a PostgreSQL restart leaves dead ones
                name="run-stream",
                open=False,
            )
            self.pool_opened = asyncio.ensure_future(self.pool.open())
        await asyncio.shield(self.pool_opened)
        async with self.pool.connection() as conn:
            row = await (await conn.execute(_sql()["status"], (run_id,))).fetchone()
            rows = await (await conn.execute(_sql()["events"], (run_id, after, limit))).fetchall()
        return (row[0] if row else None), [_event(*r) for r in rows]


def _read_orm(run_id, after: int, limit: int) -> tuple[str | None, list]:
    status = Run.objects.filter(pk=run_id).values_list("status", flat=True).first()
    events = RunEvent.objects.filter(run_id=run_id, seq__gt=after).select_related("actor").order_by("seq")
    return status, list(events[:limit])


def _event(seq, at, kind, step_seq, actor, message, data):
    """A row in the shape the API's event serializer reads (runs.api.EventOutput)."""
    return types.SimpleNamespace(
        seq=seq,
        at=at,
        kind=kind,
        step_seq=step_seq,
        actor=types.SimpleNamespace(username=actor) if actor is not None else None,
        message=message,
        data=data,
    )


_statements: dict[str, str] = {}


def _sql() -> dict[str, str]:
    if not _statements:
        event, run, user = RunEvent._meta, Run._meta, get_user_model()._meta
        actor = event.get_field("actor").column
        run_id = event.get_field("run").column
        _statements["status"] = f'SELECT status FROM "{run.db_table}" WHERE id = %s'
        _statements["events"] = (
            f'SELECT e.seq, e.at, e.kind, e.step_seq, u.username, e.message, e.data FROM "{event.db_table}" e '
            f'LEFT JOIN "{user.db_table}" u ON u.id = e."{actor}" '
            f'WHERE e."{run_id}" = %s AND e.seq > %s ORDER BY e.seq LIMIT %s'
        )
    return _statements


_feeds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def feed() -> Feed:
    loop = asyncio.get_running_loop()
    if loop not in _feeds:
        _feeds[loop] = Feed()
    return _feeds[loop]
