"""The same agent loop through this engine and its peers, side by side, interleaved, in rounds.

    DATABASE_URL=postgres://root@127.0.0.1:5432/test CELERY_BROKER_URL=redis://127.0.0.1:6379/15 \
        .venv/bin/python bench/peers.py [--runs 100] [--steps 25] [--rounds 2] [--scenarios ...]

(`make bench-peers` installs bench/requirements.txt and runs this.) Every scenario runs RUNS
runs of STEPS steps: with 25, 13 model calls to the fake OpenAI-compatible server
(tests/fakes/model_servers.py, "auto agent" mode, 0 ms) and 12 tool calls, each an HTTP POST to
bench/tool_server.py, alternating model, tool, model, ..., model. Every HTTP call goes to
127.0.0.1. Scenarios, each in processes of its own, in this order in every round:

  engine-1       this engine: runs.services.start_run, one Celery worker process
                 (`-P threads -c 128`, DB_POOL_MAX=20, as bench/engine.py and production run it);
                 the tool is a declared `http` tool (read_only, settle 0) on bench/tool_server.py
  chain          a plain Celery chain making the same HTTP calls, one task per step, the
                 conversation carried in the message (bench/peer_tasks.py): no durability at all;
                 the same worker settings, one process
  floor          the least a step can do on this stack and keep the engine's guarantees: the
                 chain's loop and worker, plus the engine's two transactions per step and nothing
                 else (lease and fencing, the step row with its idempotency key, the budget
                 reserved on a run and a tenant-day sub-account before the call and settled after,
                 one event; bench/peer_floor.py), through Django's connection; one process
  floor-2        the floor with two worker processes (beside engine-2)
  floor-amqp     the floor on RabbitMQ (quorum queues), beside engine-1-amqp (run it by name)
  langgraph      LangGraph 1.x, model node -> tool node looping, PostgresSaver checkpointing every
                 superstep, durability "sync" (bench/peer_langgraph.py), one process, 128 threads
  dbos           a DBOS 3.x durable workflow whose steps are the model call and the tool call, on
                 PostgreSQL (bench/peer_dbos.py), one process
  engine-2       the engine with two worker processes on the same queue
  engine-1-200ms the engine, one worker, the model answering after 200 ms (its ratio to engine-1
                 of the same round is printed: bench/engine.py's latency check)
  engine-long    the engine, one worker, runs of LONG_STEPS steps (--long-steps, 201: 100 tool calls)
  langgraph-long LangGraph the same way; for both long scenarios the worker's and PostgreSQL's CPU
                 per step over steps 1-25 and over the last 26 steps (175-201) are printed side by
                 side: does a step cost the same late in a run as early? (sampled every 0.2 s with
                 the tool server's call count; the runs advance together, so the count says which
                 step they are at)

Only the PostgreSQL server of DATABASE_URL is used: the benchmark creates databases of its own,
`bench_peers_<pid>_engine` (migrated), `_langgraph` and `_dbos`, and drops them at the end.
Celery messages go to a private queue `bench_peers_<pid>` on the given Redis database.

Columns (per scenario and round):
  steps/s        steps / seconds from the first run released to the last run finished
  CPU ms/step    user + system CPU time of the worker processes (engine, chain: the Celery worker
                 processes, read with psutil before the runs are released and after they end;
                 langgraph, dbos: the process that runs the graphs or workflows, over the same
                 window) / steps. Not counted: PostgreSQL, Redis, the fake servers.
  PG ms/step     CPU time (user + system) of the PostgreSQL backends serving the scenario's
                 database, from /proc (bench/pgcpu.py) / steps: PostgreSQL's own work per step
  stmts/step     SQL statements the worker processes sent through psycopg, counted on the client
                 (bench/sqlcount.py: pg_stat_statements is not loaded on this server), BEGIN and
                 COMMIT not included, nor psycopg_pool's empty connection checks (footnote)
  commits/step   transactions committed in the scenario's own database (pg_stat_database
                 xact_commit, bench/pgstats.py): explicit transactions, autocommit statements and
                 pool checks alike; the engine's figure leaves out this script's own polling
  load           the 1-minute load average when the scenario started and when it ended
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# bench/engine.py's pieces (its import points DATABASE_URL and CELERY_QUEUE at its own names:
# they are set again below, before Django reads them).
from bench import dbs, peer_agent, pgcpu, pgstats, sqlcount
from bench import engine as engine_bench

BASE_URL = os.environ["DATABASE_URL"]
BROKER_URL = os.environ["CELERY_BROKER_URL"]
# Where workers push their readiness pings and the chains their finish times: the broker itself on
# Redis; a Redis given by the parent when this process is the RabbitMQ child (run_on_rabbitmq).
SIGNAL_URL = os.environ.get("BENCH_REDIS_URL") or BROKER_URL
TAG = f"bench_peers_{os.getpid()}"
DB_URLS = {kind: dbs.with_database(BASE_URL, f"{TAG}_{kind}") for kind in ("engine", "langgraph", "dbos")}
ALL_SCENARIOS = [
    "engine-1",
    "engine-1-amqp",
    "chain",
    "chain-amqp",
    "floor",
    "langgraph",
    "dbos",
    "engine-2",
    "engine-1-200ms",
]
EXTRA_SCENARIOS = ["floor-2", "floor-amqp"]  # not in the default list: run them by name
# The same scenario with RabbitMQ (quorum queues) as the broker: run by a child of this script whose
# CELERY_BROKER_URL is --amqp-url (the settings are read once per process), its results reported here.
AMQP_SUFFIX = "-amqp"
LONG_SCENARIOS = ["engine-long", "langgraph-long"]  # not in the default list: run them by name
LONG = "long"  # the key of the long runs' fake model server and agent
PY = sys.executable

os.environ["DATABASE_URL"] = DB_URLS["engine"]
os.environ["CELERY_QUEUE"] = TAG
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agentplatform.settings")
os.environ.pop("DB_POOL_MAX", None)  # this process polls with one plain connection


def psycopg_url(url: str) -> str:
    return url.replace("postgres://", "postgresql://", 1)


@dataclass
class Result:
    scenario: str
    round: int
    workers: int
    steps: int
    seconds: float
    cpu: float
    statements: int | None = None
    checks: int | None = None
    commits: int | None = None
    load: tuple[float, float] = (0.0, 0.0)
    notes: list[str] = field(default_factory=list)
    pg_cpu: float | None = None
    lock_waits: float | None = None  # share of PostgreSQL samples with a backend waiting for a lock
    waits: dict[str, int] = field(default_factory=dict)  # what waited, on what (bench/pgcpu.py)
    # Long scenarios: (worker ms/step, PostgreSQL ms/step) over steps 1-25 and over the last 26.
    early: tuple[float, float] | None = None
    late: tuple[float, float] | None = None

    @property
    def rate(self) -> float:
        return self.steps / self.seconds

    def per_step(self, value: float | None, scale: float = 1.0) -> str:
        return "-" if value is None else f"{value * scale / self.steps:.2f}"


# --- servers and workers -------------------------------------------------------------------------


def wait_port(proc: subprocess.Popen, port: int, what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited") from None
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not start")


def start_server(args: list[str], what: str) -> tuple[subprocess.Popen, int]:
    port = engine_bench.free_port()
    proc = subprocess.Popen(
        [PY, "-m", *args, "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_port(proc, port, what)
    return proc, port


class Worker:
    """One Celery worker process on this benchmark's queue, counting its SQL statements."""

    def __init__(self, index: int, opts: argparse.Namespace):
        self.index = index
        self.own_queue = f"{TAG}-w{index}"  # readiness ping only: proves this very process consumes
        self.counts = Path(tempfile.mkstemp(prefix=f"{TAG}-w{index}-", suffix=".json")[1])
        self.log = Path(tempfile.mkstemp(prefix=f"{TAG}-w{index}-", suffix=".log")[1])
        self.args = [
            PY,
            "-m",
            "celery",
            "-A",
            "agentplatform",
            "worker",
            "-P",
            "threads",
            "-c",
            str(opts.concurrency),
            "-Q",
            f"{TAG},{self.own_queue}",
            "-n",
            f"{TAG}-w{index}@{socket.gethostname()}",
            "-I",
            "bench.noop_tasks,bench.peer_tasks,bench.peer_floor",
            "--loglevel",
            "WARNING",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
        # DEBUG off as in production: with DEBUG on, Django keeps every query of every connection.
        self.env = dict(
            os.environ,
            DATABASE_URL=DB_URLS["engine"],
            CELERY_QUEUE=TAG,
            PYTHONUNBUFFERED="1",
            DEBUG="false",
            DB_POOL_MAX=str(opts.db_pool),
            DB_POOL_CHECK="0",  # as scripts/serve.sh starts workers
            BENCH_SQLCOUNT_FILE=str(self.counts),
        )
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log.open("wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                self.args, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )

    def wait_ready(self) -> None:
        import redis

        from bench.noop_tasks import noop_step

        r = redis.Redis.from_url(SIGNAL_URL)
        key = f"{self.own_queue}:ping"
        noop_step.apply_async((key, 0, 1), queue=self.own_queue)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if r.blpop(key, timeout=0.5):
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited: {self.output()[-3000:]}")
        raise RuntimeError(f"worker not ready: {self.output()[-3000:]}")

    def cpu(self) -> float:
        import psutil

        try:
            proc = psutil.Process(self.proc.pid)
            return sum(sum(p.cpu_times()[:2]) for p in [proc, *proc.children(recursive=True)])
        except psutil.NoSuchProcess:
            raise RuntimeError(f"worker {self.index} died: {self.output()[-3000:]}") from None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> dict[str, int]:
        """Warm shutdown; the statement counts it wrote as it exited."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        try:
            counts = json.loads(self.counts.read_text() or "null") or {}
        finally:
            self.counts.unlink(missing_ok=True)
        if counts and self.proc and self.proc.returncode == 0:
            self.log.unlink(missing_ok=True)  # kept when something went wrong
        return counts


def start_workers(workers: list[Worker]) -> None:
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.wait_ready()


def stop_workers(workers: list[Worker]) -> dict[str, int] | None:
    counts = [w.stop() for w in workers]
    if not all(counts):
        return None
    return {key: sum(c[key] for c in counts) for key in ("statements", "checks")}


class ToolCalls:
    """The tool server's call counter: every scenario must make exactly runs x tool turns calls."""

    def __init__(self, url: str):
        import httpx

        self.url = url
        self.get = lambda: httpx.get(f"{url}/count", timeout=10).json()["calls"]

    def check(self, before: int, expected: int, scenario: str) -> None:
        made = self.get() - before
        if made != expected:
            raise RuntimeError(f"{scenario}: the tool server took {made} calls, expected {expected}")


class Timeline:
    """Tool calls made, worker CPU and PostgreSQL CPU, sampled together every 0.2 s (long scenarios).

    Every run makes one tool call every two steps and the runs advance together, so the calls
    made since the start say which steps the runs are at: steps 1-25 are the first 12 calls of
    each run, steps 175-201 its last 13 (with 201 steps). CPU between two call counts is
    interpolated linearly between the samples around them.
    """

    def __init__(self, tools: ToolCalls, worker_cpu, pg: pgcpu.BackendCpu):
        import threading

        self.tools, self.worker_cpu, self.pg = tools, worker_cpu, pg
        self.samples: list[tuple[int, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="timeline", daemon=True)

    def _sample(self) -> None:
        self.samples.append((self.tools.get(), self.worker_cpu(), self.pg.total() or 0.0))

    def _loop(self) -> None:
        while not self._stop.wait(pgcpu.INTERVAL):
            try:
                self._sample()
            except Exception:  # a process that just ended: the samples so far stand
                return

    def start(self) -> Timeline:
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _at(self, calls: float) -> tuple[float, float]:
        # From the last sample at or below the count: the samples before the first call are the
        # process starting (a child's imports), not a step.
        points = self.samples
        i = max((k for k, (c, _, _) in enumerate(points) if c <= calls), default=0)
        c0, w0, p0 = points[i]
        if i + 1 == len(points):
            return w0, p0
        c1, w1, p1 = points[i + 1]
        f = 0.0 if c1 == c0 else (calls - c0) / (c1 - c0)
        return w0 + f * (w1 - w0), p0 + f * (p1 - p0)

    def per_step(self, first_call: float, last_call: float) -> tuple[float, float]:
        """(worker, PostgreSQL) CPU ms per step between two call counts after the start."""
        base = self.samples[0][0]
        (w0, p0), (w1, p1) = self._at(base + first_call), self._at(base + last_call)
        steps = 2 * (last_call - first_call)
        return (w1 - w0) * 1000 / steps, (p1 - p0) * 1000 / steps


def windows(runs: int, steps: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Call counts (all runs) bounding steps 1-25 and the last 26 steps of runs of `steps` steps."""
    calls = (steps - 1) // 2
    return (0, 12 * runs), ((calls - 13) * runs, calls * runs)


# --- scenarios -----------------------------------------------------------------------------------


def setup_engine_data(model_urls: dict[int, str], tool_url: str):
    """A tenant whose agents call the fake model and one declared HTTP tool on the tool server."""
    from tests import factories
    from tools.models import Tool, ToolServer

    tenant = factories.make_tenant(
        "bench",
        max_active_runs=10_000,
        max_starts_per_minute=100_000,
        daily_budget_micros=10**15,
        max_steps_cap=10_000,
        max_tool_calls_cap=5_000,
        max_cost_micros_cap=10**12,
    )
    user = factories.make_user(tenant, "bench")
    server = ToolServer.objects.create(
        tenant=tenant, name="bench", kind=ToolServer.Kind.HTTP, url=f"{tool_url}/tools"
    )
    tool = Tool.objects.create(
        tenant=tenant,
        server=server,
        name=peer_agent.TOOL_NAME,
        remote_name=peer_agent.TOOL_REMOTE_NAME,
        description="Echo the arguments back.",
        input_schema=peer_agent.TOOL_SCHEMA,
        enabled=True,
        effect_class="read_only",
        timeout_seconds=30,
        settle_seconds=0,
    )
    factories.grant(tool, use=[user])
    agents = {}
    for latency, url in model_urls.items():
        endpoint = factories.make_endpoint(tenant, name=f"fake-{latency}ms", kind="openai", base_url=url)
        # The long runs' agent may take them to their end (the default caps stop a run at 50 steps).
        limits = (
            {"limits": {"max_steps": 10_000, "max_tool_calls": 5_000, "max_cost_micros": 10**12}}
            if latency == LONG
            else {}
        )
        factories.make_agent(
            tenant,
            name=f"bench-{latency}ms",
            tools=[tool],
            endpoint=endpoint,
            instructions=peer_agent.INSTRUCTIONS,
            **limits,
        )
        agents[latency] = f"bench-{latency}ms"
    return user, agents


def run_engine(opts, ctx, name: str, round_no: int, workers_n: int, latency, steps_per_run=None) -> Result:
    from django.db import connections
    from django.db.models import Count, Max

    from runs.models import TERMINAL, Run, Step, StepStatus

    long_runs = steps_per_run is not None
    steps_per_run = steps_per_run or opts.steps
    load_start = os.getloadavg()[0]
    tools_before = ctx["tools"].get()
    ids, held, _created = engine_bench.create_runs(ctx["user"], ctx["agents"][latency], opts.runs)
    connections.close_all()
    before = pgstats.wait_idle(DB_URLS["engine"])
    own_before = sqlcount.snapshot()
    workers = [Worker(i + 1, opts) for i in range(workers_n)]
    stopped = False
    try:
        start_workers(workers)
        cpu_before = sum(w.cpu() for w in workers)
        pg = pgcpu.BackendCpu(DB_URLS["engine"]).start()
        timeline = (
            Timeline(ctx["tools"], lambda: sum(w.cpu() for w in workers), pg).start() if long_runs else None
        )
        start = time.time()
        held.release()
        deadline = time.monotonic() + opts.timeout
        runs = Run.objects.filter(pk__in=ids)
        while runs.exclude(status__in=TERMINAL).exists():
            if time.monotonic() > deadline:
                states = dict(runs.values_list("status").annotate(n=Count("pk")).order_by())
                raise RuntimeError(f"{name}: runs not finished in {opts.timeout}s: runs by status {states}")
            time.sleep(0.25)  # the end time comes from finished_at, not from this poll
        cpu = sum(w.cpu() for w in workers) - cpu_before
        if timeline is not None:
            timeline.stop()
        pg_cpu = pg.stop()
        lock_waits, waits = pg.lock_wait_share, pg.waits
        load_end = os.getloadavg()[0]
        bad = list(runs.exclude(status="succeeded").values_list("status", "error")[:5])
        if bad:
            raise RuntimeError(f"{name}: runs did not succeed: {bad}")
        end = runs.aggregate(end=Max("finished_at"))["end"].timestamp()
        steps = Step.objects.filter(run_id__in=ids, status=StepStatus.SUCCEEDED).count()
        if steps != opts.runs * steps_per_run:
            raise RuntimeError(f"{name}: {steps} succeeded steps, expected {opts.runs * steps_per_run}")
        counts = stop_workers(workers)
        stopped = True
    finally:
        if not stopped:
            stop_workers(workers)
    connections.close_all()
    after = pgstats.wait_idle(DB_URLS["engine"])
    own = sqlcount.snapshot()
    # This process's polls and checks ran in autocommit: one transaction each, not the engine's.
    own_commits = own["statements"] - own_before["statements"] + own["checks"] - own_before["checks"]
    ctx["tools"].check(tools_before, opts.runs * ((steps_per_run - 1) // 2), name)
    result = Result(
        name,
        round_no,
        workers_n,
        steps,
        end - start,
        cpu,
        load=(load_start, load_end),
        commits=after["commits"] - before["commits"] - own_commits,
        pg_cpu=pg_cpu,
        lock_waits=lock_waits,
        waits=waits,
    )
    if timeline is not None:
        early, late = windows(opts.runs, steps_per_run)
        result.early, result.late = timeline.per_step(*early), timeline.per_step(*late)
    if counts:
        result.statements, result.checks = counts["statements"], counts["checks"]
    else:
        result.notes.append("a worker wrote no statement counts")
    return result


def release_and_wait(opts, ctx, name: str, task, r, key: str, workers: list[Worker]) -> float:
    """Send every run's first step of `task` (the chain's or the floor's: each step enqueues the
    next, the last pushes "<run> <finish time>" to `key`) and wait for all of them: the last
    finish time. Raises if a run failed, a worker exited or the timeout passed."""
    for run in range(opts.runs):
        task.apply_async(
            (key, run, ctx["model_urls"][0], ctx["tool_url"], peer_agent.first_messages(run), opts.steps)
        )
    deadline = time.monotonic() + opts.timeout
    while r.llen(key) < opts.runs:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: only {r.llen(key)}/{opts.runs} runs finished in {opts.timeout}s")
        exited = next((w for w in workers if w.proc.poll() is not None), None)
        if exited is not None:
            raise RuntimeError(f"{name}: a worker exited: {exited.output()[-3000:]}")
        time.sleep(0.02)
    finished = [item.decode().split(" ", 1) for item in r.lrange(key, 0, -1)]
    failed = [text for _run, text in finished if text.startswith("ERROR")]
    if failed:
        raise RuntimeError(f"{name}: runs failed: {failed[:3]}")
    return max(float(text) for _run, text in finished)


def run_chain(opts, ctx, name: str, round_no: int) -> Result:
    import redis

    from bench.peer_tasks import chain_step

    load_start = os.getloadavg()[0]
    tools_before = ctx["tools"].get()
    r = redis.Redis.from_url(SIGNAL_URL)
    key = f"{TAG}:chain"
    r.delete(key)
    workers = [Worker(1, opts)]
    stopped = False
    try:
        start_workers(workers)
        cpu_before = sum(w.cpu() for w in workers)
        start = time.time()
        end = release_and_wait(opts, ctx, name, chain_step, r, key, workers)
        cpu = sum(w.cpu() for w in workers) - cpu_before
        load_end = os.getloadavg()[0]
        counts = stop_workers(workers)
        stopped = True
    finally:
        if not stopped:
            stop_workers(workers)
        r.delete(key)
    ctx["tools"].check(tools_before, opts.runs * (opts.steps - 1) // 2, name)
    result = Result(name, round_no, 1, opts.runs * opts.steps, end - start, cpu, load=(load_start, load_end))
    if counts:
        result.statements, result.checks = counts["statements"], counts["checks"]
    return result


def run_floor(opts, ctx, name: str, round_no: int, workers_n: int) -> Result:
    import redis
    from django.db import connection, connections

    from bench import peer_floor

    load_start = os.getloadavg()[0]
    tools_before = ctx["tools"].get()
    with connection.cursor() as cursor:
        peer_floor.create_runs(cursor, opts.runs)
    connections.close_all()
    r = redis.Redis.from_url(SIGNAL_URL)
    key = f"{TAG}:floor"
    r.delete(key)
    before = pgstats.wait_idle(DB_URLS["engine"])
    workers = [Worker(i + 1, opts) for i in range(workers_n)]
    stopped = False
    try:
        start_workers(workers)
        cpu_before = sum(w.cpu() for w in workers)
        pg = pgcpu.BackendCpu(DB_URLS["engine"]).start()
        start = time.time()
        end = release_and_wait(opts, ctx, name, peer_floor.floor_step, r, key, workers)
        cpu = sum(w.cpu() for w in workers) - cpu_before
        pg_cpu = pg.stop()
        load_end = os.getloadavg()[0]
        counts = stop_workers(workers)
        stopped = True
    finally:
        if not stopped:
            stop_workers(workers)
        r.delete(key)
    after = pgstats.wait_idle(DB_URLS["engine"])
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM bench_floor_step WHERE status = 'succeeded'")
        (steps,) = cursor.fetchone()
        cursor.execute("SELECT count(*) FROM bench_floor_account WHERE reserved_micros <> 0")
        (unsettled,) = cursor.fetchone()
    connections.close_all()
    if steps != opts.runs * opts.steps or unsettled:
        raise RuntimeError(f"{name}: {steps} steps recorded, {unsettled} accounts with money still reserved")
    ctx["tools"].check(tools_before, opts.runs * (opts.steps - 1) // 2, name)
    result = Result(
        name,
        round_no,
        workers_n,
        steps,
        end - start,
        cpu,
        load=(load_start, load_end),
        commits=after["commits"] - before["commits"],
        pg_cpu=pg_cpu,
        lock_waits=pg.lock_wait_share,
        waits=pg.waits,
    )
    if counts:
        result.statements, result.checks = counts["statements"], counts["checks"]
    return result


def run_child(
    opts, ctx, name: str, round_no: int, module: str, db: str, extra: list[str], steps_per_run=None
) -> Result:
    import psutil

    long_runs = steps_per_run is not None
    steps_per_run = steps_per_run or opts.steps
    model_url = ctx["model_urls"][LONG if long_runs else 0]
    load_start = os.getloadavg()[0]
    tools_before = ctx["tools"].get()
    args = [
        PY,
        "-m",
        module,
        "--db",
        psycopg_url(db),
        "--model-url",
        model_url,
        "--tool-url",
        ctx["tool_url"],
        "--runs",
        str(opts.runs),
        "--steps",
        str(steps_per_run),
        "--pool",
        str(opts.db_pool),
        *extra,
    ]
    # The child's own database has no backend before it starts: every backend counts from zero.
    pg = pgcpu.BackendCpu(db).start()
    child = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    timeline = None
    if long_runs:
        process = psutil.Process(child.pid)
        timeline = Timeline(ctx["tools"], lambda: sum(process.cpu_times()[:2]), pg).start()
    try:
        stdout, stderr = child.communicate(timeout=opts.timeout + 120)
    finally:
        if timeline is not None:
            timeline.stop()
        pg_cpu = pg.stop()
        if child.poll() is None:
            child.kill()
    load_end = os.getloadavg()[0]
    if child.returncode != 0:
        raise RuntimeError(f"{name} failed ({child.returncode}): {stderr[-3000:]}")
    data = json.loads(stdout.strip().splitlines()[-1])
    ctx["tools"].check(tools_before, opts.runs * ((steps_per_run - 1) // 2), name)
    result = Result(
        name,
        round_no,
        1,
        data["steps"],
        data["seconds"],
        data["cpu"],
        statements=data["statements"],
        checks=data["checks"],
        commits=data["commits"],
        load=(load_start, load_end),
        pg_cpu=pg_cpu,
        lock_waits=pg.lock_wait_share,
    )
    if timeline is not None:
        # The child's CPU before its first tool call is its start-up (imports): the first window
        # starts at its first call, not at zero.
        early, late = windows(opts.runs, steps_per_run)
        result.early, result.late = timeline.per_step(*early), timeline.per_step(*late)
    return result


def run_on_rabbitmq(opts, name: str, round_no: int) -> Result:
    """`name` without its -amqp suffix, run by this script in a child process whose broker is
    RabbitMQ (quorum queues, as agentplatform/settings.py declares them for an amqp:// URL): its own
    databases, fake servers and workers, the same load; Redis only carries the finish signals."""
    base = name.removesuffix(AMQP_SUFFIX)
    out = Path(tempfile.mkstemp(prefix=f"{TAG}-amqp-", suffix=".json")[1])
    args = [
        PY,
        str(Path(__file__)),
        "--scenarios",
        base,
        "--rounds",
        "1",
        "--runs",
        str(opts.runs),
        "--steps",
        str(opts.steps),
        "--concurrency",
        str(opts.concurrency),
        "--db-pool",
        str(opts.db_pool),
        "--timeout",
        str(opts.timeout),
        "--result-json",
        str(out),
    ]
    env = dict(os.environ, CELERY_BROKER_URL=opts.amqp_url, BENCH_REDIS_URL=SIGNAL_URL, CACHE_URL=SIGNAL_URL)
    try:
        done = subprocess.run(
            args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=opts.timeout * 3
        )
        if done.returncode != 0:
            raise RuntimeError(f"{name}: the RabbitMQ child failed: {(done.stdout + done.stderr)[-3000:]}")
        (fields,) = json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)
    fields.update(scenario=name, round=round_no, load=tuple(fields["load"]))
    for key in ("early", "late"):
        fields[key] = tuple(fields[key]) if fields.get(key) else None
    return Result(**fields)


def run_scenario(opts, ctx, name: str, round_no: int) -> Result:
    if name.endswith(AMQP_SUFFIX):
        return run_on_rabbitmq(opts, name, round_no)
    if name == "engine-1":
        return run_engine(opts, ctx, name, round_no, 1, 0)
    if name == "engine-2":
        return run_engine(opts, ctx, name, round_no, 2, 0)
    if name == "engine-1-200ms":
        return run_engine(opts, ctx, name, round_no, 1, opts.latency_ms)
    if name == "chain":
        return run_chain(opts, ctx, name, round_no)
    if name in ("floor", "floor-2"):
        return run_floor(opts, ctx, name, round_no, 2 if name == "floor-2" else 1)
    if name == "langgraph":
        return run_child(
            opts,
            ctx,
            name,
            round_no,
            "bench.peer_langgraph",
            DB_URLS["langgraph"],
            ["--threads", str(opts.concurrency), "--durability", opts.langgraph_durability],
        )
    if name == "dbos":
        return run_child(opts, ctx, name, round_no, "bench.peer_dbos", DB_URLS["dbos"], [])
    if name == "engine-long":
        return run_engine(opts, ctx, name, round_no, 1, LONG, steps_per_run=opts.long_steps)
    if name == "langgraph-long":
        return run_child(
            opts,
            ctx,
            name,
            round_no,
            "bench.peer_langgraph",
            DB_URLS["langgraph"],
            ["--threads", str(opts.concurrency), "--durability", opts.langgraph_durability],
            steps_per_run=opts.long_steps,
        )
    raise ValueError(name)


# --- report --------------------------------------------------------------------------------------


def report(results: list[Result], opts: argparse.Namespace, started: float) -> None:
    print()
    print(
        f"{opts.runs} runs x {opts.steps} steps per scenario ({(opts.steps + 1) // 2} model calls, "
        f"{(opts.steps - 1) // 2} tool calls per run, all over HTTP to 127.0.0.1), {os.cpu_count()} CPUs; "
        f"worker pool threads x {opts.concurrency}, {opts.db_pool} PostgreSQL connections per process, "
        f"LangGraph durability {opts.langgraph_durability}"
        + (
            f"; the long scenarios: {opts.long_steps} steps per run"
            if set(LONG_SCENARIOS) & set(opts.scenarios)
            else ""
        )
    )
    header = (
        f"{'round':>5} | {'scenario':<15} | {'procs':>5} | {'seconds':>7} | {'steps/s':>7} | "
        f"{'CPU ms/step':>11} | {'PG ms/step':>10} | {'stmts/step':>10} | {'commits/step':>12} | "
        f"{'lock waits':>10} | {'load start→end':>14}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        no_db = r.scenario == "chain"
        print(
            f"{r.round:>5} | {r.scenario:<15} | {r.workers:>5} | {r.seconds:>7.2f} | {r.rate:>7.1f} | "
            f"{r.per_step(r.cpu, 1000):>11} | {'-' if no_db else r.per_step(r.pg_cpu, 1000):>10} | "
            f"{'-' if no_db else r.per_step(r.statements):>10} | "
            f"{'-' if no_db else r.per_step(r.commits):>12} | "
            f"{'-' if r.lock_waits is None else f'{r.lock_waits * 100:.1f}%':>10} | "
            f"{r.load[0]:>6.2f}→{r.load[1]:<6.2f}" + (f"  ({'; '.join(r.notes)})" if r.notes else "")
        )
    print()
    if len({r.round for r in results}) > 1:
        print("over the rounds (min-max):")
        for name in dict.fromkeys(r.scenario for r in results):
            rows = [r for r in results if r.scenario == name]
            print(
                f"  {name:<15} {span([r.rate for r in rows], '.1f')} steps/s, "
                f"{span([r.cpu * 1000 / r.steps for r in rows], '.2f')} CPU ms/step"
                + (
                    ""
                    if name == "chain"
                    else f", {span([r.statements / r.steps for r in rows if r.statements is not None], '.2f')} stmts/step, "
                    f"{span([r.commits / r.steps for r in rows if r.commits is not None], '.2f')} commits/step"
                )
            )
        print()
    by = {(r.round, r.scenario): r for r in results}
    for round_no in sorted({r.round for r in results}):
        parts = []
        chain = by.get((round_no, "chain"))
        for name in ("engine-1", "engine-2", "langgraph", "dbos"):
            if chain and (round_no, name) in by:
                parts.append(f"{name} {by[(round_no, name)].rate / chain.rate:.2f}x")
        engine0, engine200 = by.get((round_no, "engine-1")), by.get((round_no, "engine-1-200ms"))
        line = f"round {round_no}: steps/s vs the plain chain: " + (", ".join(parts) or "n/a")
        if engine0 and engine200:
            line += f"; engine {opts.latency_ms} ms model vs 0 ms: {engine200.rate / engine0.rate:.2f}x (goal >= 0.80)"
        print(line)
    for r in results:
        if r.early and r.late:
            print(
                f"round {r.round} {r.scenario}: worker CPU ms/step {r.early[0]:.2f} over steps 1-25, "
                f"{r.late[0]:.2f} over the last 26 ({r.late[0] / r.early[0]:.2f}x); PostgreSQL "
                f"{r.early[1]:.2f} -> {r.late[1]:.2f} ms/step"
                + (f" ({r.late[1] / r.early[1]:.2f}x)" if r.early[1] else "")
            )
    for r in results:
        if r.waits:
            top = sorted(r.waits.items(), key=lambda kv: -kv[1])[:3]
            print(f"round {r.round} {r.scenario}: lock waits, by what waited <- what held the lock:")
            for what, n in top:
                print(f"    {n:>4} samples  {what}")
    checks = [f"{r.scenario} r{r.round} {r.per_step(r.checks)}" for r in results if r.checks]
    if checks:
        print(
            "pool checks per step (empty statements, in commits/step, not in stmts/step): "
            + ", ".join(checks)
        )
    chain_sql = [r.statements for r in results if r.scenario == "chain" and r.statements]
    if chain_sql:
        print(f"note: the chain's workers sent {chain_sql} SQL statements (none expected)")
    print(
        f"total {time.time() - started:.0f} s; load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )


def span(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    low, high = min(values), max(values)
    return f"{low:{fmt}}" if f"{low:{fmt}}" == f"{high:{fmt}}" else f"{low:{fmt}}-{high:{fmt}}"


# --- main ----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="The engine against a plain Celery chain, LangGraph and DBOS."
    )
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=25, help="odd: model, tool, ..., model")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--scenarios",
        default=",".join(ALL_SCENARIOS),
        help=f"comma-separated, run in this order every round; any of {','.join(ALL_SCENARIOS)}",
    )
    parser.add_argument(
        "--concurrency", type=int, default=128, help="threads per worker process (all scenarios)"
    )
    parser.add_argument(
        "--db-pool", type=int, default=20, help="PostgreSQL connections per process (all scenarios)"
    )
    parser.add_argument("--latency-ms", type=int, default=200, help="model latency of engine-1-200ms")
    parser.add_argument(
        "--amqp-url",
        default=os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//"),
        help="the RabbitMQ of the -amqp scenarios",
    )
    parser.add_argument("--result-json", help=argparse.SUPPRESS)  # a RabbitMQ child writes its results here
    parser.add_argument("--langgraph-durability", choices=["sync", "async", "exit"], default="sync")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per scenario")
    parser.add_argument(
        "--long-steps", type=int, default=201, help="steps per run of the long scenarios (odd: model last)"
    )
    opts = parser.parse_args()
    if opts.steps < 3 or opts.steps % 2 == 0:
        parser.error("--steps must be odd and at least 3")
    opts.scenarios = [s.strip() for s in opts.scenarios.split(",") if s.strip()]
    unknown = set(opts.scenarios) - set(ALL_SCENARIOS) - set(LONG_SCENARIOS) - set(EXTRA_SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios: {sorted(unknown)}")
    return opts


def main() -> None:
    opts = parse_args()
    started = time.time()
    sqlcount.install()  # this process's own statements, left out of the engine's commits
    servers: list[subprocess.Popen] = []
    results: list[Result] = []
    for url in DB_URLS.values():
        dbs.create(url)
    try:
        subprocess.run(
            [PY, "manage.py", "migrate", "-v", "0"],
            cwd=ROOT,
            check=True,
            env=dict(os.environ, DATABASE_URL=DB_URLS["engine"]),
        )
        import django

        django.setup()
        latencies: list = [0] + ([opts.latency_ms] if "engine-1-200ms" in opts.scenarios else [])
        if set(LONG_SCENARIOS) & set(opts.scenarios):
            latencies.append(LONG)
        model_urls = {}
        for latency in latencies:
            steps = opts.long_steps if latency == LONG else opts.steps
            proc, port = start_server(
                [
                    "tests.fakes.model_servers",
                    "--kind",
                    "openai",
                    "--latency-ms",
                    str(0 if latency == LONG else latency),
                    "--tool-turns",
                    str((steps - 1) // 2),
                ],
                f"fake model server ({latency} ms)",
            )
            servers.append(proc)
            model_urls[latency] = f"http://127.0.0.1:{port}/v1"
        proc, port = start_server(["bench.tool_server"], "tool server")
        servers.append(proc)
        tool_url = f"http://127.0.0.1:{port}"
        user, agents = setup_engine_data(model_urls, tool_url)
        ctx = {
            "user": user,
            "agents": agents,
            "model_urls": model_urls,
            "tool_url": tool_url,
            "tools": ToolCalls(tool_url),
        }
        for round_no in range(1, opts.rounds + 1):
            for name in opts.scenarios:
                result = run_scenario(opts, ctx, name, round_no)
                results.append(result)
                print(
                    f"round {round_no} {name:<15} {result.rate:7.1f} steps/s, "
                    f"{result.per_step(result.cpu, 1000)} ms CPU/step, "
                    f"load {result.load[0]:.2f}→{result.load[1]:.2f}",
                    flush=True,
                )
        if opts.result_json:
            Path(opts.result_json).write_text(json.dumps([dataclasses.asdict(r) for r in results]))
            return
        report(results, opts, started)
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(10)
        from django.apps import apps

        if apps.ready:
            from django.db import connections

            connections.close_all()  # DROP DATABASE ... WITH (FORCE) would end them anyway
        for url in DB_URLS.values():
            dbs.drop(url)
        drop_keys()


def drop_keys() -> None:
    """Remove this benchmark's own keys from the broker database (its queues and bindings only)."""
    import redis

    r = redis.Redis.from_url(SIGNAL_URL)
    keys = [TAG, f"{TAG}:chain", f"_kombu.binding.{TAG}", f"_kombu.binding_permanent.{TAG}"]
    for index in range(1, 3):
        queue = f"{TAG}-w{index}"
        keys += [queue, f"{queue}:ping", f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}"]
    r.delete(*keys)
    if BROKER_URL.startswith("amqp"):
        from kombu import Connection

        # Quorum queues outlive their consumers: this run's are removed with it.
        with Connection(BROKER_URL) as connection:
            channel = connection.default_channel
            for queue in [TAG, f"{TAG}.sweeper", *(f"{TAG}-w{index}" for index in range(1, 3))]:
                try:
                    channel.queue_delete(queue)
                except Exception:  # not declared in this run: nothing to remove
                    channel = connection.channel()


if __name__ == "__main__":
    main()
