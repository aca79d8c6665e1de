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
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from budgets.models import LedgerEntry, Reservation
from core.ids import made_at, month_floor, next_month, uuid7
from core.partitions import forget as forget_located
from core.partitions import located
from history import partitions
from history.checkpoints import take_checkpoint
from history.holds import place_hold
from history.models import RunTombstone
from history.retention import drop_due_months, purge_skeletons
from history.tasks import prepare_partitions
from history.verify import verify
from runs.models import Run, RunEvent, Step
from tenants.models import Tenant
from tests.history.conftest import finished_run

pytestmark = pytest.mark.django_db(transaction=True)

DAY = 86400


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
    assert prepare_partitions() == 0  # the beat's task: this month and the next two are there
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


def _unprepare(now: dt.datetime) -> None:
    """As if nobody had made the month's partitions: they go, their rows to the default ones, and
    this process is told, as drop_month tells it."""
    with connection.cursor() as cursor:
        for table in partitions.TABLES:
            name = partitions.month_name(table, now.year, now.month)
            cursor.execute(f'ALTER TABLE "{table}" DETACH PARTITION "{name}"')
            cursor.execute(f'INSERT INTO "{table}_default" SELECT * FROM "{name}"')
            cursor.execute(f'DROP TABLE "{name}"')
    forget_located()


def test_a_month_prepared_late_takes_its_rows_out_of_the_default_partition(tenant, asha, echo_agent):
    run = finished_run(asha)
    now = made_at(run.pk)
    steps = Step.objects.filter(run=run).count()
    _unprepare(now)
    assert _where("runs_step", "run_id", run.pk) == ["runs_step_default"]
    created = partitions.ensure_months(now=now, ahead=0)
    assert sorted(created) == sorted(partitions.month_name(t, now.year, now.month) for t in partitions.TABLES)
    assert _where("runs_step", "run_id", run.pk) == [partitions.month_name("runs_step", now.year, now.month)]
    assert Step.objects.filter(run=run).count() == steps
    assert partitions.ensure_months(now=now, ahead=0) == []  # made once
    assert verify().ok


def test_the_step_path_names_the_months_partition_once_it_has_seen_it_and_the_parent_until_then(
    tenant, asha, echo_agent
):
    now = dt.datetime.now(dt.UTC)
    month = partitions.month_name("runs_step", now.year, now.month)
    _unprepare(now)
    early = finished_run(asha)
    assert located("runs_step", early.pk) == '"runs_step"'
    assert _where("runs_step", "run_id", early.pk) == ["runs_step_default"]

    partitions.ensure_months(now=now, ahead=0)  # the month made late: its rows move into it
    # This process has not looked again: the parent still finds the run's steps where they went.
    assert located("runs_step", early.pk) == '"runs_step"'
    assert finished_run(asha, word="between").status == "succeeded"

    forget_located()
    with CaptureQueriesContext(connection) as captured:
        late = finished_run(asha, word="later")
    assert located("runs_step", late.pk) == f'"{month}"'
    writes = [
        q["sql"] for q in captured.captured_queries if q["sql"].lstrip().startswith("WITH s0 AS (UPDATE")
    ]
    windows = [q["sql"] for q in captured.captured_queries if "LEAST(COALESCE((SELECT o.seq" in q["sql"]]
    assert writes and all(f'UPDATE "{month}"' in text for text in writes), writes
    assert windows and all(f'FROM "{month}" s' in text for text in windows)
    assert _where("runs_step", "run_id", early.pk) == _where("runs_step", "run_id", late.pk) == [month]
    assert Step.objects.filter(run__in=[early, late]).count() == 6
    # Ids of any kind name a month or none: an old-style id whose first bits read as no date.
    assert located("runs_step", uuid.UUID(int=(0xFFFF << 112) | 1)) == '"runs_step"'
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


def _copy_run(run, new_id, *, with_ledger: bool = False):
    """The run's row, steps and events (and with_ledger: its reservations and their ledger
    entries, under ids of the new run's time) copied under another id; the new id."""
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
    if with_ledger:
        for reservation in Reservation.objects.filter(run=run):
            entries = list(LedgerEntry.objects.filter(reservation=reservation))
            reservation.pk, reservation.run_id = uuid7(made_at(new_id)), new_id
            Reservation.objects.bulk_create([reservation])
            for entry in entries:
                entry.pk, entry.reservation_id = None, reservation.pk
            LedgerEntry.objects.bulk_create(entries)
    return new_id


def _columns(table: str) -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped "
            "ORDER BY attnum",
            [table],
        )
        return [name for (name,) in cursor.fetchall()]


def test_a_month_whose_every_run_is_past_its_period_goes_whole_and_the_history_verifies(
    tenant, asha, ravi, echo_agent
):
    Tenant.objects.filter(pk=tenant.pk).update(skeleton_retention_seconds=90 * DAY)
    now = timezone.now()
    year_ago = now - dt.timedelta(days=365)
    gone_month = dt.datetime(year_ago.year, year_ago.month, 1, tzinfo=dt.UTC)
    held_month = dt.datetime(*next_month(gone_month.year, gone_month.month), 1, tzinfo=dt.UTC)
    with connection.cursor() as cursor:
        for table in partitions.TABLES:
            partitions.ensure_months_of(cursor, table, gone_month, ahead=1)
    today = [finished_run(asha, word=f"C-{i}") for i in range(3)]
    gone = [
        _copy_run(run, uuid7(gone_month + dt.timedelta(days=3 + i)), with_ledger=True)
        for i, run in enumerate(today)
    ]
    held = _copy_run(today[0], uuid7(held_month + dt.timedelta(days=2)))
    for run_id, month in [*((g, gone_month) for g in gone), (held, held_month)]:
        Run.objects.filter(pk=run_id).update(created_at=month, finished_at=month + dt.timedelta(days=5))
    place_hold(tenant_id=tenant.pk, scope="run", run_id=held, actor=ravi, reason="matter 9")
    take_checkpoint(now=held_month + dt.timedelta(days=10))  # their final heads, signed then
    steps_today = Step.objects.filter(run__in=today).count()
    entries_today = LedgerEntry.objects.filter(reservation__run__in=today).count()

    report = purge_skeletons(batch=10)

    assert report.months == [(gone_month.year, gone_month.month)]
    assert report.purged == [] and report.held == [held]
    for table in partitions.TABLES:
        assert (gone_month.year, gone_month.month) not in partitions.months(table), table
        assert (held_month.year, held_month.month) in partitions.months(table), table
    assert not Run.objects.filter(pk__in=gone).exists()
    assert (
        not Step.objects.filter(run_id__in=gone).exists()
        and not RunEvent.objects.filter(run_id__in=gone).exists()
    )
    assert not Reservation.objects.filter(run_id__in=gone).exists()
    stones = RunTombstone.objects.filter(run_id__in=gone)
    assert stones.count() == 3 and {s.period_seconds for s in stones} == {90 * DAY}
    assert all(s.checkpoint is not None and s.steps == 3 for s in stones)
    # Nothing else went: the held month's run, today's runs, their steps and ledger.
    assert Run.objects.filter(pk=held).exists() and Step.objects.filter(run_id=held).count() == 3
    assert Step.objects.filter(run__in=today).count() == steps_today
    assert LedgerEntry.objects.filter(reservation__run__in=today).count() == entries_today > 0
    take_checkpoint()
    verified = verify()
    # The gone runs verify as purged by retention, today's runs as intact. The held run is a copy
    # under another id, which its chain does not bind to: it is the one run named.
    assert {finding.run_id for finding in verified.findings} == {str(held)}, verified.findings
    assert verified.purged == {90 * DAY: 3}


def test_a_month_with_a_run_within_its_period_stays_and_its_runs_go_one_by_one(tenant, asha, echo_agent):
    Tenant.objects.filter(pk=tenant.pk).update(skeleton_retention_seconds=90 * DAY)
    now = timezone.now()
    then = now - dt.timedelta(days=200)
    month = dt.datetime(then.year, then.month, 1, tzinfo=dt.UTC)
    with connection.cursor() as cursor:
        for table in partitions.TABLES:
            partitions.ensure_months_of(cursor, table, month, ahead=0)
    run = finished_run(asha)
    due, young = (_copy_run(run, uuid7(month + dt.timedelta(days=1 + i))) for i in range(2))
    Run.objects.filter(pk=due).update(finished_at=month + dt.timedelta(days=2))
    Run.objects.filter(pk=young).update(finished_at=now - dt.timedelta(days=10))  # a long run, ended lately
    take_checkpoint(now=month + dt.timedelta(days=3))

    report = drop_due_months(now=now)

    # (Empty months other tests made may go: the partitions outlive each test's rows.)
    assert (month.year, month.month) not in report.dropped
    assert "within its skeleton period" in report.kept[(month.year, month.month)]
    assert purge_skeletons(batch=10).purged == [due]  # the run's own deletion, as before partitions
    assert Run.objects.filter(pk=young).exists() and (month.year, month.month) in partitions.months(
        "runs_step"
    )
