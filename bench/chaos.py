"""Chaos run: many runs through the REST API while workers are killed, stalled and cut off.

    DATABASE_URL=postgres://root@127.0.0.1:5432/test CELERY_BROKER_URL=redis://127.0.0.1:6379/15 \\
        .venv/bin/python bench/chaos.py [--runs 200] [--seconds 120] [--seed N]
                                        [--settle-seconds 600] [--keep-database]

DATABASE_URL only says where PostgreSQL is: the run creates its own database `chaos_<pid>`,
migrates it (`manage.py migrate`) and drops it at the end. It starts the API (gunicorn), Celery
beat (sweeping every second), two Celery workers (threads pool) with short leases, and two
example bank servers: `bank` over MCP and `bank2` over plain HTTP. Every run of the agent calls
four tools, one per effect class:

    bank__lookup_transaction    read_only      MCP
    bank__issue_refund          idempotent     MCP (the bank honours the idempotency key)
    bank2__issue_refund         reconcilable   HTTP, status_url GET /http/status/{key}
    bank__send_customer_email   unsafe         MCP

Runs are started over the first 60 % of the chaos window. During --seconds of chaos it SIGKILLs a random worker every few seconds (and starts it again),
arms faults on the banks (slow calls, calls that time out after their effect was applied, 5xx
after the effect), restarts Redis once (nothing persisted: every queued message is lost) and
SIGSTOPs one worker past its lease before SIGCONT. Runs that wait for a person
(`needs_attention`) are resolved through the API the way a supervisor would: look the
idempotency key up in the provider's ledger; if the effect is there the call succeeded, if not
it failed.

At the end it waits (at most --settle-seconds) until every run has finished, then prints runs by final status, effects applied per
tool against the effects the platform recorded, duplicate effects, reservations left open on
finished runs and runs neither finished nor waiting for a person, and exits non-zero if any
target is missed. Redis is restarted for real: other users of that Redis lose their queues too.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse, urlunparse

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BASE_URL = os.environ.get("DATABASE_URL", "")
BROKER_URL = os.environ.get("CELERY_BROKER_URL", "")
if not BASE_URL.startswith("postgres") or not BROKER_URL.startswith("redis"):
    sys.exit("DATABASE_URL must point at PostgreSQL and CELERY_BROKER_URL at Redis")

TAG = f"chaos_{os.getpid()}"
TOOL_TIMEOUT = 3          # seconds; leases are this + LEASE_MARGIN
LEASE_MARGIN = 2
MODEL_TIMEOUT = 5
MAX_FAULT_DELAY = 5       # no armed delay is longer: a supervisor waits this long before judging
WORKERS = 2
CONCURRENCY = 6
SUCCESS = ("succeeded", "resolved_succeeded")


def with_database(url: str, name: str) -> str:
    return urlunparse(urlparse(url)._replace(path=f"/{name}"))


def admin(sql: str) -> None:
    import psycopg

    with psycopg.connect(with_database(BASE_URL, "postgres").replace("postgres://", "postgresql://", 1),
                         autocommit=True) as conn:
        conn.execute(sql)


CHILD_ENV = {**os.environ, "DATABASE_URL": with_database(BASE_URL, TAG), "CELERY_BROKER_URL": BROKER_URL,
             "CELERY_QUEUE": f"chaos-{os.getpid()}", "LEASE_MARGIN_SECONDS": str(LEASE_MARGIN),
             "QUEUED_TOO_LONG_SECONDS": "6", "SWEEP_INTERVAL_SECONDS": "1", "MAX_STEP_CRASHES": "3",
             "PYTHONUNBUFFERED": "1", "LOG_LEVEL": "WARNING"}
CHILD_ENV.pop("DB_POOL_MAX", None)
os.environ.update(DATABASE_URL=CHILD_ENV["DATABASE_URL"], CELERY_QUEUE=CHILD_ENV["CELERY_QUEUE"],
                  DJANGO_SETTINGS_MODULE="agentplatform.settings", LOG_LEVEL="ERROR")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- processes -----------------------------------------------------------------------------------

class Process:
    """A child process with its log in the run's temporary directory."""

    def __init__(self, name: str, args: list[str], logs: Path, ready: str | None = None):
        self.name, self.args, self.ready = name, args, ready
        self.log_path = logs / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 180) -> "Process":
        self.starts += 1
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0   # earlier lives' output
        log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, cwd=ROOT, env=CHILD_ENV, stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while self.ready and self.ready.encode() not in self.log_path.read_bytes()[offset:]:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


class Bank:
    """examples/bank_server.py: the provider whose ledger is the truth about effects."""

    def __init__(self, label: str):
        self.label, self.url = label, ""
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "bank_server.py"), "--port", "0",
                                      "--label", label], cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)

    def wait_ready(self) -> "Bank":
        line = self.proc.stdout.readline()
        if not line.startswith("BANK_SERVER_READY"):
            raise RuntimeError(f"bank {self.label} did not start")
        self.url = line.split()[1]
        return self

    def effects(self) -> list[dict]:
        return httpx.get(f"{self.url}/ledger", timeout=10).json()["effects"]

    def fault(self, **spec) -> None:
        httpx.post(f"{self.url}/faults", json=spec, timeout=10).raise_for_status()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def redis_port() -> str:
    return str(urlparse(BROKER_URL).port or 6379)


def restart_redis() -> None:
    port = redis_port()
    subprocess.run(["redis-cli", "-p", port, "shutdown", "nosave"], capture_output=True)
    ensure_redis()


def ensure_redis() -> None:
    port = redis_port()
    if subprocess.run(["redis-cli", "-p", port, "ping"], capture_output=True).stdout.strip() == b"PONG":
        return
    subprocess.run(["redis-server", "--daemonize", "yes", "--bind", "127.0.0.1", "--port", port, "--save", "",
                    "--appendonly", "no"], check=True, capture_output=True)
    for _ in range(50):
        if subprocess.run(["redis-cli", "-p", port, "ping"], capture_output=True).stdout.strip() == b"PONG":
            return
        time.sleep(0.1)
    raise RuntimeError("redis did not come back")


# --- tenant ------------------------------------------------------------------------------------

def configure(bank: Bank, bank2: Bank) -> tuple[str, str]:
    """The tenant, its tools (one per effect class), the agent; returns (agent token, supervisor token)."""
    from guardian.shortcuts import assign_perm
    from tenants.tokens import issue_token

    from agents.models import Alias
    from agents.services import create_version
    from llm.models import ModelEndpoint
    from tenants.models import Tenant, User
    from tools.catalog import refresh
    from tools.models import Tool, ToolServer

    tenant = Tenant.objects.create(slug="chaos", name="Chaos", daily_budget_micros=10**12, max_active_runs=100_000,
                                   max_starts_per_minute=100_000, max_cost_micros_cap=10**12)
    agent_user = User.objects.create_user(username="asha", password="pw", tenant=tenant)
    supervisor = User.objects.create_user(username="meera", password="pw", tenant=tenant, is_staff=True)
    mcp = ToolServer.objects.create(tenant=tenant, name="bank", kind=ToolServer.Kind.MCP,
                                    transport=ToolServer.Transport.STREAMABLE_HTTP, url=f"{bank.url}/mcp",
                                    status_tool="refund_status")
    refresh(mcp)
    http = ToolServer.objects.create(tenant=tenant, name="bank2", kind=ToolServer.Kind.HTTP, url=f"{bank2.url}/http")
    common = {"enabled": True, "timeout_seconds": TOOL_TIMEOUT, "approval_policy": "never", "price_micros": 1000,
              "max_attempts": 4, "backoff_seconds": 0.5}
    classes = {"lookup_transaction": "read_only", "issue_refund": "idempotent", "send_customer_email": "unsafe"}
    for remote, effect in classes.items():
        Tool.objects.filter(server=mcp, remote_name=remote).update(effect_class=effect, **common)
    schema = Tool.objects.get(server=mcp, remote_name="issue_refund").input_schema
    Tool.objects.create(tenant=tenant, server=http, name="bank2__issue_refund", remote_name="issue_refund",
                        input_schema=schema, effect_class="reconcilable",
                        status_url=f"{bank2.url}/http/status/{{key}}", **common)
    tools = list(Tool.objects.filter(tenant=tenant, enabled=True))
    for tool in tools:
        assign_perm("tools.use_tool", agent_user, tool)
        assign_perm("tools.approve_tool", supervisor, tool)

    def call(name: str, arguments: dict) -> dict:
        return {"tool_calls": [{"name": name, "arguments": arguments}]}

    ModelEndpoint.objects.create(tenant=tenant, name="scripted", kind="scripted", model="scripted",
                                 timeout_seconds=MODEL_TIMEOUT, config={"latency_ms": 30, "turns": [
        call("bank__lookup_transaction", {"transaction_id": "TXN-1002"}),
        call("bank__issue_refund", {"transaction_id": "TXN-1002", "amount": "$input.refund", "currency": "INR"}),
        call("bank2__issue_refund", {"transaction_id": "TXN-1001", "amount": "$input.refund2", "currency": "INR"}),
        call("bank__send_customer_email", {"to": "$input.email", "subject": "Your dispute", "body": "Refunded."}),
        {"text": "The dispute is settled."}]})
    version, _ = create_version(tenant=tenant, agent="chaos-agent", spec={
        "model": "scripted", "instructions": "Settle the dispute.", "tools": sorted(t.name for t in tools)})
    Alias.objects.create(agent=version.agent, name="prod", version=version)
    assign_perm("agents.run_agent", agent_user, version.agent)
    assign_perm("tenants.view_runs", supervisor, tenant)   # the supervisor resolves runs it did not start
    return issue_token(user=agent_user).token, issue_token(user=supervisor).token


# --- the actors --------------------------------------------------------------------------------

class Api:
    def __init__(self, url: str, token: str):
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Token {token}"}, timeout=30)

    def call(self, method: str, path: str, **kwargs) -> httpx.Response:
        """Retry what a busy or restarting service answers; a replayed POST carries its Idempotency-Key."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                response = self.http.request(method, path, **kwargs)
            except httpx.HTTPError:
                time.sleep(1)
                continue
            if response.status_code == 429 or response.status_code >= 500:
                time.sleep(float(response.headers.get("Retry-After", 1)))
                continue
            return response
        raise RuntimeError(f"{method} {path} kept failing")


class Launcher(threading.Thread):
    """POST /v1/runs `count` times, spread over `seconds`."""

    def __init__(self, api: Api, count: int, seconds: float, rng: random.Random):
        super().__init__(daemon=True, name="launcher")
        self.api, self.count, self.seconds, self.rng = api, count, seconds, rng
        self.run_ids: list[str] = []

    def run(self) -> None:
        for i in range(self.count):
            body = {"agent": "chaos-agent", "input": {"refund": self.rng.randint(1, 3200),
                                                      "refund2": self.rng.randint(1, 5000),
                                                      "email": f"customer{i}@example.com"}}
            response = self.api.call("POST", "/v1/runs", json=body, headers={"Idempotency-Key": f"chaos-{i}"})
            assert response.status_code in (200, 201), response.text
            self.run_ids.append(response.json()["id"])
            time.sleep(self.seconds / self.count)


class Supervisor(threading.Thread):
    """Resolves unknown outcomes from the provider's ledger, as a person would."""

    def __init__(self, api: Api, banks: dict[str, Bank]):
        super().__init__(daemon=True, name="supervisor")
        self.api, self.banks = api, banks
        self.first_seen: dict[tuple[str, int], float] = {}
        self.resolved = collections.Counter()
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.sweep()
            except Exception as exc:  # a restart in progress: look again shortly
                log(f"supervisor: {type(exc).__name__}: {exc}")
            self.stopping.wait(1)

    def sweep(self) -> None:
        waiting = self.api.call("GET", "/v1/runs", params={"status": "needs_attention", "limit": 1000}).json()
        for run in waiting["results"]:
            for step in self.api.call("GET", f"/v1/runs/{run['id']}/steps").json():
                if step["status"] == "outcome_unknown":
                    self.judge(run["id"], step)

    def judge(self, run_id: str, step: dict) -> None:
        # A delayed call may still land: wait out the longest delay before looking at the ledger.
        first = self.first_seen.setdefault((run_id, step["seq"]), time.monotonic())
        if time.monotonic() - first < MAX_FAULT_DELAY + 1:
            return
        server, remote = step["tool"].split("__", 1)
        effect = next((e for e in self.banks[server].effects()
                       if e["tool"] == remote and e["idempotency_key"] == step["idempotency_key"]), None)
        body = ({"outcome": "succeeded", "reason": "the provider's ledger has it", "result": effect["result"]}
                if effect else {"outcome": "failed", "reason": "the provider's ledger has no such call"})
        answer = self.api.call("POST", f"/v1/runs/{run_id}/steps/{step['seq']}/resolve", json=body)
        if answer.status_code == 200:
            self.resolved[body["outcome"]] += 1


class Chaos:
    """Kills, stalls, a Redis restart and provider faults, at random moments for `seconds`."""

    FAULTS = [("bank", "send_customer_email"), ("bank", "issue_refund"), ("bank", "lookup_transaction"),
              ("bank2", "issue_refund")]

    def __init__(self, workers: list[Process], others: list[Process], banks: dict[str, Bank], rng: random.Random):
        self.workers, self.others, self.banks, self.rng = workers, others, banks, rng
        self.counts = collections.Counter()

    def revive(self) -> None:
        """Play the process supervisor (systemd, Kubernetes): start again what exited by itself."""
        for process in self.workers + self.others:
            if not process.alive:
                log(f"chaos: {process.name} exited by itself (code {process.proc.returncode}); starting it again")
                self.counts[f"{process.name.rstrip('0123456789')} exit on its own, restarted"] += 1
                process.start()

    def fault(self) -> None:
        server, tool = self.rng.choice(self.FAULTS)
        kind = self.rng.choice(["delay_after_effect", "delay_before_effect", "fail_5xx_after_effect", "slow"])
        times = self.rng.randint(1, 3)
        if kind == "delay_after_effect":      # applied, then the caller times out
            spec = {"delay_after_effect": self.rng.uniform(TOOL_TIMEOUT + 0.5, MAX_FAULT_DELAY)}
        elif kind == "delay_before_effect":   # times out before the effect lands (it lands later)
            spec = {"delay_before_effect": self.rng.uniform(TOOL_TIMEOUT + 0.5, MAX_FAULT_DELAY)}
        elif kind == "slow":
            spec = {"delay_before_effect": self.rng.uniform(0.5, TOOL_TIMEOUT - 1)}
        else:
            spec = {"fail_5xx_after_effect": True}
        self.banks[server].fault(tool=tool, times=times, **spec)
        self.counts[f"fault {kind}"] += times

    def kill(self) -> None:
        worker = self.rng.choice([w for w in self.workers if w.alive] or self.workers)
        log(f"chaos: SIGKILL {worker.name}")
        worker.kill()
        self.counts["worker SIGKILL"] += 1
        worker.start()

    def stall(self) -> None:
        worker = self.rng.choice([w for w in self.workers if w.alive] or self.workers)
        seconds = TOOL_TIMEOUT + LEASE_MARGIN + MODEL_TIMEOUT
        log(f"chaos: SIGSTOP {worker.name} for {seconds} s")
        worker.signal(signal.SIGSTOP)
        time.sleep(seconds)
        worker.signal(signal.SIGCONT)
        self.counts["worker SIGSTOP past its lease"] += 1

    def redis(self) -> None:
        log("chaos: restarting Redis (queued messages are lost)")
        restart_redis()
        self.counts["redis restart"] += 1

    def play(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        once = {"redis": time.monotonic() + seconds / 3, "stall": time.monotonic() + 2 * seconds / 3}
        next_kill = time.monotonic() + self.rng.uniform(2, 6)
        while time.monotonic() < end:
            self.revive()
            now = time.monotonic()
            for name, at in list(once.items()):
                if now >= at:
                    del once[name]
                    getattr(self, name)()
            if now >= next_kill:
                self.kill()
                next_kill = time.monotonic() + self.rng.uniform(3, 9)
            if self.rng.random() < 0.5:
                self.fault()
            time.sleep(self.rng.uniform(0.5, 1.5))
        for name in once:                    # a short run still gets one of each
            getattr(self, name)()


# --- the report --------------------------------------------------------------------------------

def report(run_ids: list[str], banks: dict[str, Bank], chaos: Chaos, supervisor: Supervisor, args) -> bool:
    from django.db.models import Count

    from budgets.models import Reservation
    from runs.models import TERMINAL, Run, RunEvent, Step
    from tools.models import Tool

    runs = Run.objects.filter(pk__in=run_ids)
    by_status = dict(runs.values_list("status").annotate(n=Count("pk")).order_by("status"))
    stuck = runs.exclude(status__in=[*TERMINAL, "needs_attention", "waiting_approval"]).count()
    open_reservations = Reservation.objects.filter(run__in=runs.filter(status__in=TERMINAL),
                                                   status=Reservation.Status.OPEN).count()
    print()
    print(f"chaos run: {len(run_ids)} runs launched through the API, {args.seconds:g} s of chaos, seed {args.seed}")
    print("chaos:     " + ", ".join(f"{n} {what}" for what, n in sorted(chaos.counts.items())))
    print("runs by final status: " + ", ".join(f"{status} {n}" for status, n in by_status.items()))
    print()
    print(f"{'tool':<27}{'class':<14}{'applied':>8}{'expected':>9}{'unknown':>8}{'mismatched':>11}"
          f"{'same key twice':>15}{'runs with >1':>13}")
    missed, duplicates, mismatched = [], 0, 0
    for tool in Tool.objects.filter(tenant__slug="chaos", enabled=True).order_by("name"):
        server, remote = tool.name.split("__", 1)
        steps = list(Step.objects.filter(run__in=runs, tool=tool, replayed_from_seq__isnull=True)
                     .values_list("idempotency_key", "status"))
        expected = {key for key, status in steps if status in SUCCESS}
        unknown = {key for key, status in steps if status == "outcome_unknown"}
        if tool.effect_class == "read_only":
            print(f"{tool.name:<27}{tool.effect_class:<14}{'-':>8}{len(expected):>9}{len(unknown):>8}"
                  f"{'-':>11}{'-':>15}{'-':>13}")
            continue
        keys = [e["idempotency_key"] for e in banks[server].effects() if e["tool"] == remote]
        counted = collections.Counter(keys)
        twice = sum(n - 1 for n in counted.values())
        per_run = collections.Counter(key.rsplit(":", 1)[0] for key in counted)
        more_than_one = sum(1 for n in per_run.values() if n > 1)
        wrong = len((set(counted) - expected - unknown) | (expected - set(counted)))
        duplicates += twice + more_than_one
        mismatched += wrong
        print(f"{tool.name:<27}{tool.effect_class:<14}{len(keys):>8}{len(expected):>9}{len(unknown):>8}"
              f"{wrong:>11}{twice:>15}{more_than_one:>13}")
    events = dict(RunEvent.objects.filter(run__in=runs).values_list("kind").annotate(n=Count("pk")))
    found = collections.Counter(RunEvent.objects.filter(run__in=runs, kind="recovery")
                                .values_list("data__found", flat=True))
    print()
    print(f"recovery:  sweeper found {found.get('expired_lease', 0)} expired leases, "
          f"{found.get('lost_message', 0)} lost messages, {found.get('open_reservation', 0)} open reservations; "
          f"{events.get('retry_scheduled', 0)} retries scheduled, {events.get('late_attempt', 0)} late attempts "
          f"fenced out; resolved by the supervisor: {dict(supervisor.resolved) or 'none'}")
    print()
    targets = [("duplicate effects (unsafe, idempotent, reconcilable)", duplicates),
               ("effects not matching the step log", mismatched),
               ("reservations still open on finished runs", open_reservations),
               ("runs neither finished nor waiting for a person", stuck),
               ("runs not launched", args.runs - len(run_ids))]
    for what, n in targets:
        print(f"{what:<56}{n:>5}   (target 0)")
        if n:
            missed.append(what)
    print(f"\nresult: {'FAIL: ' + ', '.join(missed) if missed else 'PASS'}")
    return not missed


# --- main --------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description="chaos run against real processes")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--settle-seconds", type=float, default=600, help="how long to wait for quiescence")
    parser.add_argument("--keep-database", action="store_true", help="leave chaos_<pid> for a post-mortem")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    logs = Path(tempfile.mkdtemp(prefix=f"{TAG}-"))
    processes: list[Process] = []
    banks: dict[str, Bank] = {}
    log(f"database {TAG}, queue {CHILD_ENV['CELERY_QUEUE']}, logs in {logs}")
    admin(f'CREATE DATABASE "{TAG}"')
    try:
        banks = {"bank": Bank("bank"), "bank2": Bank("bank2")}       # they start while the database migrates
        subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=CHILD_ENV, check=True,
                       stdout=subprocess.DEVNULL)
        for bank in banks.values():
            bank.wait_ready()
        import django
        django.setup()

        port = free_port()
        api_process = Process("api", [sys.executable, "-m", "gunicorn", "agentplatform.wsgi", "-b",
                                      f"127.0.0.1:{port}", "-w", "3", "--timeout", "60"], logs, "Booting worker")
        beat = Process("beat", [sys.executable, "-m", "celery", "-A", "agentplatform", "beat", "-s",
                                str(logs / "beat-schedule"), "--loglevel", "INFO"], logs, "beat: Starting")
        queues = f"{CHILD_ENV['CELERY_QUEUE']},{CHILD_ENV['CELERY_QUEUE']}.sweeper"   # beat's sweeps have their own
        workers = [Process(f"worker{i}", [sys.executable, "-m", "celery", "-A", "agentplatform", "worker", "-P",
                                          "threads", "-c", str(CONCURRENCY), "-Q", queues,
                                          "-n", f"chaos{i}-{os.getpid()}@%h", "--without-gossip", "--without-mingle",
                                          "--loglevel", "INFO"], logs, " ready.") for i in range(1, WORKERS + 1)]
        processes = [api_process, beat, *workers]
        with concurrent.futures.ThreadPoolExecutor(len(processes)) as pool:
            starting = [pool.submit(p.start) for p in processes]
            agent_token, supervisor_token = configure(banks["bank"], banks["bank2"])
            from django.db import connection
            connection.close()
            for started in starting:
                started.result()
        log("API, beat and workers ready")
        url = f"http://127.0.0.1:{port}"
        launcher = Launcher(Api(url, agent_token), args.runs, args.seconds * 0.6, rng)
        supervisor = Supervisor(Api(url, supervisor_token), banks)
        chaos = Chaos(workers, [api_process, beat], banks, rng)
        log(f"launching {args.runs} runs; chaos for {args.seconds:g} s")
        launcher.start()
        supervisor.start()
        chaos.play(args.seconds)

        log("chaos over: every process running again, no more faults; waiting for quiescence")
        ensure_redis()
        for worker in workers:
            worker.signal(signal.SIGCONT)
        chaos.revive()
        for bank in banks.values():
            httpx.post(f"{bank.url}/faults/reset", timeout=10)
        launcher.join()
        settled = quiescent(launcher.run_ids, args.settle_seconds, chaos.revive)
        log("quiescent" if settled else "not quiescent in time")
        supervisor.stopping.set()
        supervisor.join(10)
        passed = report(launcher.run_ids, banks, chaos, supervisor, args)
        if passed:
            shutil.rmtree(logs, ignore_errors=True)
        else:
            print(f"process logs kept in {logs}")
        return 0 if passed else 1
    finally:
        for process in processes:
            process.stop()
        for bank in banks.values():
            bank.stop()
        ensure_redis()
        from django.db import connections
        connections.close_all()
        if not args.keep_database:
            admin(f'DROP DATABASE IF EXISTS "{TAG}" WITH (FORCE)')


def quiescent(run_ids: list[str], seconds: float, revive) -> bool:
    """Every run finished (the supervisor keeps resolving what waits for a person)."""
    from django.db import connection

    from runs.models import TERMINAL, Run

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        revive()
        left = Run.objects.filter(pk__in=run_ids).exclude(status__in=TERMINAL).count()
        connection.close()
        if not left:
            return True
        time.sleep(1)
    return False


if __name__ == "__main__":
    sys.exit(main())
