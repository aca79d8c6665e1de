"""Which month partition holds a row, for the statements a step sends on every claim.

PostgreSQL 15 plans a prepared statement on a partitioned table once for all its partitions, and
the generic plan locks every one of them (and their indexes) at each execution, before run-time
pruning leaves one: with seven years of months kept, a step's UPDATE of its own step cost half as
much again, and COMMIT released the locks (docs/performance.md, "History partitioned by month").
Naming the month's partition itself locks one table.

A month's ids are a range (core/ids.py), and a row whose key falls in a partition's range is in
that partition: PostgreSQL routes every insert by the key, and refuses to create a partition while
the default one holds rows of its range (history/partitions.py moves them first, in the same
transaction). So once this process has seen the month's partition exist, that partition is where
the row is; until then, the parent finds it wherever it is. A month is dropped only after its runs
were tombstoned (history/retention.py), so no step of it is claimed again; the dropping process
forgets what it knew, the others keep a name nothing asks for.

PostgreSQL only; on SQLite (the embedded demo) every table is its own name.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid

from django.db import DEFAULT_DB_ALIAS, connections

# The tables whose month this module names: partitioned by their run's id.
TABLES = ("runs_runevent", "runs_step")
# How often a process looks again for partitions it has not seen: only a row of a month this
# process does not know yet (the default partition's, or a month made since) makes it look.
REFRESH_SECONDS = 60.0

_lock = threading.Lock()
_known: frozenset[str] | None = None
_checked = 0.0


def month_name(table: str, year: int, month: int) -> str:
    """The name of `table`'s partition of a month."""
    return f"{table}_y{year:04d}m{month:02d}"


def month_of(key) -> tuple[int, int] | None:
    """The (year, month) whose id range holds `key`, of any UUID version; None past the calendar
    (a version 4 id's first 48 bits read as milliseconds can name a year after 9999)."""
    value = key if isinstance(key, uuid.UUID) else uuid.UUID(str(key))
    try:
        at = dt.datetime.fromtimestamp((value.int >> 80) / 1000, tz=dt.UTC)
    except (OverflowError, ValueError, OSError):
        return None
    return at.year, at.month


def located(table: str, key) -> str:
    """The quoted name of the table to read or write `table`'s rows of partition key `key` in:
    the month's partition once this process has seen it, else `table` itself."""
    if connections[DEFAULT_DB_ALIAS].vendor != "postgresql":
        return f'"{table}"'
    month = month_of(key)
    if month is None:
        return f'"{table}"'
    name = month_name(table, *month)
    known = _known
    if known is None or (name not in known and time.monotonic() - _checked > REFRESH_SECONDS):
        known = _load()
    return f'"{name}"' if name in known else f'"{table}"'


def forget() -> None:
    """Drop what this process knows: the partitions were rebuilt or a month dropped."""
    global _known
    with _lock:
        _known = None


def _load() -> frozenset[str]:
    global _known, _checked
    with connections[DEFAULT_DB_ALIAS].cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "JOIN pg_class p ON p.oid = i.inhparent "
            "WHERE p.relname = ANY(%s) AND pg_table_is_visible(p.oid)",
            [list(TABLES)],
        )
        found = frozenset(name for (name,) in cursor.fetchall())
    with _lock:
        _known, _checked = found, time.monotonic()
    return found
