"""Count the SQL statements a process sends to PostgreSQL through psycopg 3.

PostgreSQL here does not load pg_stat_statements (it needs shared_preload_libraries and a server
restart, which a shared machine cannot have), and pg_stat_database counts transactions, not
statements. So bench/peers.py counts on the client: every scenario that talks to PostgreSQL
(Django in the engine's workers, LangGraph's PostgresSaver, DBOS through SQLAlchemy) goes
through psycopg 3, and every statement psycopg sends passes `BaseCursor._maybe_prepare_gen`
once: `execute`, each row of `executemany`, pipelined or not, prepared or not, client-side
binding or not. What it does not see: BEGIN and COMMIT/ROLLBACK, which psycopg sends as
commands of the connection (they are what pg_stat_database's xact_commit counts, reported on
their own), and COPY. An empty statement is psycopg_pool's connection check
(`check_connection` sends ""), counted apart as `checks`.

    from bench import sqlcount
    sqlcount.install()                       # once per process, before the first query
    sqlcount.write_at_exit("/tmp/counts")    # JSON {"statements": n, "checks": n}, at exit
    before = sqlcount.snapshot()

Counting costs a lock and two additions per statement, the same for every scenario.
"""

from __future__ import annotations

import atexit
import json
import threading
from pathlib import Path

_lock = threading.Lock()
_counts = {"statements": 0, "checks": 0}
_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    from psycopg._cursor_base import BaseCursor

    original = BaseCursor._maybe_prepare_gen

    def counted(self, pgq, *, prepare=None, binary=None):
        key = "checks" if not (pgq.query or b"").strip() else "statements"
        with _lock:
            _counts[key] += 1
        return original(self, pgq, prepare=prepare, binary=binary)

    BaseCursor._maybe_prepare_gen = counted
    _installed = True


def snapshot() -> dict[str, int]:
    with _lock:
        return dict(_counts)


def write_at_exit(path: str) -> None:
    def write() -> None:
        Path(path).write_text(json.dumps(snapshot()))

    atexit.register(write)
