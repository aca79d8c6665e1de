"""Time-ordered ids (UUID version 7, RFC 9562) and the id ranges of calendar months.

A run's id and a reservation's id begin with the millisecond they were made, so the month a row
belongs to is a range of ids: history's partitions (history/partitions.py) are those ranges, and
a run's steps and events, partitioned by their run's id, live in the partition of the month the
run was made in. The other 74 bits are random, as unguessable as a version 4 id's 122 for an id
that is never a secret (every API call is authorised on its own).
"""

from __future__ import annotations

import datetime as dt
import os
import time
import uuid

_VERSION = 0x7 << 76
_VARIANT = 0x2 << 62


def uuid7(at: dt.datetime | None = None) -> uuid.UUID:
    """A new version 7 UUID for now, or for `at` (tests, the partition bench's old runs)."""
    ms = time.time_ns() // 1_000_000 if at is None else int(at.timestamp() * 1000)
    rand = int.from_bytes(os.urandom(10), "big")
    rand_a = rand >> 68  # 12 bits
    rand_b = rand & ((1 << 62) - 1)
    return uuid.UUID(int=(ms & ((1 << 48) - 1)) << 80 | _VERSION | rand_a << 64 | _VARIANT | rand_b)


def month_floor(year: int, month: int) -> uuid.UUID:
    """The lowest id of a month (UTC): its first millisecond, every other bit zero. A month's ids
    are [month_floor(its month), month_floor(the next month))."""
    start = dt.datetime(year, month, 1, tzinfo=dt.UTC)
    return uuid.UUID(int=int(start.timestamp() * 1000) << 80)


def next_month(year: int, month: int) -> tuple[int, int]:
    return (year + 1, 1) if month == 12 else (year, month + 1)


def made_at(value: uuid.UUID) -> dt.datetime | None:
    """When a version 7 id was made; None for any other version (ids made before version 7)."""
    if value.version != 7:
        return None
    return dt.datetime.fromtimestamp((value.int >> 80) / 1000, tz=dt.UTC)


def short(value) -> str:
    """The 8 characters a person is shown for an id (admin lists, messages). The last 8, not the
    first: a version 7 id's first 8 are the same for every id made within some 49 days."""
    return str(value)[-8:]
