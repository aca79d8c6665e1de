"""Monthly partitions of steps, events and ledger entries (issue 37, part 3; history/partitions.py):
a run's steps and events land in the partition of the month its id was made in, its ledger entries
in their reservation's; ids from before ids were time-ordered land in the default partition; a
month prepared late takes its rows out of the default partition; a month dropped takes its rows
with it and nothing else. PostgreSQL only (the embedded SQLite demo has no partitions)."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from django.db import connection

from budgets.models import LedgerEntry, Reservation
from core.ids import made_at, month_floor, uuid7
from history import partitions
from history.verify import verify
from runs.models import Run, RunEvent, Step
from tests.history.conftest import finished_run

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _postgresql():
    if connection.vendor != "postgresql":
        pytest.skip("partitions are PostgreSQL's")


def _where(table: str, column: str, value) -> list[str]:
    """The partitions holding rows of `table` whose `column` is `value`."""
    with connection.cursor() as cursor:
        cursor.execute(
            f'SELECT DISTINCT tableoid::regclass::text FROM "{table}" WHERE "{column}" = %s', [value]
        )
        return sorted(name for (name,) in cursor.fetchall())


def test_ids_are_time_ordered_and_a_month_is_a_range_of_them():
    before = uuid7(dt.datetime(2026, 11, 30, 23, 59, 59, 999000, tzinfo=dt.UTC))
    first = uuid7(dt.datetime(2026, 12, 1, tzinfo=dt.UTC))
    assert before < month_floor(2026, 12) <= first < month_floor(2027, 1)
    assert first.version == 7 and first.variant == uuid.RFC_4122
    assert made_at(first) == dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
    assert made_at(uuid.uuid4()) is None
    assert len({uuid7() for _ in range(1000)}) == 1000


def test_the_history_tables_are_partitioned_with_this_month_the_next_two_and_a_default():
    now = dt.datetime.now(dt.UTC)
    for table in partitions.TABLES:
        with connection.cursor() as cursor:
            assert partitions.is_partitioned(cursor, table), table
        months = partitions.months(table)
        assert (now.year, now.month) in months and len(months) >= 3, (table, months)
    # No database key points at a step's id alone (none can: the key is (id, run_id)).
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT conrelid::regclass::text FROM pg_constraint WHERE contype = 'f' "
            "AND confrelid IN ('runs_step'::regclass, 'runs_runevent'::regclass, 'budgets_ledgerentry'::regclass)"
        )
        assert cursor.fetchall() == []


def test_a_run_lives_in_its_month_and_verifies(tenant, asha, echo_agent):
    run = finished_run(asha)
    now = made_at(run.pk)
    month = partitions.month_name("runs_step", now.year, now.month)
    assert _where("runs_step", "run_id", run.pk) == [month]
    assert _where("runs_runevent", "run_id", run.pk) == [month.replace("runs_step", "runs_runevent")]
    reservations = list(Reservation.objects.filter(run=run).values_list("pk", flat=True))
    assert reservations and all(r.version == 7 for r in reservations)
    assert {p for r in reservations for p in _where("budgets_ledgerentry", "reservation_id", r)} == {
        partitions.month_name("budgets_ledgerentry", now.year, now.month)
    }
    assert verify().ok


def test_a_month_prepared_late_takes_its_rows_out_of_the_default_partition(tenant, asha, echo_agent):
    run = finished_run(asha)
    now = made_at(run.pk)
    steps = Step.objects.filter(run=run).count()
    # As if nobody had made this month's partitions: its rows went to the default one.
    with connection.cursor() as cursor:
        for table in partitions.TABLES:
            name = partitions.month_name(table, now.year, now.month)
            cursor.execute(f'ALTER TABLE "{table}" DETACH PARTITION "{name}"')
            cursor.execute(f'INSERT INTO "{table}_default" SELECT * FROM "{name}"')
            cursor.execute(f'DROP TABLE "{name}"')
    assert _where("runs_step", "run_id", run.pk) == ["runs_step_default"]
    created = partitions.ensure_months(now=now, ahead=0)
    assert sorted(created) == sorted(partitions.month_name(t, now.year, now.month) for t in partitions.TABLES)
    assert _where("runs_step", "run_id", run.pk) == [partitions.month_name("runs_step", now.year, now.month)]
    assert Step.objects.filter(run=run).count() == steps
    assert partitions.ensure_months(now=now, ahead=0) == []  # made once
    assert verify().ok


def test_a_run_with_an_old_style_id_goes_to_the_default_partition_and_is_found(tenant, asha, echo_agent):
    run = finished_run(asha)
    old = uuid.UUID(int=(0xF0 << 120) | uuid.uuid4().int >> 8, version=4)  # made before ids were time-ordered
    _copy_run(run, old)
    assert _where("runs_step", "run_id", old) == ["runs_step_default"]
    assert _where("runs_runevent", "run_id", old) == ["runs_runevent_default"]
    assert Step.objects.filter(run_id=old).count() == Step.objects.filter(run=run).count() == 3
    assert RunEvent.objects.filter(run_id=old).count() == RunEvent.objects.filter(run=run).count()
    Run.objects.filter(pk=old).delete()
    assert not Step.objects.filter(run_id=old).exists()


def test_dropping_a_month_takes_its_rows_and_nothing_else(tenant, asha, echo_agent):
    kept = finished_run(asha)
    now = made_at(kept.pk)
    old = dt.datetime(now.year - 1, now.month, 1, tzinfo=dt.UTC)
    with connection.cursor() as cursor:
        for table in partitions.TABLES:
            partitions.ensure_months_of(cursor, table, old, ahead=0)
    assert (old.year, old.month) in partitions.months("runs_step")
    # A run of that month: the kept run's rows copied under an id of then.
    then = uuid7(old + dt.timedelta(days=3))
    _copy_run(kept, then)
    assert _where("runs_step", "run_id", then) == [partitions.month_name("runs_step", old.year, old.month)]
    dropped = partitions.drop_month(old.year, old.month, partitions.RUN_TABLES)
    assert sorted(dropped) == sorted(
        partitions.month_name(t, old.year, old.month) for t in partitions.RUN_TABLES
    )
    assert not Step.objects.filter(run_id=then).exists() and not RunEvent.objects.filter(run_id=then).exists()
    assert Step.objects.filter(run=kept).count() == 3 and RunEvent.objects.filter(run=kept).exists()
    assert (old.year, old.month) not in partitions.months("runs_step")
    assert LedgerEntry.objects.filter(reservation__run=kept).exists()
    Run.objects.filter(pk=then).delete()


def _copy_run(run, new_id) -> None:
    """The run's row, steps and events copied under another id."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO runs_run SELECT %s, "
            + ", ".join(_columns("runs_run")[1:])
            + " FROM runs_run WHERE id = %s",
            [new_id, run.pk],
        )
        for table in ("runs_step", "runs_runevent"):
            columns = [c for c in _columns(table) if c != "id"]
            select = ", ".join("%s" if c == "run_id" else c for c in columns)
            cursor.execute(
                f'INSERT INTO "{table}" ({", ".join(columns)}) SELECT {select} FROM "{table}" WHERE run_id = %s',
                [new_id, run.pk],
            )


def _columns(table: str) -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped "
            "ORDER BY attnum",
            [table],
        )
        return [name for (name,) in cursor.fetchall()]
