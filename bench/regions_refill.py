"""Issue 36's refill benchmark: 100 runs away from home never park for budget while the home has
budget left, and how long refills take.

This process is Frankfurt (its database is the one DATABASE_URL names). Mumbai, the tenant's
home, is a throwaway PostgreSQL cluster, its own Redis and its API under uvicorn, reached through
a TCP proxy (tests/regions/conftest.py's `Home`, tests/regions/link.py), as in the regions tests.
Per scenario, one tenant whose home is Mumbai: a day budget of `--budget-factor` (3) times what
its runs are expected to cost, slices of the default size (a tenth of the day) unless `--slice`
says so, runs of tests/regions/race.py's agent (three model calls, two tool calls). Frankfurt's
beat is played by threads on its real periods: the slice keeper (regions.services.tend_all every
REGION_TEND_SECONDS, 1 s) and the sweeper (runs.recovery.sweeper.sweep, which admits waiting
runs, every SWEEP_INTERVAL_SECONDS, 5 s); `--workers` threads (4) call runs.engine.advance on
every queued or running run, one engine task at a time per run, as Celery workers do.

    python -m tests.services -- sh -c '.venv/bin/python manage.py migrate -v0 && \
        .venv/bin/python -m bench.regions_refill --runs 100 --arrival both --over 30'

Scenarios: `burst` starts every run at once (20 threads calling start_run); `steady` starts one
every `--over`/`--runs` seconds. Measured per scenario:

| figure | read from |
|---|---|
| runs parked for budget, by reason | status events to waiting_budget after admission (runs/engine/dispatch.py `_record_budget_refusal`; the reason is the event's `region_reason`) |
| the home's room at each park | a signed probe of the home (what it would lend now) and its day's free room, read when the park is seen (within 50 ms) |
| runs stopped on the day's budget | stop_reason tenant_budget_exhausted |
| admission waits | runs that waited in waiting_budget before admitted_at (runs/admission.py): created_at to admitted_at |
| refill round trips | SliceRequest (grant) created_at to answered_at; the keeper's last HomeLink.refill_ms |
| wall time | first start_run to the last run ended |
| the ledgers | both sides' day accounts once the runs ended: spent = the steps' costs, nothing reserved or held, home limit + Frankfurt's = the day |

Exits 1 when a run parked or stopped for budget while the home had room to lend, when a run did
not succeed, or when the books disagree (a check that can fail). Prints the load average: the
figures on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import math
import os
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agentplatform.settings")

ZONE = "Asia/Kolkata"
STARTERS = 20  # threads calling start_run in a burst
TOOL_PRICE = 700  # tests/regions/race.py's echo price: a run expects 4 model calls and 2 of these


def percentile(values: list[float], p: float) -> float | None:
    """Nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(p / 100 * len(ordered)) - 1, 0)]


class Beat:
    """Frankfurt's beat and workers as threads: the keeper, the sweeper, and workers advancing
    every active run (one engine task at a time per run)."""

    def __init__(self, *, workers: int, tend_seconds: float, sweep_seconds: float):
        from regions import services as regions
        from runs.recovery import sweeper

        self.errors: list[BaseException] = []
        self.passes = 0
        self._stop = threading.Event()
        self._todo: queue.Queue = queue.Queue()
        self._inflight: set = set()
        self._lock = threading.Lock()

        def tend() -> None:
            regions.tend_all()
            self.passes += 1

        self._threads = [
            threading.Thread(target=self._every, args=(tend_seconds, tend), daemon=True),
            threading.Thread(target=self._every, args=(sweep_seconds, sweeper.sweep), daemon=True),
            threading.Thread(target=self._every, args=(0.02, self._dispatch), daemon=True),
            *(threading.Thread(target=self._work, daemon=True) for _ in range(workers)),
        ]

    def start(self) -> Beat:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _every(self, seconds: float, body) -> None:
        from django.db import connection

        due = time.monotonic()
        try:
            while not self._stop.is_set():
                body()
                due = max(due + seconds, time.monotonic())  # beat's period: a slow pass is not repeated
                self._stop.wait(due - time.monotonic())
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            connection.close()

    def _dispatch(self) -> None:
        from runs.models import Run, RunStatus

        ids = Run.objects.filter(status__in=(RunStatus.QUEUED, RunStatus.RUNNING)).values_list(
            "pk", flat=True
        )
        with self._lock:
            fresh = [run_id for run_id in ids if run_id not in self._inflight]
            self._inflight.update(fresh)
        for run_id in fresh:
            self._todo.put(run_id)

    def _work(self) -> None:
        from django.db import connection

        from runs.engine import advance

        try:
            while not self._stop.is_set():
                try:
                    run_id = self._todo.get(timeout=0.2)
                except queue.Empty:
                    continue
                try:
                    advance(run_id)
                finally:
                    with self._lock:
                        self._inflight.discard(run_id)
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            connection.close()


class HomeRoom:
    """What the home has for the tenant's day, asked the moment a park is seen: what it would lend
    Frankfurt now (the keeper's signed probe) and its day's free room (read from its database)."""

    def __init__(self, home, tenant, day: dt.date):
        import psycopg

        from budgets.models import BudgetAccount
        from tenants.models import Tenant

        self.tenant, self.day = tenant, day
        self._db = psycopg.connect(
            home.pg.url("home").replace("postgres://", "postgresql://", 1), autocommit=True
        )
        self._sql = (
            "SELECT COALESCE(SUM(a.limit_micros - a.reserved_micros - a.spent_micros - a.held_micros), 0) "
            f"FROM {BudgetAccount._meta.db_table} a JOIN {Tenant._meta.db_table} t ON t.id = a.tenant_id "
            "WHERE t.slug = %s AND a.scope = 'tenant_day' AND a.day = %s"
        )

    def now(self) -> tuple[int | None, int]:
        from regions import client

        try:
            answer = client.call_home(
                "mumbai", client.PROBE_PATH, {"tenant": self.tenant.slug, "day": self.day.isoformat()}
            )
            lendable = int(answer["home_free_micros"])
        except client.HomeUnreachable:
            lendable = None
        return lendable, int(self._db.execute(self._sql, (self.tenant.slug, self.day)).fetchone()[0])

    def close(self) -> None:
        self._db.close()


def watch_parks(tenant, room: HomeRoom, stop: threading.Event, parks: list, loads: list) -> None:
    """Every 50 ms: the tenant's new status events to waiting_budget after admission (a park),
    each with the home's room right then; and the load average."""
    from django.db import connection

    from regions.models import HomeLink
    from runs.models import RunEvent

    seen = 0
    try:
        while not stop.is_set():
            loads.append(os.getloadavg()[0])
            for event in RunEvent.objects.filter(
                run__tenant=tenant, kind="status", skeleton__to="waiting_budget", id__gt=seen
            ).order_by("id"):
                seen = event.id
                if event.data.get("admission"):
                    continue
                lendable, free = room.now()
                believed = (
                    HomeLink.objects.filter(tenant=tenant).values_list("home_free_micros", flat=True).first()
                )
                parks.append(
                    {
                        "run": event.run_id,
                        "at": event.at,
                        "reason": event.data.get("region_reason") or event.message,
                        "home_lendable": lendable,
                        "home_free": free,
                        "link_believed": believed,
                    }
                )
            stop.wait(0.05)
    finally:
        connection.close()


def scenario(name: str, home, beat: Beat, args) -> dict:
    """One tenant, `args.runs` runs started in Frankfurt as `name` says; its figures."""
    from django.db import connection
    from django.db.models import Sum
    from django.utils import timezone

    from budgets import services as budgets
    from regions.models import Heartbeat, HomeLink, SliceRequest, TenantRegions
    from regions.selectors import region_books
    from runs.models import TERMINAL, Run, RunEvent, Step, StopReason
    from runs.services import start_run
    from tests import factories
    from tests.regions import race

    slug = f"refill-{name}-{int(time.time())}"
    tenant = factories.make_tenant(slug, time_zone=ZONE, max_active_runs=1000, max_starts_per_minute=1000)
    user = factories.make_user(tenant, f"asha-{slug}")
    per_call = race.make_racing_agent(tenant, user, factories, tool_price=TOOL_PRICE)
    expected = 4 * per_call + 2 * TOOL_PRICE
    tenant.daily_budget_micros = args.budget_factor * args.runs * expected
    tenant.save()
    slice_micros = args.slice_runs * expected  # 0: the default, a tenth of the day
    answer = home.run(
        "setup",
        {
            "slug": slug,
            "daily": tenant.daily_budget_micros,
            "slice": slice_micros,
            "zone": ZONE,
            "regions": ["mumbai", "frankfurt"],
        },
    )
    assert answer["per_call"] == per_call  # the same agent, priced the same, at home
    # Known at home first: a keeper's pass before would find no tenant there (404, link down).
    Heartbeat.objects.update_or_create(region="mumbai", defaults={"beat_at": timezone.now()})
    config = TenantRegions.objects.create(
        tenant=tenant,
        home="mumbai",
        allowed=["mumbai", "frankfurt"],
        slice_micros=slice_micros,
        revocation_reach_seconds=86_400,  # authority's reach is not measured here
    )
    day = budgets.local_day(tenant)
    if not args.cold:  # a region at rest holds the slice its keeper keeps at hand
        deadline = time.monotonic() + 60
        while not budgets.tenant_day_account(tenant, day).limit_micros and time.monotonic() < deadline:
            time.sleep(0.1)
    room = HomeRoom(home, tenant, day)
    parks: list = []
    loads: list = []
    stop = threading.Event()
    watcher = threading.Thread(target=watch_parks, args=(tenant, room, stop, parks, loads), daemon=True)
    watcher.start()

    def begin(i: int) -> None:
        try:
            start_run(user=user, agent="agent", input={"i": i}, wait=True)
        finally:
            connection.close()

    began_at = timezone.now()
    started = time.monotonic()
    if name == "burst":
        with ThreadPoolExecutor(STARTERS) as pool:
            list(pool.map(begin, range(args.runs)))
    else:
        for i in range(args.runs):
            time.sleep(max(started + i * args.over / args.runs - time.monotonic(), 0))
            begin(i)
    runs = Run.objects.filter(tenant=tenant)
    deadline = time.monotonic() + args.timeout
    while runs.exclude(status__in=TERMINAL).exists() and time.monotonic() < deadline:
        if beat.errors:
            raise beat.errors[0]
        time.sleep(0.1)
    ended = runs.exclude(status__in=TERMINAL).count() == 0
    last = runs.order_by("-finished_at").values_list("finished_at", flat=True).first()
    wall = (last - began_at).total_seconds() if ended and last else None
    stop.set()
    watcher.join(30)

    # Admission waits: from the status event that put a run in admission's queue to its next
    # one (admitted). Not admitted_at: the sweeper stamps it with the start of its pass.
    admission_waits = []
    for queued in RunEvent.objects.filter(run__tenant=tenant, kind="status", skeleton__admission=True):
        admitted = (
            RunEvent.objects.filter(run_id=queued.run_id, kind="status", seq__gt=queued.seq)
            .order_by("seq")
            .values_list("at", flat=True)
            .first()
        )
        if admitted:
            admission_waits.append((admitted - queued.at).total_seconds())
    park_waits = []
    for park in parks:
        resumed = (
            RunEvent.objects.filter(run_id=park["run"], kind="status", at__gte=park["at"])
            .exclude(skeleton__to="waiting_budget")
            .order_by("at", "id")
            .values_list("at", flat=True)
            .first()
        )
        if resumed:
            park_waits.append((resumed - park["at"]).total_seconds())
    # The grants the runs needed: those answered after the first start (not the one at rest).
    grants = SliceRequest.objects.filter(
        tenant=tenant, kind="grant", status="applied", answered_at__gte=began_at
    )
    refills = [(g.answered_at - g.created_at).total_seconds() * 1000 for g in grants]
    first_grant = grants.order_by("answered_at").values_list("answered_at", flat=True).first()

    # The books, once the keeper sent what is pending (the runs have ended; the keeper goes on).
    deadline = time.monotonic() + 60
    while (
        SliceRequest.objects.filter(tenant=tenant, status="pending").exists() and time.monotonic() < deadline
    ):
        time.sleep(0.5)
    at_home = home.run("books", {"slug": slug, "day": day.isoformat()})
    here = race.books(tenant)
    home_day = at_home["days"].get(day.isoformat(), {})
    away_day = here["days"].get(day.isoformat(), {})
    lent = at_home["lent"].get("frankfurt", {"granted": 0, "returned": 0})
    problems = []
    if at_home["check"]:
        problems.append(f"home books: {at_home['check']}")
    if region_books(tenant, day):
        problems.append(f"Frankfurt books: {region_books(tenant, day)}")
    if lent["granted"] - lent["returned"] != away_day.get("limit"):
        problems.append(f"lent to Frankfurt {lent} but its limit is {away_day.get('limit')}")
    for side, books in (("home", at_home), ("Frankfurt", here)):
        spent = sum(d["spent"] for d in books["days"].values())
        if spent != books["step_costs"]:
            problems.append(f"{side} spent {spent}, its steps cost {books['step_costs']}")
        if any(d["reserved"] or d["held"] for d in books["days"].values()):
            problems.append(f"{side} still reserves or holds: {books['days']}")
    if home_day.get("limit", 0) + away_day.get("limit", 0) != tenant.daily_budget_micros:
        problems.append("home limit + Frankfurt limit is not the daily budget")
    room.close()
    link = HomeLink.objects.filter(tenant=tenant).first()
    statuses = dict(here["runs"])
    stalled = [p for p in parks if (p["home_lendable"] or 0) > 0 or p["home_free"] > 0]
    stopped = runs.filter(stop_reason=StopReason.TENANT_BUDGET_EXHAUSTED).count()
    return {
        "name": name,
        "daily": tenant.daily_budget_micros,
        "slice": config.slice_size(tenant.daily_budget_micros),
        "expected": expected,
        "runs": runs.count(),
        "statuses": statuses,
        "ended": ended,
        "wall": wall,
        "parks": parks,
        "stalled": stalled,
        "stopped_on_budget": stopped,
        "admission_waits": admission_waits,
        "park_waits": park_waits,
        "refills": refills,
        "last_refill_ms": link.refill_ms if link else None,
        "first_slice_s": (first_grant - began_at).total_seconds() if first_grant else None,
        "grants": len(refills),
        "returns": SliceRequest.objects.filter(tenant=tenant, kind="return").count(),
        "spent": (home_day.get("spent"), away_day.get("spent")),
        "step_costs": Step.objects.filter(run__tenant=tenant).aggregate(c=Sum("cost_micros"))["c"] or 0,
        "limits": (home_day.get("limit"), away_day.get("limit")),
        "problems": problems,
        "load": (min(loads, default=0.0), max(loads, default=0.0)),
        "keeper_passes": beat.passes,
    }


def report(results: list[dict]) -> bool:
    """Print the table; True when every scenario passed."""

    def ms(value):
        return "-" if value is None else f"{value:.0f}"

    def s(value):
        return "-" if value is None else f"{value:.2f}"

    rows: list[tuple[str, list[str]]] = []

    def row(label: str, cell) -> None:
        rows.append((label, [cell(r) for r in results]))

    def by_reason(r: dict) -> str:
        counts: dict[str, int] = {}
        for park in r["parks"]:
            counts[park["reason"]] = counts.get(park["reason"], 0) + 1
        return ", ".join(f"{n} {reason!r}" for reason, n in counts.items()) or "0"

    row("daily budget / slice (micros)", lambda r: f"{r['daily']} / {r['slice']}")
    row("slice in runs' expected cost", lambda r: f"{r['slice'] / r['expected']:.1f}")
    row("runs (by status)", lambda r: f"{r['runs']} {r['statuses']}")
    row("wall time s (start to last end)", lambda r: s(r["wall"]))
    row("parked for budget, by reason", by_reason)
    row("  of them with room at home", lambda r: str(len(r["stalled"])))
    row(
        "  park to resume s p50 / max",
        lambda r: f"{s(percentile(r['park_waits'], 50))} / {s(max(r['park_waits'], default=None))}",
    )
    row("stopped on the day's budget", lambda r: str(r["stopped_on_budget"]))
    row("waited for admission", lambda r: str(len(r["admission_waits"])))
    row(
        "  admission wait s p50 / p99 / max",
        lambda r: " / ".join(s(percentile(r["admission_waits"], p)) for p in (50, 99, 100)),
    )
    row("first grant after the first start s", lambda r: s(r["first_slice_s"]))
    row("grants applied / returns", lambda r: f"{r['grants']} / {r['returns']}")
    row(
        "refill round trip ms p50 / p99",
        lambda r: f"{ms(percentile(r['refills'], 50))} / {ms(percentile(r['refills'], 99))}",
    )
    row("keeper's last refill_ms", lambda r: ms(r["last_refill_ms"]))
    row("limit home / Frankfurt", lambda r: f"{r['limits'][0]} / {r['limits'][1]}")
    row("spent home / Frankfurt (steps)", lambda r: f"{r['spent'][0]} / {r['spent'][1]} ({r['step_costs']})")
    row("books", lambda r: "; ".join(r["problems"]) or "agree (nothing reserved or held)")
    row("load average (1 min) min-max", lambda r: f"{r['load'][0]:.1f}-{r['load'][1]:.1f}")
    width = max(len(label) for label, _ in rows)
    print("\n" + " " * width + "  " + "  ".join(f"{r['name']:<24}" for r in results))
    for label, cells in rows:
        print(f"{label:<{width}}  " + "  ".join(f"{c:<24}" for c in cells))
    for r in results:
        for park in r["stalled"][:20]:
            print(
                f"{r['name']}: run {park['run']} parked {park['reason']!r} at {park['at']:%H:%M:%S.%f}; "
                f"the home would lend {park['home_lendable']}, its day had {park['home_free']} free "
                f"(Frankfurt believed {park['link_believed']})"
            )
    passed = True
    for r in results:
        failures = []
        if r["stalled"]:
            failures.append(f"{len(r['stalled'])} parks with room at home")
        if r["stopped_on_budget"]:
            failures.append(f"{r['stopped_on_budget']} runs stopped on the day's budget")
        if not r["ended"] or r["statuses"].get("succeeded", 0) != r["runs"]:
            failures.append(f"not every run succeeded: {r['statuses']}")
        failures += r["problems"]
        print(f"{r['name']}: " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)))
        passed &= not failures
    return passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--arrival", choices=("burst", "steady", "both"), default="both")
    parser.add_argument("--over", type=float, default=30.0, help="seconds the steady arrivals span")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--budget-factor", type=int, default=3, help="the day, in times the runs' expected cost"
    )
    parser.add_argument(
        "--slice-runs", type=int, default=0, help="slice size in runs' expected cost; 0: a tenth of the day"
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="start the runs before the keeper's first slice (a day's first runs)",
    )
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()

    os.environ["REGION"] = "frankfurt"  # before settings are read: beat's schedule for a region
    import django

    django.setup()
    from django.conf import settings

    # One warning per run waiting for admission would bury the table; the keeper's stay.
    logging.getLogger("agentplatform.runs").setLevel(logging.ERROR)

    from tests.regions.conftest import KEY, Home, _copy_schema
    from tests.regions.link import Link
    from tests.services import ThrowawayPostgres, ThrowawayRedis

    print(f"load average at start {os.getloadavg()}", flush=True)
    pg, redis = ThrowawayPostgres.create(), ThrowawayRedis.create()
    home = link = beat = None
    try:
        pg.start()
        redis.start()
        pg.create_database("home")
        _copy_schema(pg)
        home = Home(pg, redis)
        link = Link(home.port)
        settings.REGION_PEERS = {"mumbai": link.url}
        settings.REGION_KEYS = {"mumbai": KEY}
        tend_seconds = float(settings.CELERY_BEAT_SCHEDULE["regions"]["schedule"])
        sweep_seconds = float(settings.CELERY_BEAT_SCHEDULE["sweep"]["schedule"])
        print(
            f"home API on :{home.port} behind the link :{link.port}; keeper every {tend_seconds:g} s, "
            f"sweeper every {sweep_seconds:g} s, {args.workers} workers, REGION_TIMEOUT_SECONDS "
            f"{settings.REGION_TIMEOUT_SECONDS:g}",
            flush=True,
        )
        beat = Beat(workers=args.workers, tend_seconds=tend_seconds, sweep_seconds=sweep_seconds).start()
        names = ("burst", "steady") if args.arrival == "both" else (args.arrival,)
        results = []
        for name in names:
            results.append(scenario(name, home, beat, args))
            print(f"{name} done", flush=True)
        passed = report(results)
        print(f"load average at end {os.getloadavg()}")
    finally:
        if beat is not None:
            beat.stop()
        if link is not None:
            link.close()
        if home is not None:
            home.stop()
        redis.destroy()
        pg.destroy()
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
