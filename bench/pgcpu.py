"""PostgreSQL's own CPU time for one database: the backends serving it, read from /proc.

pg_stat_statements times statements, not the backend's whole work (parsing, planning, commits,
connection start-up, the notify queue); a backend's CPU time is all of it. `BackendCpu` samples
`/proc/<pid>/stat` (utime + stime) of every backend pg_stat_activity lists for the database,
every INTERVAL seconds on a thread of its own, and adds up what each backend used since the
sampling started (a backend that was already there counts from its first sample; a new one from
zero, start-up included). A backend that exits between two samples loses what it used after the
last one (at most INTERVAL of its time): close connections after `stop()` where possible.

Each sample also notes whether a backend of the database was waiting for a lock
(`lock_wait_share`).

Needs the PostgreSQL server on this machine and /proc readable (root, or the same user); else
`total()` is None. The reads go through a connection to the maintenance database `postgres`, so
they add nothing to the figures of the database measured.
"""

from __future__ import annotations

import os
import threading

from bench import pgstats

INTERVAL = 0.2
TICKS = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14 and 15)


class BackendCpu:
    def __init__(self, url: str):
        self.url = url
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.readable = True
        self.samples = self.lock_samples = 0
        self.waits: dict[str, int] = {}  # "wait_event: waiter's statement <- holder's state: statement"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _pids(self, conn) -> list[int]:
        rows = conn.execute(
            "SELECT a.pid, a.wait_event_type = 'Lock', "
            "CASE WHEN a.wait_event_type = 'Lock' THEN a.wait_event || ': ' || left(regexp_replace("
            "a.query, '\\s+', ' ', 'g'), 70) || ' <- ' || coalesce((SELECT b.state || ': ' || "
            "left(regexp_replace(b.query, '\\s+', ' ', 'g'), 70) FROM pg_stat_activity b "
            "WHERE b.pid = (pg_blocking_pids(a.pid))[1]), '?') END "
            "FROM pg_stat_activity a WHERE a.datname = %s AND a.backend_type = 'client backend'",
            [pgstats.database_name(self.url)],
        ).fetchall()
        # A sample in which some backend waits for a heavyweight lock (a row held by another
        # transaction: the run row, a budget account's shard): the "lock convoy" figure.
        # Each wait is kept by what waited and what held it (its state and its last statement).
        self.samples += 1
        self.lock_samples += any(waiting for _, waiting, _ in rows)
        for _, waiting, what in rows:
            if waiting:
                self.waits[what] = self.waits.get(what, 0) + 1
        return [pid for (pid, _, _) in rows]

    @property
    def lock_wait_share(self) -> float | None:
        """The share of samples with a backend waiting for a lock (0..1)."""
        return self.lock_samples / self.samples if self.samples else None

    def sample(self, conn, *, baseline: bool = False) -> None:
        for pid in self._pids(conn):
            used = _cpu(pid)
            if used is None:
                self.readable = self.readable and os.path.exists(f"/proc/{pid}")
                continue
            with self._lock:
                if pid not in self.first:
                    self.first[pid] = used if baseline else 0.0
                self.last[pid] = used

    def start(self) -> BackendCpu:
        import psycopg

        conn = psycopg.connect(pgstats.admin_url(self.url), autocommit=True)
        self.sample(conn, baseline=True)

        def loop():
            try:
                while not self._stop.wait(INTERVAL):
                    self.sample(conn)
                self.sample(conn)
            finally:
                conn.close()

        self._thread = threading.Thread(target=loop, name="pg-backend-cpu", daemon=True)
        self._thread.start()
        return self

    def total(self) -> float | None:
        """CPU seconds the database's backends used since start() (so far, or until stop())."""
        if not self.readable:
            return None
        with self._lock:
            return sum(self.last[pid] - self.first[pid] for pid in self.last)

    def stop(self) -> float | None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        return self.total()
