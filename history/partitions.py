"""Monthly partitions of the run history (docs/history.md, "Partitioning"). PostgreSQL only: on
SQLite (the embedded demo) every function here does nothing.

Steps and events are partitioned by their run's id, ledger entries by their reservation's id.
Those ids are time-ordered (core/ids.py), so each month is a range of ids, and a run's steps and events sit together in the partition of the month the run was made in:
`(run_id, seq)` stays unique (it holds the partition key), the engine's statements are unchanged,
and they reach one partition. Rows whose key falls in no month's partition (ids made before ids
were time-ordered, or a month nobody prepared) go to the table's default partition, so an insert
never fails for want of a partition.

    partition_table(cursor, table, key)     the migration: the table becomes partitioned by
                                            range of `key`, its rows copied, constraints and
                                            indexes as they were (the primary key gains `key`)
    ensure_months(now, ahead)               the months from now to `ahead` months on exist, for
                                            every table; rows of such a month found in the
                                            default partition move into it (the beat, daily)
    months(table)                           the table's month partitions: [(year, month)]
    drop_month(year, month, tables)         detach and drop those tables' partitions of a month,
                                            in one short transaction that waits for its locks
                                            at most HISTORY_PARTITION_LOCK_TIMEOUT_MS
"""

from __future__ import annotations

import datetime as dt
import re

from django.conf import settings
from django.db import connection, transaction

from core.ids import month_floor, next_month
from core.partitions import TABLES as LOCATED_TABLES
from core.partitions import forget as forget_located
from core.partitions import month_name

# table -> partition key, in the order a month is dropped (each before what it refers to).
TABLES = {
    "runs_runevent": "run_id",
    "runs_step": "run_id",
    "budgets_ledgerentry": "reservation_id",
}
RUN_TABLES = LOCATED_TABLES  # the run's steps and events: the tables the step path names a month of
_MONTH = re.compile(r"_y(\d{4})m(\d{2})$")


def active() -> bool:
    return connection.vendor == "postgresql"


def bounds(year: int, month: int) -> tuple:
    """The month's ids: [low, high)."""
    return month_floor(year, month), month_floor(*next_month(year, month))


def is_partitioned(cursor, table: str) -> bool:
    cursor.execute("SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)", [table])
    row = cursor.fetchone()
    return row is not None and row[0] == "p"


def partition_table(cursor, table: str, key: str, *, months_of: dt.datetime | None = None) -> None:
    """Rebuild `table` as a table partitioned by range of `key` (see the module's docstring), with
    a default partition and the months of `months_of` (now) and the two after it. Its rows are
    copied; foreign keys from other tables to it come back only where what they point at is still
    unique (a table partitioned by its own primary key; none is today: the models that point at
    steps carry no database key)."""
    if is_partitioned(cursor, table):
        return
    _rebuild(cursor, table, key, partitioned=True)
    ensure_months_of(cursor, table, months_of or dt.datetime.now(dt.UTC), ahead=2, wait=True)


def unpartition_table(cursor, table: str, key: str) -> None:
    """The migration's way back: a plain table again, the primary key without `key`."""
    if not is_partitioned(cursor, table):
        return
    _rebuild(cursor, table, key, partitioned=False)


def _rebuild(cursor, table: str, key: str, *, partitioned: bool) -> None:
    forget_located()
    old = f"{table}_rebuilt"
    cursor.execute(
        "SELECT conname, conrelid::regclass::text, pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE confrelid = %s::regclass AND contype = 'f' AND conrelid <> confrelid "
        "AND conparentid = 0",
        [table],
    )
    incoming = cursor.fetchall()
    cursor.execute(
        "SELECT conname, contype, pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE conrelid = %s::regclass AND conparentid = 0 ORDER BY contype DESC, conname",
        [table],
    )
    constraints = cursor.fetchall()
    cursor.execute(
        "SELECT indexrelid::regclass::text, pg_get_indexdef(indexrelid) FROM pg_index i "
        "WHERE indrelid = %s::regclass AND NOT EXISTS "
        "(SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid AND c.conrelid = i.indrelid)",
        [table],
    )
    indexes = cursor.fetchall()
    cursor.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attidentity <> '' AND attnum > 0",
        [table],
    )
    identities = [name for (name,) in cursor.fetchall()]
    cursor.execute(
        "SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger WHERE tgrelid = %s::regclass AND NOT tgisinternal",
        [table],
    )
    triggers = cursor.fetchall()  # the events' NOTIFY (runs/migrations/0008_run_event_notify.py)

    for name, source, _definition in incoming:
        cursor.execute(f'ALTER TABLE {source} DROP CONSTRAINT "{name}"')
    for name, _definition in triggers:
        cursor.execute(f'DROP TRIGGER "{name}" ON "{table}"')
    cursor.execute(f'ALTER TABLE "{table}" RENAME TO "{old}"')
    for name, _kind, _definition in constraints:
        cursor.execute(f'ALTER TABLE "{old}" DROP CONSTRAINT "{name}"')
    for name, _definition in indexes:
        cursor.execute(f"DROP INDEX {name}")
    tops = {}
    for column in identities:
        cursor.execute(f'SELECT coalesce(max("{column}"), 0) FROM "{old}"')
        tops[column] = cursor.fetchone()[0]
        cursor.execute(f'ALTER TABLE "{old}" ALTER COLUMN "{column}" DROP IDENTITY')

    tail = f' PARTITION BY RANGE ("{key}")' if partitioned else ""
    cursor.execute(
        f'CREATE TABLE "{table}" (LIKE "{old}" INCLUDING DEFAULTS INCLUDING GENERATED INCLUDING STORAGE){tail}'
    )
    for column in identities:
        cursor.execute(f'ALTER TABLE "{table}" ALTER COLUMN "{column}" ADD GENERATED BY DEFAULT AS IDENTITY')
    if partitioned:
        cursor.execute(f'CREATE TABLE "{table}_default" PARTITION OF "{table}" DEFAULT')
    for name, kind, definition in constraints:
        cursor.execute(
            f'ALTER TABLE "{table}" ADD CONSTRAINT "{name}" {_keyed(kind, definition, key, partitioned)}'
        )
    for _name, definition in indexes:
        cursor.execute(definition)
    cursor.execute(f'INSERT INTO "{table}" SELECT * FROM "{old}"')  # before the triggers: no NOTIFY
    for _name, definition in triggers:
        cursor.execute(definition)
    for column, top in tops.items():
        cursor.execute(
            "SELECT setval(pg_get_serial_sequence(%s, %s), %s, %s)", [table, column, max(top, 1), top > 0]
        )
    cursor.execute(f'DROP TABLE "{old}"')
    for name, source, definition in incoming:
        if _still_unique(definition, key, partitioned):
            cursor.execute(f'ALTER TABLE {source} ADD CONSTRAINT "{name}" {definition}')


def _keyed(kind: str, definition: str, key: str, partitioned: bool) -> str:
    """A primary key or unique constraint of a partitioned table must hold the partition key: the
    primary key gains it (and loses it again on the way back); a unique one that lacks it cannot
    be kept, which the migration says rather than weaken."""
    if kind not in ("p", "u"):
        return definition
    match = re.match(r"(PRIMARY KEY|UNIQUE) \((.*)\)(.*)$", definition)
    assert match, definition
    columns = [c.strip() for c in match.group(2).split(",")]
    if kind == "p" and partitioned and key not in columns:
        columns.append(key)
    elif kind == "p" and not partitioned and key in columns and len(columns) > 1:
        columns.remove(key)
    elif kind == "u" and partitioned and key not in columns:
        raise ValueError(f"unique ({', '.join(columns)}) cannot hold on a table partitioned by {key}")
    return f"{match.group(1)} ({', '.join(columns)}){match.group(3)}"


def _still_unique(definition: str, key: str, partitioned: bool) -> bool:
    match = re.search(r"REFERENCES \S+\((.*?)\)", definition)
    if match is None:
        return False
    return not partitioned or [c.strip() for c in match.group(1).split(",")] == [key]


def ensure_months(*, now: dt.datetime | None = None, ahead: int = 2) -> list[str]:
    """Create the partitions of this month and the `ahead` months after it where missing, for
    every table; the names created."""
    if not active():
        return []
    now = now or dt.datetime.now(dt.UTC)
    created = []
    for table in TABLES:
        with transaction.atomic(), connection.cursor() as cursor:
            if is_partitioned(cursor, table):
                created += ensure_months_of(cursor, table, now, ahead=ahead)
    return created


def ensure_months_of(cursor, table: str, now: dt.datetime, *, ahead: int, wait: bool = False) -> list[str]:
    """As ensure_months, for one table, in the caller's transaction. `wait`: no lock timeout (the
    migration, which has the table to itself)."""
    key = TABLES[table]
    year, month = now.year, now.month
    created = []
    if not wait:
        _lock_timeout(cursor)
    for _ in range(ahead + 1):
        name = month_name(table, year, month)
        cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [name])
        if not cursor.fetchone()[0]:
            low, high = bounds(year, month)
            # Rows of this month in the default partition (a month prepared late) move into it
            # first: a new partition cannot cover rows the default one holds.
            cursor.execute(
                f'CREATE TABLE "{name}" (LIKE "{table}" INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING STORAGE)'
            )
            cursor.execute(
                f'WITH moved AS (DELETE FROM "{table}_default" WHERE "{key}" >= %s AND "{key}" < %s RETURNING *) '
                f'INSERT INTO "{name}" SELECT * FROM moved',
                [low, high],
            )
            cursor.execute(
                f"ALTER TABLE \"{table}\" ATTACH PARTITION \"{name}\" FOR VALUES FROM ('{low}') TO ('{high}')"
            )
            created.append(name)
        year, month = next_month(year, month)
    return created


def months(table: str) -> list[tuple[int, int]]:
    """The table's month partitions, oldest first."""
    if not active():
        return []
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(%s)",
            [table],
        )
        names = [name for (name,) in cursor.fetchall()]
    found = [_MONTH.search(name) for name in names]
    return sorted((int(m.group(1)), int(m.group(2))) for m in found if m)


def drop_month(year: int, month: int, tables) -> list[str]:
    """Detach and drop `tables`' partitions of the month, in one transaction: the caller has made
    sure nothing in them is still wanted. Detaching takes a brief exclusive lock on each parent,
    which the step path's statements wait behind; waiting for it longer than the lock timeout
    gives up (LockNotAvailable) rather than stall them, and the next pass tries again."""
    dropped = []
    with transaction.atomic(), connection.cursor() as cursor:
        _lock_timeout(cursor)
        for table in tables:
            name = month_name(table, year, month)
            cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [name])
            if cursor.fetchone()[0]:
                cursor.execute(f'ALTER TABLE "{table}" DETACH PARTITION "{name}"')
                cursor.execute(f'DROP TABLE "{name}"')
                dropped.append(name)
    forget_located()
    return dropped


def _lock_timeout(cursor) -> None:
    cursor.execute(
        "SELECT set_config('lock_timeout', %s, true)", [f"{settings.HISTORY_PARTITION_LOCK_TIMEOUT_MS}ms"]
    )
