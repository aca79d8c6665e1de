"""Budget reservations under contention: reserve+settle pairs on one hot tenant-day account.

    DATABASE_URL=postgres://root@127.0.0.1:5432/test .venv/bin/python bench/budget.py

DATABASE_URL only says where PostgreSQL is: the benchmark creates its own database
`bench_budget_<pid>`, migrates it, and drops it at the end; no other database is touched.

Each client is a thread with its own database connection, acting for its own run: a pair is
budgets.services.reserve (tenant day + run account) followed by settle with an actual cost a
little below the reservation, exactly what the engine does around every model or tool call.
Clients run in one process, or spread over BENCH_PROCESSES (8) processes the way Celery worker
processes would be (one Python process runs Python on one core at a time).

Scenarios:
  1 client / 64 clients   pairs per second over BENCH_SECONDS (10) each, p50/p99 pair latency;
                          64 clients in one process and in BENCH_PROCESSES processes, all of
                          them on one tenant day (split into BUDGET_DAY_SHARDS sub-accounts)
  limit race              64 clients reserve against a day with room for BENCH_RACE_ROOM (500)
                          reservations: successes must equal the room, spent must stay <= limit
  step overhead           one uncontended run: reserve+settle vs an empty transaction, wall time
                          and CPU (this process and its PostgreSQL backend, read from /proc)

After each scenario the accounts are checked: no negative balance, spent <= limit, nothing
left reserved, and the ledger (budgets.selectors.ledger_mismatches) agrees with every balance.

Options (environment): BENCH_SECONDS (10), BENCH_CLIENTS (64), BENCH_PROCESSES (8),
BENCH_RACE_ROOM (500), BUDGET_DAY_SHARDS (8).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import dbs

SECONDS = float(os.environ.get("BENCH_SECONDS", 10))
CLIENTS = int(os.environ.get("BENCH_CLIENTS", 64))
PROCESSES = int(os.environ.get("BENCH_PROCESSES", 8))
RACE_ROOM = int(os.environ.get("BENCH_RACE_ROOM", 500))
AMOUNT = 10_000  # micros reserved per call
TAG = f"bench_budget_{os.getpid()}"

BASE_URL = os.environ.get("DATABASE_URL", "")
if not BASE_URL.startswith("postgres"):
    sys.exit("DATABASE_URL must point at PostgreSQL (only its server is used; a throwaway database is made)")


BENCH_URL = dbs.with_database(BASE_URL, TAG)
os.environ["DATABASE_URL"] = BENCH_URL
os.environ.pop("CONTENT_KEYS_DATABASE_URL", None)  # the key store beside it: bench/dbs.py drops both
os.environ["CELERY_BROKER_URL"] = "memory://"  # start_run enqueues; nothing consumes here
os.environ.pop("DB_POOL_MAX", None)  # one plain connection per client thread
os.environ.setdefault("LOG_LEVEL", "ERROR")
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agentplatform.settings")


# --- setup -------------------------------------------------------------------------------------


def make_runs(count: int, *, daily_budget: int):
    from guardian.shortcuts import assign_perm

    from agents.services import create_version
    from llm.models import ModelEndpoint
    from runs.services import start_run
    from tenants.models import Tenant, User

    slug = f"t{time.monotonic_ns()}"
    tenant = Tenant.objects.create(
        slug=slug,
        name=slug,
        daily_budget_micros=daily_budget,
        max_active_runs=10_000,
        max_starts_per_minute=10_000,
        max_cost_micros_cap=10**15,
    )
    user = User.objects.create_user(username=f"{slug}-user", password="pw", tenant=tenant)
    ModelEndpoint.objects.create(tenant=tenant, name="scripted", kind="scripted")
    version, _ = create_version(
        tenant=tenant,
        agent="bench",
        spec={"model": "scripted", "instructions": "bench", "limits": {"max_cost_micros": 10**14}},
    )
    assign_perm("agents.run_agent", user, version.agent)
    return tenant, [start_run(user=user, agent="bench", version=1, input={"i": i})[0] for i in range(count)]


# --- clients -----------------------------------------------------------------------------------


class Client(threading.Thread):
    """Reserve+settle pairs in a loop until told to stop (or until refused, in a race)."""

    def __init__(self, tenant, run, stop: threading.Event, *, until_refused: bool = False):
        super().__init__(daemon=True)
        self.tenant, self.agent_run, self.stop_event, self.until_refused = tenant, run, stop, until_refused
        self.latencies: list[float] = []
        self.refused = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        from django.db import connection

        from budgets import services as budgets

        try:
            n = 0
            while not self.stop_event.is_set():
                started = time.perf_counter()
                try:
                    reservation = budgets.reserve(
                        tenant=self.tenant, run=self.agent_run, amount_micros=AMOUNT, purpose="model"
                    )
                except budgets.BudgetExceeded:
                    self.refused += 1
                    if self.until_refused:
                        return
                    continue
                actual = AMOUNT if self.until_refused else AMOUNT - 1 - n % 1000
                budgets.settle(reservation.pk, actual_micros=actual)
                self.latencies.append(time.perf_counter() - started)
                n += 1
        except BaseException as exc:  # reported by the main thread
            self.error = exc
        finally:
            connection.close()


def drive(tenant, runs, seconds: float | None, *, until_refused: bool = False) -> tuple[float, list[Client]]:
    stop = threading.Event()
    clients = [Client(tenant, run, stop, until_refused=until_refused) for run in runs]
    # Open every connection first so the timed window measures pairs, not connects.
    from django.db import connection

    connection.ensure_connection()
    started = time.perf_counter()
    for client in clients:
        client.start()
    if seconds is not None:
        time.sleep(seconds)
        stop.set()
    for client in clients:
        client.join()
    elapsed = time.perf_counter() - started
    for client in clients:
        if client.error:
            raise client.error
    return elapsed, clients


# --- checks ------------------------------------------------------------------------------------


def check_accounts(tenant) -> dict:
    from budgets.models import BudgetAccount, Reservation
    from budgets.selectors import ledger_mismatches

    accounts = list(BudgetAccount.objects.filter(tenant=tenant))
    for a in accounts:
        assert min(a.reserved_micros, a.spent_micros, a.held_micros) >= 0, f"negative balance on {a}"
        assert a.reserved_micros == 0, f"{a} still has {a.reserved_micros} reserved"
        assert a.spent_micros <= a.limit_micros, f"{a} overspent: {a.spent_micros} > {a.limit_micros}"
        problems = ledger_mismatches(a)
        assert not problems, f"ledger of {a} disagrees: {problems}"
    assert not Reservation.objects.filter(tenant=tenant, status="open").exists()
    from budgets.services import local_day, tenant_day_account

    day = tenant_day_account(tenant, local_day(tenant))  # the sums of the day's sub-accounts
    assert day.spent_micros <= day.limit_micros, f"the day overspent: {day.spent_micros} > {day.limit_micros}"
    return {"spent": day.spent_micros, "limit": day.limit_micros}


# --- scenarios ---------------------------------------------------------------------------------


def _client_process(tenant, runs, start_at: float, results) -> None:
    """One client process: its share of the clients as threads, from a common start time."""
    from django.db import connections

    connections.close_all()  # connections inherited from the parent are not ours to use
    time.sleep(max(start_at - time.time(), 0))
    elapsed, clients = drive(tenant, runs, SECONDS)
    results.put(([x for c in clients for x in c.latencies], elapsed))


def throughput(clients_n: int, processes: int = 1) -> dict:
    tenant, runs = make_runs(clients_n, daily_budget=10**15)
    if processes == 1:
        elapsed, clients = drive(tenant, runs, SECONDS)
        latencies = sorted(x for c in clients for x in c.latencies)
    else:
        from django.db import connections

        connections.close_all()  # before fork: each child opens its own
        context = multiprocessing.get_context("fork")
        results = context.Queue()
        start_at = time.time() + 2  # every child connected and waiting
        children = [
            context.Process(target=_client_process, args=(tenant, runs[i::processes], start_at, results))
            for i in range(processes)
        ]
        for child in children:
            child.start()
        parts = [results.get(timeout=SECONDS + 120) for _ in children]
        for child in children:
            child.join()
        latencies = sorted(x for part, _ in parts for x in part)
        elapsed = max(seconds for _, seconds in parts)
    check_accounts(tenant)
    return {
        "clients": clients_n,
        "processes": processes,
        "pairs": len(latencies),
        "pairs_s": len(latencies) / elapsed,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
    }


def limit_race() -> dict:
    tenant, runs = make_runs(CLIENTS, daily_budget=RACE_ROOM * AMOUNT)
    elapsed, clients = drive(tenant, runs, None, until_refused=True)
    totals = check_accounts(tenant)
    granted = sum(len(c.latencies) for c in clients)
    assert granted == RACE_ROOM, f"granted {granted} reservations for room {RACE_ROOM}"
    assert totals["spent"] == totals["limit"]
    return {
        "room": RACE_ROOM,
        "granted": granted,
        "refused": sum(c.refused for c in clients),
        "spent": totals["spent"],
        "limit": totals["limit"],
        "seconds": elapsed,
    }


def step_overhead(repeats: int = 500) -> dict:
    """Mean wall time of reserve+settle vs an empty transaction, and the CPU a pair costs.

    CPU is read from /proc for this process and for its PostgreSQL backend (same machine), so it
    does not depend on how busy the machine is: it bounds what two cores can do at best.
    """
    from django.db import connection, transaction

    from budgets import services as budgets

    tenant, (run,) = make_runs(1, daily_budget=10**15)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        backend = cursor.fetchone()[0]

    def backend_cpu() -> float | None:
        try:
            fields = Path(f"/proc/{backend}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # PostgreSQL on another machine
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def noop() -> None:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT 1")

    def pair() -> None:
        reservation = budgets.reserve(tenant=tenant, run=run, amount_micros=AMOUNT, purpose="model")
        budgets.settle(reservation.pk, actual_micros=AMOUNT - 1)

    def measure(fn) -> dict:
        for _ in range(20):  # warm up: connection, prepared statements
            fn()
        wall, cpu, pg = time.perf_counter(), time.process_time(), backend_cpu()
        for _ in range(repeats):
            fn()
        after = backend_cpu()
        return {
            "wall_ms": 1000 * (time.perf_counter() - wall) / repeats,
            "python_cpu_ms": 1000 * (time.process_time() - cpu) / repeats,
            "postgres_cpu_ms": None if pg is None else 1000 * (after - pg) / repeats,
        }

    noop_row, pair_row = measure(noop), measure(pair)
    check_accounts(tenant)
    return {"noop": noop_row, "pair": pair_row, "added_ms": pair_row["wall_ms"] - noop_row["wall_ms"]}


def main() -> None:
    dbs.create(BENCH_URL)
    try:
        import django
        from django.core.management import call_command

        django.setup()
        call_command("migrate", verbosity=0)
        print(
            f"budget benchmark on {os.cpu_count()} CPUs, database {TAG}, {SECONDS:.0f}s per throughput run, "
            f"load average before: {os.getloadavg()[0]:.1f}\n"
        )
        from budgets.services import day_shards

        rows = [throughput(1), throughput(CLIENTS), throughput(CLIENTS, PROCESSES)]
        print(f"one tenant day in {day_shards()} sub-accounts (BUDGET_DAY_SHARDS)")
        print(f"{'clients':>8} {'processes':>10} {'pairs':>8} {'pairs/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
        for row in rows:
            print(
                f"{row['clients']:>8} {row['processes']:>10} {row['pairs']:>8} {row['pairs_s']:>9.0f} "
                f"{row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f}"
            )
        race = limit_race()
        print(
            f"\nlimit race: {CLIENTS} clients, room for {race['room']} reservations: granted {race['granted']}, "
            f"refused {race['refused']}, spent {race['spent']} of {race['limit']} micros "
            f"({race['seconds']:.2f}s)"
        )
        overhead = step_overhead()
        print("\nper step, one uncontended run (mean of 500):")
        print(f"{'':>20} {'wall ms':>8} {'python cpu ms':>14} {'postgres cpu ms':>16}")
        for label, row in (("empty transaction", overhead["noop"]), ("reserve + settle", overhead["pair"])):
            pg = "n/a" if row["postgres_cpu_ms"] is None else f"{row['postgres_cpu_ms']:.3f}"
            print(f"{label:>20} {row['wall_ms']:>8.3f} {row['python_cpu_ms']:>14.3f} {pg:>16}")
        print(f"{'added per step':>20} {overhead['added_ms']:>8.3f}")
        pair_cpu = overhead["pair"]["python_cpu_ms"] + (overhead["pair"]["postgres_cpu_ms"] or 0)
        print(
            f"CPU per pair {pair_cpu:.2f} ms: at best about {1000 * (os.cpu_count() or 1) / pair_cpu:.0f} pairs/s "
            f"on {os.cpu_count()} cores if nothing else ran"
        )
        print(
            f"\nload average after: {os.getloadavg()[0]:.1f} (other work on this machine skews the figures)"
        )
        print("checks passed: no negative balance, spent <= limit, nothing left reserved, ledger = balances")
    finally:
        from django.db import connections

        connections.close_all()
        dbs.drop(BENCH_URL)


if __name__ == "__main__":
    main()
