"""What the live run streams (runs/front/stream.py) wait on, and how they read, without a connection each.

PostgreSQL: a trigger on the events table (migrations 0008, 0009) sends `NOTIFY run_events,
'<run_id>:<seq>'` when a batch of events commits for a run someone streams. One LISTEN connection
per process receives them and wakes the streams following that run; each woken stream reads its
new rows in two short queries through a small pool shared by all streams of the process
(RUN_STREAM_DB_POOL_MAX); the streams of one run woken together share one read. An idle stream
holds no connection, no thread and no query, only an asyncio.Event, so a process keeps thousands
open.

Who streams what: every NOTIFY makes its committing transaction take PostgreSQL's cluster-wide
notify lock through the commit's flush, so the trigger notifies only for runs with a live row in
`runs_streamedrun` (run, process, lease_until). The feed writes a row for each run it follows
(`sync`: at once when a run gets its first stream, then every LEASE_SECONDS / 3 to renew the
leases and drop the runs nobody follows any more). A process that dies stops renewing; its rows
lapse after LEASE_SECONDS and the trigger ignores them. Registering locks the run's row FOR
SHARE, which waits for a step transaction holding it (every writer of events holds the run's row
until commit: runs.statements.write_run moves its counter in the INSERT's statement): a
transaction that wrote events before the registration committed had committed by then and the
woken stream reads its events; one after it sees the row (the trigger's query takes a new
snapshot) and notifies. A renewal that comes later than the lease registers again under the
same lock and wakes every stream to re-read: nothing notified meanwhile is missed.

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
import concurrent.futures
import logging
import types
import uuid
import weakref

import psycopg
from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connections
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from runs.models import Run, RunEvent
from vault.fields import SealedField

logger = logging.getLogger("agentplatform.runs.stream")

CHANNEL = "run_events"  # the trigger's channel (runs/migrations/0008_run_event_notify.py)
STREAMED = "runs_streamedrun"  # the runs someone streams (runs/migrations/0011_streamed_runs.py)
RECONNECT_MAX_SECONDS = 30
LEASE_SECONDS = 60.0  # how long a streamed run's row counts without renewal (renewed every third)


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
        # This feed's name in the streamed-runs table, the runs it holds a row for, when it last
        # renewed them (loop time at the start of the renewal: the leases run from a later instant).
        self.process = uuid.uuid4().hex
        self.registered: set[str] = set()
        self.renewed_at: float | None = None
        self.syncing = asyncio.Lock()
        self.keeper: asyncio.Task | None = None

    def subscribe(self, run_id: str) -> Subscription:
        subscription = Subscription(str(run_id), self.generation)
        first = subscription.run_id not in self.subscribers
        self.subscribers.setdefault(subscription.run_id, set()).add(subscription)
        if listens():
            loop = asyncio.get_running_loop()
            if self.listener is None or self.listener.done():
                self.listener = loop.create_task(self._listen(), name="run-events-listener")
            if self.keeper is None or self.keeper.done():
                self.keeper = loop.create_task(self._keep(), name="run-events-leases")
            elif first and subscription.run_id not in self.registered:
                loop.create_task(self.sync(), name="run-events-register")
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        followers = self.subscribers.get(subscription.run_id)
        if followers is not None:
            followers.discard(subscription)
            if not followers:
                del self.subscribers[subscription.run_id]

    async def wait(self, subscription: Subscription, *, after: int, timeout: float) -> bool:
        """Wait until events after `after`, or a newer status, may exist (True) or `timeout` passes (False)."""
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
            # Equal counts too: a read takes the run's status before its events, so a stream that
            # sent the notified event may hold a status older than that event's commit (the run's
            # last commit, say) and must read once more to see it.
            if reread or (notified and notified >= after):
                return True

    def wake_all(self) -> None:
        self.generation += 1
        for followers in self.subscribers.values():
            for subscription in followers:
                subscription.wake(None, self.generation)

    def wake_run(self, run_id: str) -> None:
        self.generation += 1
        for subscription in self.subscribers.get(run_id, ()):
            subscription.wake(None, self.generation)

    async def sync(self) -> None:
        """Make the streamed-runs table hold exactly the runs this feed follows, with fresh leases.

        Runs new to the table (or all, when the last renewal is older than a lease) are written
        under their row's share lock and their streams woken to re-read (the module's docstring
        says why that misses nothing); the rest are renewed; runs nobody follows are dropped.
        """
        async with self.syncing:
            loop = asyncio.get_running_loop()
            started = loop.time()
            wanted = set(self.subscribers)
            lapsed = self.renewed_at is None or started - self.renewed_at > LEASE_SECONDS * 0.9
            fresh = sorted(wanted if lapsed else wanted - self.registered)
            renew = sorted(set() if lapsed else wanted & self.registered)
            gone = sorted(self.registered - wanted)
            pool = await self._pool()
            async with pool.connection() as conn:
                if gone:
                    await conn.execute(_sql()["drop"], (self.process, gone))
                if renew:
                    await conn.execute(_sql()["renew"], (LEASE_SECONDS, self.process, renew))
                if fresh:
                    await conn.execute(_sql()["register"], (fresh, self.process, LEASE_SECONDS))
                # Rows of processes that died long ago: nothing else removes them.
                await conn.execute(_sql()["expired"], (LEASE_SECONDS,))
            self.registered = wanted
            self.renewed_at = started
            for run_id in fresh:
                self.wake_run(run_id)

    async def _keep(self) -> None:
        """Register and renew for as long as the feed lives; retry soon after a failure."""
        while True:
            try:
                await self.sync()
                delay = LEASE_SECONDS / 3
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("run stream leases: %s; retrying", exc)
                delay = 1.0
            await asyncio.sleep(delay)

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
        """Stop listening, drop this feed's streamed runs, close the read pool (a loop that ends:
        tests, a server shutting down)."""
        for task in (self.listener, self.keeper):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self.pool is not None:
            if self.registered:
                try:
                    async with self.pool.connection(timeout=5) as conn:
                        await conn.execute(_sql()["drop"], (self.process, sorted(self.registered)))
                except (psycopg.Error, PoolTimeout) as exc:  # the leases lapse by themselves
                    logger.warning("run stream leases: cannot drop them on close (%s)", exc)
            await self.pool.close()

    async def _listen(self) -> None:
        """LISTEN for as long as the process lives; reconnect with backoff when the connection drops."""
        delay = 0.5
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(**_connect_params(), autocommit=True)
                async with conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    # The trigger notifies only runs in the table: the streams' runs are there first.
                    await self.sync()
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
        pool = await self._pool()
        async with pool.connection() as conn:
            row = await (await conn.execute(_sql()["status"], (run_id,))).fetchone()
            rows = await (await conn.execute(_sql()["events"], (run_id, after, limit))).fetchall()
        # Opened in the one opener thread: a run's key may have to be read from the key store
        # (vault/store.py: a connection a thread), which the event loop must not wait on.
        events = await asyncio.get_running_loop().run_in_executor(_OPENER, _events, rows)
        return (row[0] if row else None), events

    async def _pool(self) -> AsyncConnectionPool:
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
        assert self.pool_opened is not None  # set with the pool
        await asyncio.shield(self.pool_opened)
        return self.pool


def _read_orm(run_id, after: int, limit: int) -> tuple[str | None, list]:
    status = Run.objects.filter(pk=run_id).values_list("status", flat=True).first()
    events = RunEvent.objects.filter(run_id=run_id, seq__gt=after).select_related("actor").order_by("seq")
    return status, list(events[:limit])


def _events(rows) -> list:
    """The rows in the shape the API's event serializer reads (runs.front.api.EventOutput), their
    sealed message and data opened (vault/fields.py)."""
    return [_event(*row) for row in rows]


def _event(seq, at, kind, step_seq, actor, message, data, skeleton):
    opened = _DATA.open(data)
    return types.SimpleNamespace(
        seq=seq,
        at=at,
        kind=kind,
        step_seq=step_seq,
        actor=types.SimpleNamespace(username=actor) if actor is not None else None,
        message=_MESSAGE.open(message),
        details={**skeleton, **opened},
    )


_OPENER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stream-open")
_MESSAGE, _DATA = RunEvent._meta.get_field("message"), RunEvent._meta.get_field("data")
assert isinstance(_MESSAGE, SealedField) and isinstance(_DATA, SealedField)


_statements: dict[str, str] = {}


def _sql() -> dict[str, str]:
    if not _statements:
        event, run, user = RunEvent._meta, Run._meta, get_user_model()._meta
        actor = event.get_field("actor").column
        run_id = event.get_field("run").column
        _statements["status"] = f'SELECT status FROM "{run.db_table}" WHERE id = %s'
        _statements["events"] = (
            f'SELECT e.seq, e.at, e.kind, e.step_seq, u.username, e.message, e.data, e.skeleton FROM "{event.db_table}" e '
            f'LEFT JOIN "{user.db_table}" u ON u.id = e."{actor}" '
            f'WHERE e."{run_id}" = %s AND e.seq > %s ORDER BY e.seq LIMIT %s'
        )
        # The share lock waits for a step transaction holding the run (see the module's docstring);
        # in id order, as every locker of several runs.
        _statements["register"] = (
            f'WITH locked AS (SELECT id FROM "{run.db_table}" WHERE id = ANY(%s::uuid[]) ORDER BY id FOR SHARE) '
            f'INSERT INTO "{STREAMED}" (run_id, process, lease_until) '
            f"SELECT id, %s, now() + make_interval(secs => %s) FROM locked "
            f"ON CONFLICT (run_id, process) DO UPDATE SET lease_until = EXCLUDED.lease_until"
        )
        _statements["renew"] = (
            f'UPDATE "{STREAMED}" SET lease_until = now() + make_interval(secs => %s) '
            f"WHERE process = %s AND run_id = ANY(%s::uuid[])"
        )
        _statements["drop"] = f'DELETE FROM "{STREAMED}" WHERE process = %s AND run_id = ANY(%s::uuid[])'
        _statements["expired"] = (
            f'DELETE FROM "{STREAMED}" WHERE lease_until < now() - make_interval(secs => %s)'
        )
    return _statements


_feeds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def feed() -> Feed:
    loop = asyncio.get_running_loop()
    if loop not in _feeds:
        _feeds[loop] = Feed()
    return _feeds[loop]
