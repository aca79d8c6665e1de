"""Transactions committed in one database, from pg_stat_database, read without touching that database.

Every scenario of bench/peers.py that uses PostgreSQL has a database of its own, so the rise of
`xact_commit` over a scenario is exactly the transactions it committed: each explicit
transaction, each statement run in autocommit mode (its own transaction) and each pool check
(an empty query in autocommit: it commits too). The reads go through a connection to the
server's maintenance database `postgres`, so reading adds nothing to the figures.

A backend publishes its counters lazily: at most once a second, and an idle backend may sit on
them for up to 10 s (PostgreSQL 15's PGSTAT_IDLE_INTERVAL); a backend that exits publishes them
before it leaves. So a reading is exact only when no backend is connected to the database
(`wait_idle`); where a scenario cannot close its connections (DBOS's background threads), it
waits `SETTLE_SECONDS` instead.
"""

from __future__ import annotations

import time
from urllib.parse import urlparse, urlunparse

SETTLE_SECONDS = 11.0


def admin_url(url: str) -> str:
    """The same server's maintenance database, as a psycopg connection string."""
    parts = urlparse(url)
    return urlunparse(parts._replace(scheme="postgresql", path="/postgres"))


def database_name(url: str) -> str:
    return urlparse(url).path.lstrip("/")


def counters(url: str) -> dict[str, int]:
    """{"commits", "rollbacks", "backends"} of the database `url` names."""
    import psycopg

    with psycopg.connect(admin_url(url), autocommit=True) as conn:
        # A fresh snapshot: with stats_fetch_consistency = cache a transaction would reuse its first read.
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT xact_commit, xact_rollback, numbackends FROM pg_stat_database WHERE datname = %s",
            [database_name(url)],
        ).fetchone()
    if row is None:
        raise RuntimeError(f"no database {database_name(url)!r}")
    return {"commits": row[0], "rollbacks": row[1], "backends": row[2]}


def wait_idle(url: str, timeout: float = 60.0) -> dict[str, int]:
    """Wait until nothing is connected to the database (so its counters are published); return them."""
    deadline = time.monotonic() + timeout
    while True:
        now = counters(url)
        if now["backends"] == 0:
            # numbackends drops after the exiting backend has published its counters (its
            # before_shmem_exit hook runs first); read once more to be sure of a settled value.
            time.sleep(0.2)
            return counters(url)
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{now['backends']} connections to {database_name(url)} still open after {timeout}s"
            )
        time.sleep(0.2)
