"""Engine throughput against the raw Celery ceiling, on PostgreSQL + Redis + one worker process.

    DATABASE_URL=postgres://root@127.0.0.1:5432/test CELERY_BROKER_URL=redis://127.0.0.1:6379/15 \
        .venv/bin/python bench/engine.py

DATABASE_URL only says where PostgreSQL is: the benchmark creates its own database
`bench_engine_<pid>` (CREATE/DROP issued on the server's `postgres` database), migrates it with
`manage.py migrate`, and drops it at the end; no other database is touched. Messages go to a
private queue `bench_engine_<pid>` (CELERY_QUEUE) on the given broker, so a test worker on the
same Redis database never takes them, and the benchmark's worker takes none of theirs.

The worker is `celery -A agentplatform worker -P threads -c 128 -I bench.noop_tasks` with
DB_POOL_MAX=20 and DEBUG off (docs/performance.md says why).

Scenarios (one worker process, the pool and DB settings below, for all of them):
  raw chain      100 chains x 25 no-op tasks, each task enqueues the next (bench/noop_tasks.py)
  floor          the same chains, each task doing the least a durable step must: three
                 single-statement transactions (claim, mark dispatching, record), each a commit,
                 connection handed back to the pool in between (bench/noop_tasks.py floor_step)
  engine 0 ms    100 runs x 25 steps (13 model calls + 12 builtin `noop` tool calls), fake
                 OpenAI-compatible model answering at once
  engine 200 ms  the same with 200 ms model latency: needs ~100 runs in flight in one worker

Runs are created with runs.services.start_run while their first message is held back; the
clock starts when the 100 messages are published and stops at the last run's finished_at.

Options (environment): BENCH_RUNS (100), BENCH_STEPS (25 -> tool_turns 12), BENCH_POOL
(threads), BENCH_CONCURRENCY (128), BENCH_DB_POOL_MAX (20), BENCH_LATENCY_MS (200),
BENCH_SCENARIOS (raw,floor,engine0,engine200), BENCH_TIMEOUT (900 s per scenario).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import dbs

RUNS = int(os.environ.get("BENCH_RUNS", 100))
STEPS = int(os.environ.get("BENCH_STEPS", 25))  # odd: model, tool, model, ..., model
TOOL_TURNS = (STEPS - 1) // 2
POOL = os.environ.get("BENCH_POOL", "threads")
CONCURRENCY = int(os.environ.get("BENCH_CONCURRENCY", 128))
DB_POOL_MAX = int(os.environ.get("BENCH_DB_POOL_MAX", 20))
LATENCY_MS = int(os.environ.get("BENCH_LATENCY_MS", 200))
SCENARIOS = os.environ.get("BENCH_SCENARIOS", "raw,floor,engine0,engine200").split(",")
TIMEOUT = float(os.environ.get("BENCH_TIMEOUT", 900))
TAG = f"bench_engine_{os.getpid()}"

BASE_URL = os.environ.get("DATABASE_URL", "")
if not BASE_URL.startswith("postgres"):
    sys.exit("DATABASE_URL must point at PostgreSQL (only its server is used; a throwaway database is made)")
# Redis as the broker, or RabbitMQ with a Redis for the benchmark's own signals (bench/peers.py's
# -amqp scenarios set BENCH_REDIS_URL for their child).
if not (os.environ.get("CELERY_BROKER_URL", "").startswith("redis") or os.environ.get("BENCH_REDIS_URL")):
    sys.exit("CELERY_BROKER_URL must point at Redis (or set BENCH_REDIS_URL beside an amqp:// broker)")


BENCH_URL = dbs.with_database(BASE_URL, TAG)
os.environ["DATABASE_URL"] = BENCH_URL
os.environ.pop("CONTENT_KEYS_DATABASE_URL", None)  # the key store beside it: bench/dbs.py drops both
os.environ["CELERY_QUEUE"] = TAG  # settings: the default queue, here and in the worker
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agentplatform.settings")
os.environ.pop("DB_POOL_MAX", None)  # the benchmark process itself: plain connections


# --- processes ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_fake_model(latency_ms: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.fakes.model_servers",
            "--kind",
            "openai",
            "--port",
            str(port),
            "--latency-ms",
            str(latency_ms),
            "--tool-turns",
            str(TOOL_TURNS),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("fake model server exited") from None
            time.sleep(0.05)
    raise RuntimeError("fake model server did not start")


class Worker:
    def __init__(self):
        self.log = tempfile.NamedTemporaryFile(prefix=f"{TAG}-worker-", suffix=".log", delete=False)
        self.args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "agentplatform",
            "worker",
            "-P",
            POOL,
            "-c",
            str(CONCURRENCY),
            "-Q",
            TAG,
            "-n",
            f"{TAG}@%h",
            "-I",
            "bench.noop_tasks",
            "--loglevel",
            os.environ.get("BENCH_LOGLEVEL", "WARNING"),
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
        # DEBUG off as in production: with DEBUG on, Django keeps every query of every connection.
        self.env = dict(
            os.environ, DATABASE_URL=BENCH_URL, CELERY_QUEUE=TAG, PYTHONUNBUFFERED="1", DEBUG="false"
        )
        if DB_POOL_MAX:
            self.env["DB_POOL_MAX"] = str(DB_POOL_MAX)
            self.env["DB_POOL_CHECK"] = "0"  # as scripts/serve.sh starts workers
        self.proc: subprocess.Popen | None = None

    def start(self) -> Worker:
        self.proc = subprocess.Popen(
            self.args, cwd=ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT
        )
        # Ready when it consumes: a ping task round trip through the queue.
        import redis
        from django.conf import settings

        from bench.noop_tasks import noop_step

        r = redis.Redis.from_url(settings.CELERY_BROKER_URL)
        key = f"{TAG}:ping"
        noop_step.apply_async((key, 0, 1))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if r.blpop(key, timeout=0.5):
                r.delete(key)
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited: {self.output()[-3000:]}")
        raise RuntimeError(f"worker not ready: {self.output()[-3000:]}")

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class RssSampler:
    """RSS of a process tree, sampled from /proc every 100 ms; peak() since the last reset()."""

    def __init__(self, pid: int, interval: float = 0.1):
        self.pid = pid
        self.interval = interval
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="rss-sampler")
        self._thread.start()

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
        pids, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            pids.append(pid)
            todo.extend(children.get(pid, []))
        return pids

    def cpu_seconds(self) -> float:
        """User + system CPU time of the process tree so far."""
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0
        for pid in self._tree():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / ticks

    def sample(self) -> int:
        total = 0
        for pid in self._tree():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
            except OSError:
                pass
        return total

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._peak = max(self._peak, self.sample())

    def reset(self) -> None:
        self._peak = self.sample()

    def peak(self) -> int:
        return max(self._peak, self.sample())

    def stop(self) -> None:
        self._stop.set()


# --- data ----------------------------------------------------------------------------------------


def setup_tenant(fake_urls: dict[int, str]):
    from tests import factories

    tenant = factories.make_tenant(
        "bench", max_active_runs=10_000, max_starts_per_minute=100_000, daily_budget_micros=10**15
    )
    user = factories.make_user(tenant, "bench")
    noop = factories.make_builtin_tools(tenant)["noop"]
    factories.grant(noop, use=[user])
    agents = {}
    for latency, url in fake_urls.items():
        endpoint = factories.make_endpoint(tenant, name=f"fake-{latency}ms", kind="openai", base_url=url)
        factories.make_agent(tenant, name=f"bench-{latency}ms", tools=[noop], endpoint=endpoint)
        agents[latency] = f"bench-{latency}ms"
    return user, agents


class HeldMessages:
    """Let start_run do everything, but keep the first advance_run messages until release()."""

    def __init__(self):
        from runs.tasks import advance_run

        self.task = advance_run
        self.held: list[tuple] = []

    def __enter__(self):
        self.task.apply_async = lambda args=None, kwargs=None, **options: self.held.append((args, options))
        return self

    def __exit__(self, *exc):
        del self.task.apply_async  # back to the class attribute

    def release(self) -> None:
        for args, options in self.held:
            self.task.apply_async(args, **options)


def create_runs(user, agent: str, n: int):
    from runs.services import start_run

    with HeldMessages() as held:
        started = time.perf_counter()
        ids = [start_run(user=user, agent=agent, input={"task": f"bench {i}"})[0].pk for i in range(n)]
        created = time.perf_counter() - started
    return ids, held, created


# --- scenarios -----------------------------------------------------------------------------------


def scenario_raw(sampler: RssSampler, task=None) -> dict:
    import redis
    from django.conf import settings

    from bench.noop_tasks import noop_step

    task = task or noop_step
    r = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    key = f"{TAG}:raw"
    r.delete(key)
    sampler.reset()
    cpu = sampler.cpu_seconds()
    start = time.time()
    for chain in range(RUNS):
        task.apply_async((key, chain, STEPS))
    deadline = time.monotonic() + TIMEOUT
    while r.llen(key) < RUNS:
        if time.monotonic() > deadline:
            raise RuntimeError(f"raw chains: only {r.llen(key)}/{RUNS} finished in {TIMEOUT}s")
        time.sleep(0.02)
    end = max(float(item.split()[1]) for item in r.lrange(key, 0, -1))
    r.delete(key)
    return {
        "steps": RUNS * STEPS,
        "seconds": end - start,
        "rss": sampler.peak(),
        "cpu": sampler.cpu_seconds() - cpu,
    }


def scenario_engine(sampler: RssSampler, user, agent: str) -> dict:
    from django.db.models import Max

    from runs.models import TERMINAL, Run, Step, StepStatus

    ids, held, created = create_runs(user, agent, RUNS)
    sampler.reset()
    cpu = sampler.cpu_seconds()
    start = time.time()
    held.release()
    deadline = time.monotonic() + TIMEOUT
    runs = Run.objects.filter(pk__in=ids)
    while runs.exclude(status__in=TERMINAL).exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"engine: runs not finished in {TIMEOUT}s: {stuck_report(runs)}")
        time.sleep(0.25)  # the end time comes from finished_at, not from this poll
    rss = sampler.peak()
    cpu = sampler.cpu_seconds() - cpu
    bad = list(runs.exclude(status="succeeded").values_list("status", "error")[:5])
    if bad:
        raise RuntimeError(f"engine: runs did not succeed: {bad}")
    end = runs.aggregate(end=Max("finished_at"))["end"].timestamp()
    steps = Step.objects.filter(run_id__in=ids, status=StepStatus.SUCCEEDED).count()
    if steps != RUNS * STEPS:
        raise RuntimeError(f"engine: {steps} succeeded steps, expected {RUNS * STEPS}")
    return {"steps": steps, "seconds": end - start, "rss": rss, "created": created, "cpu": cpu}


def stuck_report(runs) -> str:
    import redis
    from django.conf import settings
    from django.db.models import Count
    from django.utils import timezone

    now = timezone.now()
    r = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    by_status = dict(runs.values_list("status").annotate(n=Count("pk")).order_by())
    leased = runs.filter(lease_token__isnull=False, lease_expires_at__gt=now).count()
    expired = runs.filter(lease_token__isnull=False, lease_expires_at__lte=now).count()
    return (
        f"runs by status {by_status}; leased {leased}, lease expired {expired}; queue length "
        f"{r.llen(TAG)}, unacked {r.hlen('unacked')}"
    )


TABLE = re.compile(
    r'(?:from|into|update|join)\s+"?((?:runs|budgets|tools|tenants|llm|agents|guardian|auth|'
    r"approvals)_[a-z_]+)",
    re.IGNORECASE,
)


def queries_per_step(user, agent: str) -> dict:
    """One run driven in-process: queries per advance(), by step kind."""
    import psycopg
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from runs.engine import advance
    from runs.models import READY, TERMINAL, Run, Step

    ids, _held, _ = create_runs(user, agent, 1)  # its message is never sent
    run_id = ids[0]
    per_kind: dict[str, list[int]] = {"model": [], "tool": []}
    tables: dict[str, int] = {}
    # Statements sent through any psycopg cursor of this thread, including raw ones that Django's
    # query log does not see (budgets/services.py prepares its statements on a psycopg cursor).
    sent = {"n": 0, "on": False}
    me = threading.get_ident()
    original = psycopg.Cursor.execute

    def counting(self, *args, **kwargs):
        if sent["on"] and threading.get_ident() == me:
            sent["n"] += 1
        return original(self, *args, **kwargs)

    psycopg.Cursor.execute = counting
    try:
        with HeldMessages():  # nor are the ones advance() enqueues
            for _ in range(STEPS * 2):
                kind_next = (
                    "tool"
                    if Step.objects.filter(run_id=run_id, kind="tool", status__in=READY).exists()
                    else "model"
                )
                sent["on"] = True
                with CaptureQueriesContext(connection) as ctx:
                    advance(run_id)
                sent["on"] = False
                per_kind[kind_next].append(len(ctx.captured_queries))
                count_statements(ctx.captured_queries, tables)
                if Run.objects.get(pk=run_id).status in TERMINAL:
                    break
    finally:
        psycopg.Cursor.execute = original
    run = Run.objects.get(pk=run_id)
    steps = Step.objects.filter(run_id=run_id).count()
    total = sum(per_kind["model"]) + sum(per_kind["tool"])
    return {
        "status": run.status,
        "steps": steps,
        "tasks": len(per_kind["model"]) + len(per_kind["tool"]),
        "total": total,
        "model": per_kind["model"],
        "tool": per_kind["tool"],
        "tables": tables,
        "sent": sent["n"],
    }


def count_statements(captured: list[dict], tables: dict[str, int]) -> None:
    for q in captured:
        sql = q["sql"].lstrip()
        verb = sql.split()[0].upper().lstrip("(")
        found = TABLE.search(sql)
        table = (
            ""
            if verb in {"SAVEPOINT", "RELEASE", "BEGIN", "COMMIT", "ROLLBACK"}
            else (found.group(1) if found else "?")
        )
        key = f"{verb} {table}".strip()
        tables[key] = tables.get(key, 0) + 1


# --- main ------------------------------------------------------------------------------------------


def main() -> None:
    fakes: dict[int, subprocess.Popen] = {}
    worker: Worker | None = None
    sampler: RssSampler | None = None
    dbs.create(BENCH_URL)
    try:
        subprocess.run(
            [sys.executable, "manage.py", "migrate", "-v", "0"],
            cwd=ROOT,
            check=True,
            env=dict(os.environ, DATABASE_URL=BENCH_URL),
        )
        import django

        django.setup()
        from django.db import connection

        with connection.cursor() as cur:
            cur.execute("SHOW max_connections")
            max_connections = int(cur.fetchone()[0])

        urls = {}
        for latency in (0, LATENCY_MS):
            fakes[latency], urls[latency] = start_fake_model(latency)
        user, agents = setup_tenant(urls)

        qps = queries_per_step(user, agents[0])

        worker = Worker().start()
        sampler = RssSampler(worker.proc.pid)
        results: dict[str, dict] = {}
        if "raw" in SCENARIOS:
            results["raw"] = scenario_raw(sampler)
        if "floor" in SCENARIOS:
            from bench.noop_tasks import create_floor_table, floor_step

            create_floor_table(RUNS)
            results["floor"] = scenario_raw(sampler, floor_step)
        if "engine0" in SCENARIOS:
            results["engine0"] = scenario_engine(sampler, user, agents[0])
        if "engine200" in SCENARIOS:
            results["engine200"] = scenario_engine(sampler, user, agents[LATENCY_MS])
        with connection.cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", [TAG])
            connections_now = cur.fetchone()[0]
        report(results, qps, max_connections, connections_now)
    finally:
        if sampler:
            sampler.stop()
        if worker:
            worker.stop()
        for proc in fakes.values():
            proc.terminate()
            proc.wait(10)
        try:
            from django.db import connections

            connections.close_all()
        except Exception:
            pass
        dbs.drop(BENCH_URL)
        drop_queue()


def drop_queue() -> None:
    """Remove this benchmark's own keys from the broker database (its queue and bindings only)."""
    import redis

    r = redis.Redis.from_url(os.environ["CELERY_BROKER_URL"])
    r.delete(TAG, f"_kombu.binding.{TAG}", f"_kombu.binding_permanent.{TAG}", f"{TAG}:raw", f"{TAG}:ping")


def report(results: dict, qps: dict, max_connections: int, connections_now: int) -> None:
    rate = {k: v["steps"] / v["seconds"] for k, v in results.items()}
    names = {
        "raw": f"raw celery chain {RUNS}x{STEPS} no-op",
        "floor": f"floor: 3 commits/task {RUNS}x{STEPS}",
        "engine0": f"engine {RUNS}x{STEPS}, model 0 ms",
        "engine200": f"engine {RUNS}x{STEPS}, model {LATENCY_MS} ms",
    }
    ratio_of = {
        "raw": ("raw", "1.00 (ceiling)"),
        "floor": ("raw", "vs raw"),
        "engine0": ("raw", "vs raw, target >= 0.60"),
        "engine200": ("engine0", "vs 0 ms, target >= 0.80"),
    }
    print()
    print(
        f"load average (1, 5, 15 min) at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on "
        f"{os.cpu_count()} CPUs"
    )
    print(
        f"worker: 1 process, pool={POOL}, concurrency={CONCURRENCY}, DB_POOL_MAX={DB_POOL_MAX or 'off'} "
        f"(PostgreSQL max_connections={max_connections}); queue {TAG}"
    )
    header = (
        f"{'scenario':<34} | {'steps':>6} | {'seconds':>7} | {'steps/s':>8} | {'ratio':>30} | "
        f"{'peak RSS MB':>11} | {'worker CPU ms/step':>18}"
    )
    print(header)
    print("-" * len(header))
    for key, r in results.items():
        base, label = ratio_of[key]
        if key == "raw":
            ratio = label
        elif base in rate:
            ratio = f"{rate[key] / rate[base]:.2f} ({label})"
        else:
            ratio = "n/a"
        print(
            f"{names[key]:<34} | {r['steps']:>6} | {r['seconds']:>7.2f} | {rate[key]:>8.1f} | {ratio:>30} | "
            f"{r['rss'] / 2**20:>11.1f} | {r['cpu'] * 1000 / r['steps']:>18.2f}"
        )
    for key, r in results.items():
        if "created" in r:
            print(f"  {names[key]}: creating {RUNS} runs with start_run took {r['created']:.2f}s (not timed)")
    model, tool = qps["model"], qps["tool"]
    print()
    print(
        f"queries per step (one run in-process, CaptureQueriesContext around runs.engine.advance): "
        f"{qps['total'] / max(qps['steps'], 1):.1f} over {qps['steps']} steps / {qps['tasks']} tasks "
        f"(run {qps['status']})"
    )
    print(
        f"  model step: avg {sum(model) / max(len(model), 1):.1f} (first {model[:1]}, last {model[-1:]}), "
        f"tool step: avg {sum(tool) / max(len(tool), 1):.1f}"
    )
    top = sorted(qps["tables"].items(), key=lambda kv: -kv[1])
    print("  by statement: " + ", ".join(f"{k} {v}" for k, v in top))
    print(
        f"  statements sent through any psycopg cursor (raw ones included, BEGIN/COMMIT not): "
        f"{qps['sent'] / max(qps['steps'], 1):.1f} per step"
    )
    print(f"  connections to the bench database at the end: {connections_now}")


if __name__ == "__main__":
    main()
