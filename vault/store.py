"""The key store: one row a run, `(run_id, tenant, wrapped key)`, in a database of its own.

Why apart: a key kept in the platform's database would be in every dump and backup beside the
content it seals, and destroying it there would not reach them. CONTENT_KEYS_DATABASE_URL names
the store; unset, it is the platform's database server with `_keys` appended to the database's
name (PostgreSQL), or a `-keys` file beside the SQLite file (the demo). Production should put it
on a server whose backups are kept only as long as the erasure deadline promised
(docs/history.md). The table is made on first use.

A process shares a small pool of connections to it (CONTENT_KEYS_POOL_MAX, 4), in autocommit:
every call is one statement, and the platform's transactions never wait on a lock here. Not one
connection a thread: a worker of 128 threads would hold 128 (each thread's first step of a run
whose key the process has not cached opened one), and with the platform's own pool they took
every connection the server allows (bench/peers.py on RabbitMQ: 77 key store connections, and
runs left queued). Keys are cached by the process (vault/sealing.py), so a few connections serve
it; a thread waits at most CONTENT_KEYS_POOL_TIMEOUT seconds for one, then 503. The SQLite store
(the demo) keeps one connection a thread.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
from django.conf import settings
from django.db import connection

from core.errors import DomainError

log = logging.getLogger(__name__)
_local = threading.local()  # the SQLite store's connection, one a thread
_pools: dict[tuple[int, str], _Pool] = {}  # by (process, location)
_pools_lock = threading.Lock()
TABLE = (
    "CREATE TABLE IF NOT EXISTS content_keys ("
    " run_id varchar(36) PRIMARY KEY, tenant varchar(64) NOT NULL, wrapped {blob} NOT NULL,"
    " created_at {time} NOT NULL DEFAULT CURRENT_TIMESTAMP)"
)


# A run's wrapped key, unless it holds one: a key is never replaced (two writers agree on the first).
INSERT_ONE = (
    "INSERT INTO content_keys (run_id, tenant, wrapped) VALUES (%s, %s, %s) ON CONFLICT (run_id) DO NOTHING"
)


class KeyStoreUnavailable(DomainError):
    """The key store cannot be reached: sealed content can be neither written nor read (503)."""

    def __init__(self, message: str):
        super().__init__(message, code="key_store_unavailable", status=503)


def location() -> str:
    """Where the store is: a postgres:// URL or a SQLite file's path."""
    if settings.CONTENT_KEYS_DATABASE_URL:
        return settings.CONTENT_KEYS_DATABASE_URL
    s = connection.settings_dict  # read now: tests switch it to their own database
    if connection.vendor == "sqlite":
        path = Path(s["NAME"])
        return str(path.with_name(f"{path.stem}-keys{path.suffix or '.sqlite3'}"))
    user = quote(s["USER"] or "", safe="") + (
        f":{quote(s['PASSWORD'], safe='')}" if s.get("PASSWORD") else ""
    )
    return f"postgresql://{user}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}_keys"


def _is_pg(where: str) -> bool:
    return where.startswith(("postgres://", "postgresql://"))


def _connect(where: str) -> Any:
    if not _is_pg(where):
        lite = sqlite3.connect(where, isolation_level=None, timeout=30, check_same_thread=False)
        lite.execute(TABLE.format(blob="blob", time="text"))
        return lite
    url = where.replace("postgres://", "postgresql://", 1)
    try:
        conn = psycopg.connect(url, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        if "does not exist" not in str(exc):
            raise
        _create_database(url)
        conn = psycopg.connect(url, autocommit=True, connect_timeout=5)
    try:
        conn.execute(TABLE.format(blob="bytea", time="timestamptz"))
    except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateObject, psycopg.errors.DuplicateTable):
        # Made by another connection at the same moment (IF NOT EXISTS does not cover that race:
        # the loser fails on the catalog's unique index, once the winner has committed).
        pass
    return conn


def _create_database(url: str) -> None:
    """The store's database, made beside the others on first use (the role needs CREATEDB; else an
    operator makes it: docs/history.md)."""
    admin_url, name = _server(url)
    with psycopg.connect(admin_url, autocommit=True) as admin:
        try:
            admin.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
        except (psycopg.errors.DuplicateDatabase, psycopg.errors.UniqueViolation):
            # Another process made it first, or is making it at this moment (the catalog's unique
            # index answers the second: fifty runs sealing their first input at once in a new region).
            pass


def _server(url: str) -> tuple[str, str]:
    """The server's maintenance database, and the store's database's name."""
    info = psycopg.conninfo.conninfo_to_dict(url)
    name = str(info.pop("dbname"))
    return psycopg.conninfo.make_conninfo("", **{**info, "dbname": "postgres"}), name


class _Pool:
    """At most `size` connections to one store, shared by a process's threads, made when first
    needed. A connection lost (the store's server restarted) takes the idle ones with it: they
    went with the same restart, and the retry must make a new one, not take another dead one. No
    background thread and no check round trip (psycopg_pool has both): keys are cached by the
    process, so the store is asked rarely."""

    def __init__(self, url: str, size: int, timeout: float):
        self.url, self.timeout = url, timeout
        self.slots = threading.BoundedSemaphore(size)
        self.idle: list[psycopg.Connection] = []
        self.lock = threading.Lock()
        self.closed = False  # close(): a connection in use then is closed when given back

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        if not self.slots.acquire(timeout=self.timeout):
            raise KeyStoreBusy(f"no key store connection free within {self.timeout} s")
        try:
            with self.lock:
                conn = self.idle.pop() if self.idle else None
            if conn is None:
                conn = psycopg.connect(self.url, autocommit=True, connect_timeout=5)
            try:
                yield conn
            except (psycopg.OperationalError, psycopg.InterfaceError):
                _close(conn)
                self.close_idle()
                raise
            except BaseException:
                _close(conn)
                raise
            with self.lock:
                keep = not self.closed
                if keep:
                    self.idle.append(conn)
            if not keep:
                _close(conn)
        finally:
            self.slots.release()

    def close_idle(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for conn in idle:
            _close(conn)

    def close(self) -> None:
        """No connection kept from now on: the idle ones now, those in use when given back."""
        with self.lock:
            self.closed = True
        self.close_idle()


class KeyStoreBusy(Exception):
    """Every connection of the process's pool stayed taken for the pool's timeout."""


def _pool(where: str) -> _Pool:
    """This process's pool of connections to the store at `where`, made (with the store's database
    and table) on first use."""
    key = (os.getpid(), where)  # a forked child makes its own: the parent's connections are not its own
    pool = _pools.get(key)
    if pool is not None:
        return pool
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            try:
                _close(_connect(where))  # the database and its table, made once
            except psycopg.Error as exc:
                raise _unavailable(exc) from None
            pool = _Pool(
                where.replace("postgres://", "postgresql://", 1),
                settings.CONTENT_KEYS_POOL_MAX,
                settings.CONTENT_KEYS_POOL_TIMEOUT,
            )
            _pools[key] = pool
    return pool


def _sqlite(where: str) -> Any:
    held = getattr(_local, "held", None)
    if held is not None and held[0] == where:
        return held[1]
    if held is not None:
        _close(held[1])
    try:
        conn = _connect(where)
    except sqlite3.Error as exc:
        raise _unavailable(exc) from None
    _local.held = (where, conn)
    return conn


def _unavailable(exc: Exception) -> KeyStoreUnavailable:
    log.warning("content key store unreachable: %s", exc)  # where, and why: not for API callers
    return KeyStoreUnavailable("the content key store cannot be reached; try again later")


def _close(conn) -> None:
    try:
        conn.close()
    except Exception:  # already broken: nothing to release
        pass


def _once(where: str, sql: str, params: tuple, fetch: bool):
    if not _is_pg(where):
        conn = _sqlite(where)
        try:
            cursor = conn.execute(sql.replace("%s", "?"), params)
        except sqlite3.OperationalError:
            _close(conn)
            _local.held = None
            raise
        return cursor.fetchall() if fetch else cursor.rowcount
    with _pool(where).connection() as conn:
        cursor = conn.execute(sql, params)
        return cursor.fetchall() if fetch else cursor.rowcount


def _run(sql: str, params: tuple, fetch: bool):
    """One statement, once more on another connection if the first broke (a restart)."""
    where = location()
    for attempt in (1, 2):
        try:
            return _once(where, sql, params, fetch)
        except KeyStoreBusy as exc:  # waited its time already: no second wait
            raise _unavailable(exc) from None
        except (psycopg.OperationalError, psycopg.InterfaceError, sqlite3.OperationalError) as exc:
            if attempt == 2:
                raise _unavailable(exc) from None
    raise AssertionError("unreachable")


def put(run_id, tenant, wrapped: bytes) -> bytes:
    """Store the run's wrapped key unless it has one; the one it has (two writers agree). One
    round trip when this one is stored (a new run's), a second to read another writer's."""
    if _run(f"{INSERT_ONE} RETURNING run_id", (str(run_id), str(tenant), wrapped), fetch=True):
        return wrapped
    found = get(run_id)
    if found is None:  # destroyed between the two statements: the run's content is being erased
        raise KeyDestroyed(run_id)
    return found


def put_many(rows: list[tuple[str, str, bytes]]) -> set[str]:
    """Store (run id, tenant, wrapped key) rows in one statement, none replacing a key a run holds;
    the run ids stored."""
    if not rows:
        return set()
    if _is_pg(location()):
        found = _run(
            "INSERT INTO content_keys (run_id, tenant, wrapped) SELECT * FROM unnest(%s::text[], %s::text[], "
            "%s::bytea[]) ON CONFLICT (run_id) DO NOTHING RETURNING run_id",
            tuple(list(column) for column in zip(*rows, strict=True)),
            fetch=True,
        )
        return {r[0] for r in found}
    stored = set()
    for run_id, tenant, wrapped in rows:
        if _run(
            INSERT_ONE,
            (run_id, tenant, wrapped),
            fetch=False,
        ):
            stored.add(run_id)
    return stored


def get(run_id) -> bytes | None:
    found = held(run_id)
    return found[0] if found is not None else None


def held(run_id) -> tuple[bytes, str] | None:
    """The run's wrapped key and the tenant it was wrapped for (a sealed column value names only
    its run: vault/fields.py), or None."""
    rows = _run("SELECT wrapped, tenant FROM content_keys WHERE run_id = %s", (str(run_id),), fetch=True)
    return (bytes(rows[0][0]), rows[0][1]) if rows else None


def destroy(run_ids) -> int:
    """Delete the runs' keys; how many there were."""
    ids = [str(r) for r in run_ids]
    if not ids:
        return 0
    marks = ", ".join(["%s"] * len(ids))
    return _run(f"DELETE FROM content_keys WHERE run_id IN ({marks})", tuple(ids), fetch=False)


def destroy_older(run_ids, before) -> int:
    """Delete those of the runs' keys made before `before` (an aware datetime); how many."""
    ids = [str(r) for r in run_ids]
    if not ids:
        return 0
    marks = ", ".join(["%s"] * len(ids))
    cutoff = before if _is_pg(location()) else before.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
    return _run(
        f"DELETE FROM content_keys WHERE run_id IN ({marks}) AND created_at < %s", (*ids, cutoff), fetch=False
    )


def page(after: str, limit: int) -> list[str]:
    """Run ids holding a key, in order, after `after`: for the pass that destroys forgotten keys."""
    rows = _run(
        "SELECT run_id FROM content_keys WHERE run_id > %s ORDER BY run_id LIMIT %s",
        (after, limit),
        fetch=True,
    )
    return [r[0] for r in rows]


def wrapped_page(after: str, limit: int) -> list[tuple[str, str, bytes]]:
    """(run id, tenant, wrapped key) in run id order after `after`: for rewrapping."""
    rows = _run(
        "SELECT run_id, tenant, wrapped FROM content_keys WHERE run_id > %s ORDER BY run_id LIMIT %s",
        (after, limit),
        fetch=True,
    )
    return [(r[0], r[1], bytes(r[2])) for r in rows]


def rewrap(run_id: str, old: bytes, new: bytes) -> bool:
    """Replace the run's wrapped key if it is still `old` (not destroyed or rewrapped meanwhile)."""
    return (
        _run(
            "UPDATE content_keys SET wrapped = %s WHERE run_id = %s AND wrapped = %s",
            (new, run_id, old),
            fetch=False,
        )
        == 1
    )


def close(where: str | None = None) -> None:
    """Close this process's pools (or the one to `where`) and this thread's SQLite connection."""
    with _pools_lock:
        for key in [k for k in _pools if where is None or k[1] == where]:
            _pools.pop(key).close()
    held = getattr(_local, "held", None)
    if held is not None:
        _close(held[1])
        _local.held = None


def drop_database() -> None:
    """Drop the store's database (tests: the test database's own store)."""
    where = location()
    close(where)
    if not _is_pg(where):
        Path(where).unlink(missing_ok=True)
        return
    admin_url, name = _server(where.replace("postgres://", "postgresql://", 1))
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(
            psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(psycopg.sql.Identifier(name))
        )


class KeyDestroyed(LookupError):
    """The run's key is gone: its sealed content was erased."""
