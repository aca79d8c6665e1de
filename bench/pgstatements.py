"""PostgreSQL's CPU per statement: what each statement a process sends costs its backend.

bench/pgcpu.py reads a backend's whole CPU time in clock ticks (10 ms): right for a scenario,
too coarse for one statement. A statement over psycopg is a request and its answer, and the
backend serving it works for no one else meanwhile, so the backend's own CPU time between the
two is that statement's cost: parsing or binding, planning, executor start-up, running, sending
the rows. `/proc/<pid>/schedstat` gives that time in nanoseconds. Wrapping psycopg's one
`Cursor.execute` (Django's cursors, the budget ledger's and the engine's prepared ones all end
there) and `Connection.commit` attributes every statement and every COMMIT of the installing thread; the
BEGIN psycopg sends before a transaction's first statement is counted with that statement.

    from bench import pgstatements
    costs = pgstatements.Costs().install()   # this process, from now on
    ... drive steps ...
    costs.uninstall(); costs.report(steps)   # per step: ms, calls, us per call, statement

A statement is labelled by its first PGSTATEMENTS_WIDTH characters (56) and its length.

Needs the PostgreSQL server on this machine and /proc readable (root, or the same user).
Reading schedstat costs this process about 10 us per statement: measure CPU apart.
"""

from __future__ import annotations

import collections
import os
import re
import threading

WIDTH = int(os.environ.get("PGSTATEMENTS_WIDTH", "56"))


def _on_cpu_ns(pid: int) -> int:
    with open(f"/proc/{pid}/schedstat") as stat:
        return int(stat.read().split()[0])


def label(query) -> str:
    """A statement's first words and its length: statements of one shape share a label."""
    text = query if isinstance(query, str) else (query.decode() if isinstance(query, bytes) else str(query))
    text = re.sub(r"\s+", " ", text).strip()
    return f"{text[:WIDTH]} [{len(text)}]"


class Costs:
    def __init__(self):
        self.ns: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self._saved: tuple | None = None

    def install(self) -> Costs:
        import psycopg

        execute, commit = psycopg.Cursor.execute, psycopg.Connection.commit
        costs, thread = self, threading.get_ident()

        def timed_execute(cursor, query, params=None, **kwargs):
            if threading.get_ident() != thread:  # not the driving thread's (bench/pgcpu.py's sampler)
                return execute(cursor, query, params, **kwargs)
            pid = cursor.connection.info.backend_pid
            before = _on_cpu_ns(pid)
            try:
                return execute(cursor, query, params, **kwargs)
            finally:
                costs.add(label(query), _on_cpu_ns(pid) - before)

        def timed_commit(conn):
            if threading.get_ident() != thread:
                return commit(conn)
            pid = conn.info.backend_pid
            before = _on_cpu_ns(pid)
            try:
                return commit(conn)
            finally:
                costs.add("COMMIT", _on_cpu_ns(pid) - before)

        self._saved = (execute, commit)
        psycopg.Cursor.execute, psycopg.Connection.commit = timed_execute, timed_commit
        return self

    def uninstall(self) -> None:
        import psycopg

        if self._saved is not None:
            psycopg.Cursor.execute, psycopg.Connection.commit = self._saved
            self._saved = None

    def add(self, what: str, ns: int) -> None:
        self.ns[what] += ns
        self.calls[what] += 1

    def total_ms(self, steps: int) -> float:
        return sum(self.ns.values()) / steps / 1e6

    def report(self, steps: int, *, top: int = 16, title: str = "") -> None:
        print(
            f"{title}PostgreSQL CPU per step by statement, from the backend's schedstat "
            f"({self.total_ms(steps):.3f} ms per step in all): ms per step, calls per step, us per call"
        )
        for what, ns in self.ns.most_common(top):
            calls = self.calls[what]
            print(f"  {ns / steps / 1e6:6.3f} {calls / steps:5.2f} {ns / calls / 1e3:7.1f}  {what}")
