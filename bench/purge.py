"""Retention's purge at scale, beside live runs (issue 37; docs/history.md, "Retention").

    DATABASE_URL=postgres://root@127.0.0.1:5432/test .venv/bin/python bench/purge.py \
        [--runs 10000] [--steps 100] [--events 3] [--live-seconds 30] [--skeleton] [--find]

DATABASE_URL only says where PostgreSQL is: the benchmark creates its own database and drops it.
It seeds `runs` ended runs of `steps` steps each (`events` events a step), content in every
content column, all ended 100 days ago, cloned by SQL from one real run; then:

1. live alone: real runs (start_run, then the engine's advance in this process: claim, a
   scripted model call, record, end) one after another for `--live-seconds`: latency per run;
2. the content purge (history/retention.py, the beat's own function, a run per transaction)
   until nothing is due, the same live runs driven beside it in a thread: the purge's time, its
   transactions' durations, the WAL it wrote, sessions seen waiting on a lock (sampled every
   50 ms), and the live runs' latency beside it;
3. with `--skeleton`: a checkpoint over the seeded runs, then the skeleton's purge (delete the
   runs, their steps and events, a tombstone each) the same way, run by run; with
   `--skeleton-months` instead, by dropping their month's partitions (the seeded runs' ids are
   of a month 130 days ago: history/partitions.py);
4. with `--find` (first): a data subject's search reading every run, the search's index filled
   by the beat's function beside live runs, and the search through it (history/subjects.py).

Prints the load average before and after: on a shared machine the figures move with it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import dbs

TAG = f"bench_purge_{os.getpid()}"
BASE_URL = os.environ.get("DATABASE_URL", "")
if not BASE_URL.startswith("postgres"):
    sys.exit("DATABASE_URL must point at PostgreSQL (only its server is used; a throwaway database is made)")


BENCH_URL = dbs.with_database(BASE_URL, TAG)
os.environ["DATABASE_URL"] = BENCH_URL
os.environ.pop("CONTENT_KEYS_DATABASE_URL", None)  # the key store beside it: bench/dbs.py drops both
os.environ["CELERY_BROKER_URL"] = "memory://"  # start_run enqueues; this process drives the runs
os.environ.pop("DB_POOL_MAX", None)
os.environ.setdefault("LOG_LEVEL", "ERROR")
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agentplatform.settings")

SECRET = "ACCT-55-0192-7781"
ARGUMENTS = {"account": SECRET, "amount": 125000, "note": "customer disputes the charge " * 3}
RESULT = {"status": "ok", "account": SECRET, "holder": "Asha Rao", "history": ["debit 1200"] * 12}
OBSERVATION = f"Account {SECRET} of Asha Rao: balance 10,240.55, last 12 movements " + "x" * 300


def setup():
    from runs.models import Run
    from runs.services import start_run
    from tests import factories
    from tests.conftest import drive

    tenant = factories.make_tenant("bench", max_active_runs=10_000, max_starts_per_minute=100_000)
    user = factories.make_user(tenant, "asha")
    factories.make_agent(tenant, turns=[{"text": "done"}])
    run, _ = start_run(user=user, agent="agent", input={"account": SECRET})
    drive(run.pk)
    return tenant, user, Run.objects.get(pk=run.pk)


def columns(cursor, table: str) -> list[str]:
    cursor.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = %s ORDER BY ordinal_position",
        [table],
    )
    return [name for (name,) in cursor.fetchall()]


def clone(cursor, table: str, source: str, overrides: dict, params: list) -> None:
    """INSERT INTO table SELECT every column of the template row, but the overridden ones (SQL, or
    (SQL, its parameters)); `params` are the source's."""
    names = [c for c in columns(cursor, table) if c != "id" or "id" in overrides]
    picked, values = [], []
    for name in names:
        given = overrides.get(name, f"t.{name}")
        sql, extra = given if isinstance(given, tuple) else (given, [])
        picked.append(sql)
        values += extra
    cursor.execute(
        f"INSERT INTO {table} ({', '.join(names)}) SELECT {', '.join(picked)} FROM {source}", values + params
    )


def seed(template, runs: int, steps: int, events: int, chunk: int = 200) -> float:
    """Clone the template run into `runs` ended runs with `steps` steps and `events` events a step."""
    import datetime as dt
    import json

    from django.db import connection, transaction
    from django.utils import timezone

    from core.ids import uuid7
    from history import partitions
    from runs.models import Run, RunEvent, Step
    from vault.fields import seal

    with connection.cursor() as cursor:
        then = timezone.now() - dt.timedelta(days=130)
        for table in partitions.TABLES if partitions.active() else ():
            partitions.ensure_months_of(cursor, table, then, ahead=0)

    # Sealed with the template's key (vault/fields.py); the copies keep the template's seal.
    answer = seal(Run, "final_output", template.pk, OBSERVATION, tenant=template.tenant_id)
    Step.objects.filter(run=template).update(
        **{
            name: seal(Step, name, template.pk, value, tenant=template.tenant_id)
            for name, value in (("arguments", ARGUMENTS), ("result", RESULT), ("observation", OBSERVATION))
        }
    )
    message = seal(RunEvent, "message", template.pk, f"looked up {SECRET}", tenant=template.tenant_id)
    data = seal(
        RunEvent, "data", template.pk, {"tool": "lookup", "result": RESULT}, tenant=template.tenant_id
    )
    step_id = Step.objects.filter(run=template).order_by("seq").values_list("pk", flat=True).first()
    started = time.monotonic()
    done = 0
    with connection.cursor() as cursor:
        event_id = None
        cursor.execute("SELECT id FROM runs_runevent WHERE run_id = %s ORDER BY seq LIMIT 1", [template.pk])
        (event_id,) = cursor.fetchone()
        while done < runs:
            n = min(chunk, runs - done)
            with transaction.atomic():
                cursor.execute("CREATE TEMP TABLE IF NOT EXISTS seeded (id uuid) ON COMMIT DROP")
                cursor.execute("TRUNCATE seeded")
                # Ids of a month over and past the periods (core/ids.py): the runs live in its partition.
                then = timezone.now() - dt.timedelta(days=130)
                cursor.execute(
                    "INSERT INTO seeded SELECT unnest(%s::uuid[])", [[uuid7(then) for _ in range(n)]]
                )
                clone(
                    cursor,
                    "runs_run",
                    "runs_run t, seeded s WHERE t.id = %s",
                    {
                        "id": "s.id",
                        "idempotency_key": "NULL",
                        "status": "'succeeded'",
                        "input": (
                            "%s::jsonb",
                            [json.dumps({"account": SECRET, "complaint": "double charge " * 20})],
                        ),
                        "final_output": ("%s", [answer]),
                        "created_at": "now() - interval '130 days'",
                        "finished_at": "now() - interval '129 days'",
                        "event_seq": ("%s", [steps * events]),
                        "step_count": ("%s", [steps]),
                    },
                    [template.pk],
                )
                clone(
                    cursor,
                    "runs_step",
                    "runs_step t, seeded s, generate_series(1, %s) g WHERE t.id = %s",
                    {"run_id": "s.id", "seq": "g"},
                    [steps, step_id],
                )
                clone(
                    cursor,
                    "runs_runevent",
                    "runs_runevent t, seeded s, generate_series(1, %s) g WHERE t.id = %s",
                    {
                        "run_id": "s.id",
                        "seq": "g",
                        "step_seq": f"(g - 1) / {events} + 1",
                        "kind": "'tool_result'",
                        "message": ("%s", [message]),
                        "data": ("%s", [data]),
                        "skeleton": ("%s::jsonb", [json.dumps({"tool": "lookup"})]),
                    },
                    [steps * events, event_id],
                )
            done += n
            print(
                f"  seeded {done}/{runs} runs ({done * steps} steps) in {time.monotonic() - started:.0f} s",
                flush=True,
            )
    return time.monotonic() - started


class Live(threading.Thread):
    """Real runs driven one after another until told to stop: their latencies."""

    def __init__(self, user, stop: threading.Event):
        super().__init__(daemon=True)
        self.user, self.stop_event = user, stop
        self.latencies: list[float] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        from django.db import connection

        from runs.models import RunStatus
        from runs.services import start_run
        from tests.conftest import drive

        try:
            while not self.stop_event.is_set():
                started = time.perf_counter()
                run, _ = start_run(user=self.user, agent="agent", input={"i": len(self.latencies)})
                assert drive(run.pk).status == RunStatus.SUCCEEDED
                self.latencies.append(time.perf_counter() - started)
        except BaseException as exc:  # reported by the main thread
            self.error = exc
        finally:
            connection.close()


class LockWatch(threading.Thread):
    """Samples pg_stat_activity every 50 ms: sessions of this database waiting on a lock."""

    def __init__(self, stop: threading.Event):
        super().__init__(daemon=True)
        self.stop_event = stop
        self.samples = 0
        self.waiting = 0  # samples with at least one session waiting on a lock
        self.most = 0

    def run(self) -> None:
        import psycopg

        with psycopg.connect(os.environ["DATABASE_URL"].replace("postgres://", "postgresql://", 1)) as conn:
            conn.autocommit = True
            while not self.stop_event.is_set():
                row = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock'"
                ).fetchone()
                count = row[0] if row else 0
                self.samples += 1
                self.waiting += bool(count)
                self.most = max(self.most, count)
                time.sleep(0.05)


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def latency_row(label: str, values: list[float], seconds: float) -> str:
    return (
        f"{label:<28} {len(values):>6} runs {len(values) / seconds:>6.1f}/s  p50 {1000 * pct(values, 0.5):>7.1f} ms  "
        f"p99 {1000 * pct(values, 0.99):>7.1f} ms  max {1000 * max(values, default=float('nan')):>7.1f} ms"
    )


def wal_lsn() -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_current_wal_lsn()::text")
        return cursor.fetchone()[0]


def wal_bytes(start: str, end: str) -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)", [end, start])
        return int(cursor.fetchone()[0])


def beside(user, label: str, work, total: int) -> None:
    """Run `work()` (returns per-transaction durations) with live runs and the lock watch beside it."""
    stop = threading.Event()
    live, watch = Live(user, stop), LockWatch(stop)
    live.start()
    watch.start()
    time.sleep(2)  # the live runs warm up first
    lsn = wal_lsn()
    started = time.monotonic()
    durations = work()
    took = time.monotonic() - started
    written = wal_bytes(lsn, wal_lsn())
    stop.set()
    live.join()
    watch.join()
    if live.error:
        raise live.error
    print(
        f"{label}: {len(durations)} runs in {took:.1f} s ({len(durations) / took:.0f} runs/s); "
        f"a transaction p50 {1000 * statistics.median(durations or [0]):.1f} ms, p99 {1000 * pct(durations, 0.99):.1f} ms, "
        f"max {1000 * max(durations, default=0):.1f} ms; WAL {written / 2**20:.0f} MiB; "
        f"lock waits seen in {watch.waiting} of {watch.samples} samples (at most {watch.most} sessions)"
    )
    if durations and len(durations) < total:
        print(
            f"  stopped after {len(durations)} of {total} runs: all of them at this rate would take "
            f"{took * total / len(durations) / 60:.0f} min and write {written * total / len(durations) / 2**30:.1f} GiB of WAL"
        )
    print(latency_row(f"  live runs beside {label}", live.latencies[1:], took))


def find_subject(tenant, template, user, runs: int) -> None:
    """--find: the erasure's search for an identifier one seeded run carries in a step's result,
    and for one that no run carries: reading every run (a regular expression over every content
    column of the tenant's rows), then the index filled by the beat's own function beside live
    runs, then through the index; each search timed on the wall clock."""
    from django.db import connection

    from history import subjects
    from runs.models import Step
    from vault.fields import seal

    # Written behind the engine's back (no event), so before the index reads it.
    carrier = Step.objects.filter(run__tenant=tenant).exclude(run=template).order_by("run_id", "seq").first()
    Step.objects.filter(run_id=carrier.run_id, pk=carrier.pk).update(
        result=seal(Step, "result", carrier.run_id, {"customer": "CUST-4471-BENCH"}, tenant=tenant.pk)
    )

    def search(how: str, scan: bool) -> None:
        for identifier, expected in (("CUST-4471-BENCH", 1), ("NOBODY-0000-BENCH", 0)):
            started = time.monotonic()
            found = subjects.find(tenant.pk, identifier, scan=scan)
            took = time.monotonic() - started
            assert len(found.run_ids()) == expected, (identifier, found.run_ids())
            print(f"data subject search {how}, an identifier carried by {expected} run(s): {took:.2f} s")

    search("reading every run", scan=True)

    def index() -> list[float]:
        # The seeded runs' ids are the oldest, and a pass takes the oldest first: `runs` passes of
        # one run index them all (the live runs beside, ending all the while, would keep it busy).
        durations: list[float] = []
        for _ in range(runs):
            started = time.perf_counter()
            assert subjects.index_due(batch=1) == 1
            durations.append(time.perf_counter() - started)
        return durations

    beside(user, "the subject index filled", index, runs)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT count(*), count(event_seq), pg_total_relation_size('{subjects.WORDS}'), "
            f"avg(cardinality(words)) FILTER (WHERE event_seq IS NOT NULL) FROM {subjects.WORDS}"
        )
        rows, covered, size, words = cursor.fetchone()
    print(
        f"  the index: {rows} rows ({covered} runs covered), {size / 2**20:.1f} MiB, "
        f"{float(words or 0):.0f} words a covered run"
    )
    for when in ("the live runs beside it not indexed yet", "after the next pass"):
        started = time.monotonic()
        uncovered = subjects.uncovered(tenant.pk)
        took = 1000 * (time.monotonic() - started)
        search(
            f"through the index, {len(uncovered)} runs not covered ({when}; found in {took:.0f} ms)",
            scan=False,
        )
        while subjects.index_due(batch=500):
            pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--events", type=int, default=3)
    parser.add_argument("--live-seconds", type=float, default=30)
    parser.add_argument("--skeleton", action="store_true", help="then purge the skeleton too, run by run")
    parser.add_argument(
        "--skeleton-months",
        action="store_true",
        help="then purge the skeleton by dropping the seeded runs' month (history.retention.drop_due_months)",
    )
    parser.add_argument(
        "--purge-seconds",
        type=float,
        default=0,
        help="stop each purge after this long and extrapolate its rate to every run (0: to the end)",
    )
    parser.add_argument(
        "--find",
        action="store_true",
        help="first time a data subject request's search over the seeded tenant (history.subjects.find): "
        "an identifier carried by one run, and one carried by none, reading every run; then fill the "
        "search's index beside live runs, and time the search through it",
    )
    parser.add_argument("--keep", action="store_true", help="keep the database (named in the output)")
    args = parser.parse_args()
    dbs.create(BENCH_URL)
    try:
        import datetime as dt

        import django
        from django.core.management import call_command

        django.setup()
        call_command("migrate", verbosity=0)
        from django.utils import timezone

        from history import retention
        from history.checkpoints import take_checkpoint
        from runs.models import Run, RunEvent, Step
        from tenants.models import Tenant

        print(f"purge benchmark, database {TAG}, {os.cpu_count()} CPUs, load average {os.getloadavg()}")
        tenant, user, template = setup()
        took = seed(template, args.runs, args.steps, args.events)
        with django.db.connection.cursor() as cursor:
            cursor.execute("ANALYZE")
        print(
            f"seeded {args.runs} runs, {Step.objects.count()} steps, {RunEvent.objects.count()} events "
            f"in {took:.0f} s"
        )

        if args.find:
            find_subject(tenant, template, user, args.runs)

        stop = threading.Event()
        live = Live(user, stop)
        live.start()
        time.sleep(args.live_seconds)
        stop.set()
        live.join()
        if live.error:
            raise live.error
        print(latency_row("live runs alone", live.latencies[1:], args.live_seconds))

        Tenant.objects.filter(pk=tenant.pk).update(content_retention_seconds=90 * 86400)
        tenant.refresh_from_db()

        deadline = (lambda: time.monotonic() + args.purge_seconds) if args.purge_seconds else (lambda: None)

        def content_purge() -> list[float]:
            durations: list[float] = []
            until = deadline()
            while until is None or time.monotonic() < until:
                due = retention.due_runs(tenant, timezone.now(), 500)
                if not due:
                    return durations
                for run_id in due:
                    if until is not None and time.monotonic() >= until:
                        return durations
                    started = time.perf_counter()
                    retention._purge(tenant.pk, run_id)
                    durations.append(time.perf_counter() - started)
            return durations

        beside(user, f"content purge of {args.runs * args.steps} steps", content_purge, args.runs)
        # Sealed: the database cannot search the observations, but a purged one is NULL. The
        # seeded runs ended 129 days ago; the live runs beside the purge keep theirs.
        seeded = Step.objects.filter(run__finished_at__lt=timezone.now() - dt.timedelta(days=100))
        left = seeded.filter(observation__isnull=False).exclude(run=template).count()
        print(f"seeded steps still carrying the content: {left} (of {args.runs * args.steps})")

        if args.skeleton:
            take_checkpoint(now=timezone.now() - dt.timedelta(days=99))
            Tenant.objects.filter(pk=tenant.pk).update(skeleton_retention_seconds=95 * 86400)
            tenant.refresh_from_db()

            def skeleton_purge() -> list[float]:
                durations: list[float] = []
                until = deadline()
                now = timezone.now()
                while until is None or time.monotonic() < until:
                    due = retention.skeleton_due(tenant, now, 500)
                    if not due:
                        return durations
                    for run_id, _agent, period in due:
                        if until is not None and time.monotonic() >= until:
                            return durations
                        started = time.perf_counter()
                        assert retention._delete(tenant.pk, run_id, period, now) == "purged"
                        durations.append(time.perf_counter() - started)
                return durations

            beside(user, f"skeleton purge of {args.runs * args.steps} steps", skeleton_purge, args.runs)
            print(f"runs left: {Run.objects.count()} (the live ones), steps left: {Step.objects.count()}")
        elif args.skeleton_months:
            take_checkpoint(now=timezone.now() - dt.timedelta(days=99))
            Tenant.objects.filter(pk=tenant.pk).update(skeleton_retention_seconds=95 * 86400)
            # The template run and the live ones are of this month: they stay.

            def month_purge() -> list[float]:
                started = time.perf_counter()
                report = retention.drop_due_months()
                assert report.dropped, report.kept
                return [time.perf_counter() - started]

            beside(user, f"skeleton purge of {args.runs * args.steps} steps, whole months", month_purge, 1)
            print(
                f"runs left: {Run.objects.count()} (the live ones), steps left: {Step.objects.count()}, "
                f"tombstones: {retention.RunTombstone.objects.count()}"
            )
        print(f"load average after: {os.getloadavg()}")
    finally:
        from django.db import connections

        connections.close_all()
        if args.keep:
            print(f"kept database {TAG}")
        else:
            dbs.drop(BENCH_URL)


if __name__ == "__main__":
    main()
