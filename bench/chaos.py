"""Chaos run: many runs through the REST API while workers are killed, stalled and cut off.

    .venv/bin/python bench/chaos.py [--runs 200] [--seconds 120] [--seed N]
                                    [--settle-seconds 600] [--keep-database]

The run brings its own PostgreSQL cluster and Redis (tests/services.py: initdb + pg_ctl and
redis-server on free ports, removed at the end) and restarts only those: the machine's
PostgreSQL and Redis are never touched. It starts the API (gunicorn), Celery beat (sweeping
every second), two Celery workers (threads pool) with short leases, and two example bank
servers: `bank` over MCP and `bank2` over plain HTTP. Every run of the agent calls five tools:

    bank__lookup_transaction    read_only      MCP
    bank__issue_refund          idempotent     MCP (the bank honours the idempotency key)
    bank2__issue_refund         reconcilable   HTTP, status_url GET /http/status/{key}
    bank2__make_payment         reconcilable   HTTP, status_url GET /http/payment_status/{key}; the
                                               bank applies EVERY POST (no de-duplication) and often
                                               applies it seconds after our timeout (settle window)
    bank__send_customer_email   unsafe         MCP

Runs are started over the first 60 % of the chaos window. During --seconds of chaos it SIGKILLs a
random worker every few seconds (and starts it again), arms faults on the banks (slow calls, calls
that time out after their effect was applied, 5xx after the effect, payments applied after the
caller gave up, with "in progress" answers meanwhile), restarts Redis once (nothing persisted:
every queued message is lost), restarts PostgreSQL twice just as held-back provider answers are
released (workers are recording outcomes), and SIGSTOPs a worker with calls in flight past its
lease before SIGCONT. Runs that wait for a person (`needs_attention`) are resolved through the API
the way a supervisor would: look the idempotency key up in the provider's ledger; if the effect is
there the call succeeded, if not it failed.

At the end it waits (at most --settle-seconds) until every run has finished, then prints runs by
final status, effects applied per tool against the effects the platform recorded, duplicate
effects per tool, known outcomes that became unknown, late attempts fenced out, messages the
sweeper sent again per run, reservations left open on finished runs and runs neither finished nor
waiting for a person, and exits non-zero if any target is missed.

A known outcome that became unknown is a tool step that ended unknown (`outcome_unknown`, or
resolved by the supervisor) although the provider applied its effect and finished sending a
normal answer (the bank's call log), for a key that took no fault stalling or failing its answer,
sent from no worker that was killed, stalled or exited while the call was in flight (matched by
the call's client port against the worker's open sockets at that moment), and answered more than
RECORD_GRACE seconds before any such worker loss (a worker lost while recording is not a fault of
the record).
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
from urllib.parse import urlsplit

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.services import ThrowawayPostgres, ThrowawayRedis

TAG = f"chaos_{os.getpid()}"
TOOL_TIMEOUT = 3  # seconds; leases are this + LEASE_MARGIN
LEASE_MARGIN = 2
MODEL_TIMEOUT = 5
MAX_FAULT_DELAY = 5  # no armed delay on the other tools is longer
PAYMENT_LAG = 8  # the payment gateway applies a payment at most this long after receiving it
PAYMENT_SETTLE = 7  # its settle window: longer than it lags past our timeout (PAYMENT_LAG - TOOL_TIMEOUT)
SETTLE = MAX_FAULT_DELAY  # the other retried tools' settle window (their effects lag at most this)
ANSWER_DELAY = 1.5  # held-back answers released when PostgreSQL restarts (< TOOL_TIMEOUT: a normal answer)
RECORD_GRACE = TOOL_TIMEOUT + LEASE_MARGIN  # a worker keeps recording an answer until its lease ends
WORKERS = 2
CONCURRENCY = 6
SUCCESS = ("succeeded", "resolved_succeeded")
UNKNOWN = ("outcome_unknown", "resolved_succeeded", "resolved_failed")
WORKER_STEPS_OFF = ["--without-gossip", "--without-mingle"]  # as scripts/serve.sh

# The environment of every child process; filled in by main() once the throwaway servers run.
CHILD_ENV: dict[str, str] = {}


def child_env(database_url: str, broker_url: str) -> dict[str, str]:
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "CELERY_BROKER_URL": broker_url,
        "CELERY_QUEUE": f"chaos-{os.getpid()}",
        "LEASE_MARGIN_SECONDS": str(LEASE_MARGIN),
        "QUEUED_TOO_LONG_SECONDS": "6",
        "SWEEP_INTERVAL_SECONDS": "1",
        "MAX_STEP_CRASHES": "3",
        "PYTHONUNBUFFERED": "1",
        "LOG_LEVEL": "WARNING",
    }
    for name in ("DB_POOL_MAX", "TEST_DATABASE_NAME", "THROWAWAY_POSTGRES", "THROWAWAY_REDIS"):
        env.pop(name, None)
    return env


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
        self.offset = 0

    def start(self, timeout: float = 180, *, wait: bool = True) -> Process:
        """Start the process; with `wait`, until it says it is ready."""
        self.starts += 1
        self.offset = self.log_path.stat().st_size if self.log_path.exists() else 0  # earlier lives' output
        log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.args, cwd=ROOT, env=CHILD_ENV, stdout=log_file, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while wait and not self.is_ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        return self

    def is_ready(self) -> bool:
        """Alive and past its ready line in this life's output."""
        if not self.alive:
            return False
        return not self.ready or self.ready.encode() in self.log_path.read_bytes()[self.offset :]

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
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "bank_server.py"), "--port", "0", "--label", label],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def wait_ready(self) -> Bank:
        line = self.proc.stdout.readline()
        if not line.startswith("BANK_SERVER_READY"):
            raise RuntimeError(f"bank {self.label} did not start")
        self.url = line.split()[1]
        return self

    def effects(self) -> list[dict]:
        return httpx.get(f"{self.url}/ledger", timeout=10).json()["effects"]

    def fault(self, **spec) -> None:
        httpx.post(f"{self.url}/faults", json=spec, timeout=10).raise_for_status()

    def taken(self) -> list[dict]:
        """Faults consumed by calls, with each call's idempotency key."""
        return httpx.get(f"{self.url}/faults", timeout=10).json()["taken"]

    def calls(self) -> list[dict]:
        """Every tool call the bank received: client port, received and answered times, HTTP status."""
        return httpx.get(f"{self.url}/calls", timeout=30).json()["calls"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def open_ports(pid: int, remote: set[int]) -> set[int]:
    """Local ports of the TCP sockets process `pid` holds open to the `remote` ports (its calls in flight)."""
    try:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        ports = set()
        for table in ("tcp", "tcp6"):
            with open(f"/proc/{pid}/net/{table}") as rows:
                for row in list(rows)[1:]:
                    fields = row.split()
                    if fields[9] in inodes and int(fields[2].rsplit(":", 1)[1], 16) in remote:
                        ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        return ports
    except OSError:
        return set()


# --- tenant ------------------------------------------------------------------------------------


def configure(bank: Bank, bank2: Bank) -> tuple[str, str]:
    """The tenant, its tools (one per effect class), the agent; returns (agent token, supervisor token)."""
    from guardian.shortcuts import assign_perm

    from agents.models import Alias
    from agents.services import create_version
    from llm.models import ModelEndpoint
    from tenants.models import Tenant, User
    from tenants.tokens import issue_token
    from tools.catalog import refresh
    from tools.models import Tool, ToolServer

    tenant = Tenant.objects.create(
        slug="chaos",
        name="Chaos",
        daily_budget_micros=10**12,
        max_active_runs=100_000,
        max_starts_per_minute=100_000,
        max_cost_micros_cap=10**12,
    )
    agent_user = User.objects.create_user(username="asha", password="pw", tenant=tenant)
    supervisor = User.objects.create_user(username="meera", password="pw", tenant=tenant, is_staff=True)
    mcp = ToolServer.objects.create(
        tenant=tenant,
        name="bank",
        kind=ToolServer.Kind.MCP,
        transport=ToolServer.Transport.STREAMABLE_HTTP,
        url=f"{bank.url}/mcp",
        status_tool="refund_status",
    )
    refresh(mcp)
    http = ToolServer.objects.create(
        tenant=tenant, name="bank2", kind=ToolServer.Kind.HTTP, url=f"{bank2.url}/http"
    )
    common = {
        "enabled": True,
        "timeout_seconds": TOOL_TIMEOUT,
        "approval_policy": "never",
        "price_micros": 1000,
        "max_attempts": 4,
        "backoff_seconds": 0.5,
    }
    classes = {
        "lookup_transaction": "read_only",
        "issue_refund": "idempotent",
        "send_customer_email": "unsafe",
    }
    for remote, effect in classes.items():
        Tool.objects.filter(server=mcp, remote_name=remote).update(
            effect_class=effect, settle_seconds=SETTLE, **common
        )
    schema = Tool.objects.get(server=mcp, remote_name="issue_refund").input_schema
    Tool.objects.create(
        tenant=tenant,
        server=http,
        name="bank2__issue_refund",
        remote_name="issue_refund",
        input_schema=schema,
        effect_class="reconcilable",
        settle_seconds=SETTLE,
        status_url=f"{bank2.url}/http/status/{{key}}",
        **common,
    )
    # A payment gateway without idempotency: every POST pays. Only the settle window keeps a slow
    # payment from being looked up too early, found missing, and paid again.
    Tool.objects.create(
        tenant=tenant,
        server=http,
        name="bank2__make_payment",
        remote_name="make_payment",
        input_schema={
            "type": "object",
            "required": ["to_account", "amount"],
            "properties": {"to_account": {"type": "string"}, "amount": {"type": "number"}},
        },
        effect_class="reconcilable",
        settle_seconds=PAYMENT_SETTLE,
        status_url=f"{bank2.url}/http/payment_status/{{key}}",
        **common,
    )
    tools = list(Tool.objects.filter(tenant=tenant, enabled=True))
    for tool in tools:
        assign_perm("tools.use_tool", agent_user, tool)
        assign_perm("tools.approve_tool", supervisor, tool)

    def call(name: str, arguments: dict) -> dict:
        return {"tool_calls": [{"name": name, "arguments": arguments}]}

    ModelEndpoint.objects.create(
        tenant=tenant,
        name="scripted",
        kind="scripted",
        model="scripted",
        timeout_seconds=MODEL_TIMEOUT,
        config={
            "latency_ms": 30,
            "turns": [
                call("bank__lookup_transaction", {"transaction_id": "TXN-1002"}),
                call(
                    "bank__issue_refund",
                    {"transaction_id": "TXN-1002", "amount": "$input.refund", "currency": "INR"},
                ),
                call(
                    "bank2__issue_refund",
                    {"transaction_id": "TXN-1001", "amount": "$input.refund2", "currency": "INR"},
                ),
                call("bank2__make_payment", {"to_account": "$input.account", "amount": "$input.payment"}),
                call(
                    "bank__send_customer_email",
                    {"to": "$input.email", "subject": "Your dispute", "body": "Refunded."},
                ),
                {"text": "The dispute is settled."},
            ],
        },
    )
    version, _ = create_version(
        tenant=tenant,
        agent="chaos-agent",
        spec={
            "model": "scripted",
            "instructions": "Settle the dispute.",
            "tools": sorted(t.name for t in tools),
        },
    )
    Alias.objects.create(agent=version.agent, name="prod", version=version)
    assign_perm("agents.run_agent", agent_user, version.agent)
    assign_perm("tenants.view_runs", supervisor, tenant)  # the supervisor resolves runs it did not start
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
            body = {
                "agent": "chaos-agent",
                "input": {
                    "refund": self.rng.randint(1, 3200),
                    "refund2": self.rng.randint(1, 5000),
                    "email": f"customer{i}@example.com",
                    "account": f"ACC-{i:04d}",
                    "payment": self.rng.randint(1, 9000),
                },
            }
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
        waiting = self.api.call("GET", "/v1/runs", params={"status": "needs_attention", "limit": 200}).json()
        for run in waiting["results"]:
            steps = self.api.call("GET", f"/v1/runs/{run['id']}/steps").json()
            for step in steps["results"] if isinstance(steps, dict) else steps:
                # Model steps can stay outcome_unknown (a held charge); only tool calls wait for a person.
                if step["status"] == "outcome_unknown" and step.get("kind") == "tool":
                    self.judge(run["id"], step)

    def judge(self, run_id: str, step: dict) -> None:
        # A delayed call may still land: wait out the longest lag before looking at the ledger.
        first = self.first_seen.setdefault((run_id, step["seq"]), time.monotonic())
        if time.monotonic() - first < max(MAX_FAULT_DELAY, PAYMENT_LAG) + 1:
            return
        server, remote = step["tool"].split("__", 1)
        effect = next(
            (
                e
                for e in self.banks[server].effects()
                if e["tool"] == remote and e["idempotency_key"] == step["idempotency_key"]
            ),
            None,
        )
        body = (
            {"outcome": "succeeded", "reason": "the provider's ledger has it", "result": effect["result"]}
            if effect
            else {"outcome": "failed", "reason": "the provider's ledger has no such call"}
        )
        answer = self.api.call("POST", f"/v1/runs/{run_id}/steps/{step['seq']}/resolve", json=body)
        if answer.status_code == 200:
            self.resolved[body["outcome"]] += 1


class Chaos:
    """Kills, stalls, Redis and PostgreSQL restarts and provider faults, at random moments for `seconds`."""

    FAULTS = [
        ("bank", "send_customer_email"),
        ("bank", "issue_refund"),
        ("bank", "lookup_transaction"),
        ("bank2", "issue_refund"),
        ("bank2", "make_payment"),
    ]

    def __init__(
        self,
        workers: list[Process],
        others: list[Process],
        banks: dict[str, Bank],
        rng: random.Random,
        postgres: ThrowawayPostgres,
        broker: ThrowawayRedis,
    ):
        self.workers, self.others, self.banks, self.rng = workers, others, banks, rng
        self.cluster, self.broker = postgres, broker
        self.counts = collections.Counter()
        # Worker losses: (epoch time, worker, the local ports of its sockets then: its calls in flight).
        self.losses: list[tuple[float, str, set[int]]] = []

    def calls_in_flight(self, worker: Process) -> set[int]:
        """The local ports of the worker's calls to the banks that no bank has answered yet.

        An open connection alone is not a call in flight: the worker's HTTP client keeps idle
        connections alive between calls (tools/transports.py), and counting them let the stall
        stop an idle worker (no late attempt to fence out) and excused, as lost with a worker,
        an earlier call that had gone out on the same connection."""
        ports = open_ports(worker.proc.pid, {urlsplit(bank.url).port for bank in self.banks.values()})
        if not ports:
            return ports
        waiting = {c["port"] for bank in self.banks.values() for c in bank.calls() if c["answered"] is None}
        return ports & waiting

    def lose(self, worker: Process, ports: set[int]) -> None:
        """Note a worker lost just now (after its signal was sent), with its calls then in flight:
        an answer that reached it before this moment may never be recorded, and the time must not
        be read before the signal, or an answer landing in between would look recordable."""
        self.losses.append((time.time(), worker.name, ports))

    def revive(self) -> None:
        """Play the process supervisor (systemd, Kubernetes): start again what exited by itself."""
        for process in self.workers + self.others:
            if not process.alive:
                log(
                    f"chaos: {process.name} exited by itself (code {process.proc.returncode}); starting it again"
                )
                self.counts[f"{process.name.rstrip('0123456789')} exit on its own, restarted"] += 1
                if process in self.workers:
                    self.losses.append((time.time(), process.name, set()))
                # A worker boots in the background (up to 25 s on a busy machine): waiting here
                # would push the rest of the chaos past the runs it is meant to hit.
                process.start(wait=process not in self.workers)

    def fault(self) -> None:
        server, tool = self.rng.choice(self.FAULTS)
        kind = self.rng.choice(["delay_after_effect", "delay_before_effect", "fail_5xx_after_effect", "slow"])
        times = self.rng.randint(1, 3)
        if kind == "delay_after_effect":  # applied, then the caller times out
            spec = {"delay_after_effect": self.rng.uniform(TOOL_TIMEOUT + 0.5, MAX_FAULT_DELAY)}
        elif kind == "delay_before_effect":  # times out before the effect lands (it lands later)
            spec = {"delay_before_effect": self.rng.uniform(TOOL_TIMEOUT + 0.5, MAX_FAULT_DELAY)}
        elif kind == "slow":
            spec = {"delay_before_effect": self.rng.uniform(0.5, TOOL_TIMEOUT - 1)}
        else:
            spec = {"fail_5xx_after_effect": True}
        self.banks[server].fault(tool=tool, times=times, **spec)
        self.counts[f"fault {kind}"] += times

    def lagging_payment(self) -> None:
        """The gateway applies the payment after our timeout; meanwhile its status says 409 or "not found"."""
        times = self.rng.randint(1, 3)
        pending = self.rng.random() < 0.5
        self.banks["bank2"].fault(
            tool="make_payment",
            times=times,
            pending_visible=pending,
            delay_before_effect=self.rng.uniform(TOOL_TIMEOUT + 0.5, PAYMENT_LAG),
        )
        self.counts["fault payment applied after the timeout" + (" (409 meanwhile)" if pending else "")] += (
            times
        )

    def kill(self) -> None:
        worker = self.rng.choice([w for w in self.workers if w.alive] or self.workers)
        log(f"chaos: SIGKILL {worker.name}")
        ports = self.calls_in_flight(worker)  # read first: a dead process holds no socket
        worker.kill()
        self.lose(worker, ports)
        self.counts["worker SIGKILL"] += 1
        # In the background, as revive(): in CI a SIGKILL's blocking restart (24 s) pushed the
        # stall past the last run, and it stopped a worker with no call to fence out.
        worker.start(wait=False)

    def stall(self) -> None:
        """SIGSTOP the worker with the most calls in flight past its lease: when it wakes, it is fenced out."""
        deadline = time.monotonic() + 15
        while True:
            busiest = max((w for w in self.workers if w.alive), key=lambda w: len(self.calls_in_flight(w)))
            if self.calls_in_flight(busiest) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        # Sweeps run on the workers: the stall must outlast the lease and give another worker (perhaps
        # just revived after a kill) time to sweep and take the run over, or nobody fences it out.
        others = [w for w in self.workers if w is not busiest]
        wait_for_other = time.monotonic() + 20
        while not any(w.alive for w in others) and time.monotonic() < wait_for_other:
            self.revive()
            time.sleep(0.2)
        seconds = TOOL_TIMEOUT + LEASE_MARGIN + MODEL_TIMEOUT + 10
        log(f"chaos: SIGSTOP {busiest.name} for {seconds} s")
        busiest.signal(signal.SIGSTOP)
        self.lose(busiest, self.calls_in_flight(busiest))  # a stopped process keeps its sockets
        time.sleep(seconds)
        # The other worker may still be booting (restarted after a kill): wake the stalled one only
        # once another can have swept its expired lease and taken the run over.
        booting = time.monotonic() + 60
        if not any(w.is_ready() for w in others):
            while not any(w.is_ready() for w in others) and time.monotonic() < booting:
                time.sleep(0.2)
            time.sleep(LEASE_MARGIN + 3)  # a few sweeps (SWEEP_INTERVAL_SECONDS=1)
        busiest.signal(signal.SIGCONT)
        self.counts["worker SIGSTOP past its lease"] += 1

    def redis(self) -> None:
        log("chaos: restarting Redis (queued messages are lost)")
        self.broker.restart()
        self.counts["redis restart"] += 1

    def postgres(self) -> None:
        """Restart PostgreSQL just as held-back answers are released: workers are recording them."""
        armed = time.time()
        for server, tool in (
            ("bank", "send_customer_email"),
            ("bank2", "make_payment"),
            ("bank", "issue_refund"),
        ):
            self.banks[server].fault(tool=tool, times=2, delay_after_effect=ANSWER_DELAY)
        deadline = time.monotonic() + 15
        taken: list[dict] = []
        while not taken and time.monotonic() < deadline:
            taken = [
                t
                for bank in self.banks.values()
                for t in bank.taken()
                if t["kind"] == "delay_after_effect" and t["value"] == ANSWER_DELAY and t["at"] >= armed
            ]
            time.sleep(0.05)
        if taken:
            time.sleep(max(min(t["at"] for t in taken) + ANSWER_DELAY - time.time(), 0))
        when = "as a held-back answer is released" if taken else "no call took the held-back answer fault"
        log(f"chaos: restarting PostgreSQL ({when})")
        self.cluster.restart()
        self.counts["postgresql restart"] += 1
        self.counts["postgresql restart as answers were released"] += bool(taken)

    def play(self, seconds: float) -> None:
        start = time.monotonic()
        end = start + seconds
        # Apart from each other: a worker stalled across a PostgreSQL restart wakes past its lease with a
        # dead connection and gives up its record without the late-attempt event the stall is there to see.
        # The first PostgreSQL restart comes while runs are still being started (the first 60 % of the
        # window), so calls are there to take the held-back answers it waits for.
        once = {
            "redis": start + 0.2 * seconds,
            "postgres": start + 0.3 * seconds,
            "stall": start + 0.55 * seconds,
            "postgres ": start + 0.85 * seconds,
        }
        next_kill = time.monotonic() + self.rng.uniform(2, 6)
        while time.monotonic() < end:
            self.revive()
            now = time.monotonic()
            for name, at in list(once.items()):
                if now >= at:
                    del once[name]
                    getattr(self, name.strip())()
                    # No kill while workers record through it: a restart is tested on its own. Nor
                    # the next restart: in CI one came 4 s after a stalled worker woke, before it
                    # recorded, and it gave up with a dead connection instead of being fenced out.
                    settled = time.monotonic() + RECORD_GRACE + 1
                    next_kill = max(next_kill, settled)
                    once = {other: max(when, settled) for other, when in once.items()}
            if now >= next_kill:
                self.kill()
                next_kill = time.monotonic() + self.rng.uniform(3, 9)
            if self.rng.random() < 0.5:
                self.fault()
            if self.rng.random() < 0.5:
                self.lagging_payment()
            time.sleep(self.rng.uniform(0.5, 1.5))
        for name in once:  # a short run still gets one of each, apart as above
            time.sleep(RECORD_GRACE + 1)
            getattr(self, name.strip())()


# --- the report --------------------------------------------------------------------------------


def answer_spoiled(taken: dict) -> bool:
    """A fault that stalls the answer past our timeout, fails it, or makes the provider lag behind it."""
    kind, value = taken["kind"], taken["value"]
    if kind in ("delay_after_effect", "delay_before_effect"):
        return float(value) >= TOOL_TIMEOUT - 0.5
    return bool(value)


def why_unknown(tool: str, key: str, bank: dict, losses: list[tuple[float, str, set[int]]]) -> str:
    """Why a step's outcome was unknown, from what the provider and the chaos saw; "known" if nothing explains it."""
    if not any(e["tool"] == tool and e["idempotency_key"] == key for e in bank["effects"]):
        return "nothing applied"
    if any(t["tool"] == tool and t["key"] == key and answer_spoiled(t) for t in bank["taken"]):
        return "a fault stalled or failed the answer"
    calls = [c for c in bank["calls"] if c["tool"] == tool and c["key"] == key]
    for at, _, ports in losses:
        if any(c["port"] in ports and c["received"] <= at for c in calls):
            return "in flight on a worker that was killed or stalled"
    if any(c["answered"] is None for c in calls):
        return "the answer never went out"
    if any(c["status"] != 200 for c in calls):
        return "the provider answered an error"
    if any(c["answered"] - c["received"] >= TOOL_TIMEOUT for c in calls):
        return "answered after our timeout"
    for at, _, _ in losses:
        if any(at - RECORD_GRACE <= c["answered"] <= at for c in calls):
            return "answered just before a worker was killed or stalled"
    return "known"


def report(run_ids: list[str], banks: dict[str, Bank], chaos: Chaos, supervisor: Supervisor, args) -> bool:
    from django.db.models import Count

    from budgets.models import Reservation
    from runs.models import TERMINAL, Run, RunEvent, Step
    from tools.models import Tool

    runs = Run.objects.filter(pk__in=run_ids)
    by_status = dict(runs.values_list("status").annotate(n=Count("pk")).order_by("status"))
    stuck = runs.exclude(status__in=[*TERMINAL, "needs_attention", "waiting_approval"]).count()
    open_reservations = Reservation.objects.filter(
        run__in=runs.filter(status__in=TERMINAL), status=Reservation.Status.OPEN
    ).count()
    seen = {
        name: {"effects": bank.effects(), "taken": bank.taken(), "calls": bank.calls()}
        for name, bank in banks.items()
    }
    print()
    print(
        f"chaos run: {len(run_ids)} runs launched through the API, {args.seconds:g} s of chaos, seed {args.seed}"
    )
    print("chaos:     " + ", ".join(f"{n} {what}" for what, n in sorted(chaos.counts.items())))
    print("runs by final status: " + ", ".join(f"{status} {n}" for status, n in by_status.items()))
    print()
    print(
        f"{'tool':<27}{'class':<14}{'applied':>8}{'expected':>9}{'unknown':>8}{'mismatched':>11}"
        f"{'same key twice':>15}{'runs with >1':>13}"
    )
    duplicates: dict[str, int] = {}
    mismatched = 0
    reasons = collections.Counter()
    became_unknown: list[str] = []
    for tool in Tool.objects.filter(tenant__slug="chaos", enabled=True).order_by("name"):
        server, remote = tool.name.split("__", 1)
        steps = list(
            Step.objects.filter(run__in=runs, tool=tool, replayed_from_seq__isnull=True).values_list(
                "idempotency_key", "status"
            )
        )
        expected = {key for key, status in steps if status in SUCCESS}
        unknown = {key for key, status in steps if status == "outcome_unknown"}
        for key, status in steps:
            if status in UNKNOWN:
                reason = why_unknown(remote, key, seen[server], chaos.losses)
                reasons[reason] += 1
                if reason == "known":
                    became_unknown.append(f"{tool.name} {key} ({status})")
        if tool.effect_class == "read_only":
            print(
                f"{tool.name:<27}{tool.effect_class:<14}{'-':>8}{len(expected):>9}{len(unknown):>8}"
                f"{'-':>11}{'-':>15}{'-':>13}"
            )
            continue
        keys = [e["idempotency_key"] for e in seen[server]["effects"] if e["tool"] == remote]
        counted = collections.Counter(keys)
        twice = sum(n - 1 for n in counted.values())
        per_run = collections.Counter(key.rsplit(":", 1)[0] for key in counted)
        more_than_one = sum(1 for n in per_run.values() if n > 1)
        wrong = len((set(counted) - expected - unknown) | (expected - set(counted)))
        duplicates[tool.name] = twice + more_than_one
        mismatched += wrong
        print(
            f"{tool.name:<27}{tool.effect_class:<14}{len(keys):>8}{len(expected):>9}{len(unknown):>8}"
            f"{wrong:>11}{twice:>15}{more_than_one:>13}"
        )
    events = dict(RunEvent.objects.filter(run__in=runs).values_list("kind").annotate(n=Count("pk")))
    found = collections.Counter(
        RunEvent.objects.filter(run__in=runs, kind="recovery").values_list("skeleton__found", flat=True)
    )
    resent = collections.Counter(
        RunEvent.objects.filter(run__in=runs, kind="recovery", skeleton__found="lost_message").values_list(
            "run_id", flat=True
        )
    )
    late = events.get("late_attempt", 0)
    print()
    print(
        f"recovery:  sweeper found {found.get('expired_lease', 0)} expired leases, "
        f"{found.get('lost_message', 0)} lost messages, {found.get('open_reservation', 0)} open reservations; "
        f"{events.get('retry_scheduled', 0)} retries scheduled, {late} late attempts "
        f"fenced out; resolved by the supervisor: {dict(supervisor.resolved) or 'none'}"
    )
    print(
        f"re-sent:   the sweeper sent {sum(resent.values())} messages again, for {len(resent)} of "
        f"{len(run_ids)} runs (at most {max(resent.values(), default=0)} for one run, "
        f"{sum(resent.values()) / max(len(run_ids), 1):.2f} per run)"
    )
    print(
        "unknown:   "
        + (", ".join(f"{n} {why}" for why, n in reasons.most_common()) or "no step ended unknown")
    )
    for line in became_unknown[:20]:
        print(f"           known, became unknown: {line}")
    print()
    targets = [
        *((f"duplicate effects {name}", n) for name, n in duplicates.items()),
        ("known outcomes that became unknown", len(became_unknown)),
        ("effects not matching the step log", mismatched),
        ("reservations still open on finished runs", open_reservations),
        ("runs neither finished nor waiting for a person", stuck),
        ("runs not launched", args.runs - len(run_ids)),
    ]
    missed = []
    for what, n in targets:
        print(f"{what:<56}{n:>5}   (target 0)")
        if n:
            missed.append(what)
    print(f"{'late attempts fenced out':<56}{late:>5}   (target > 0: the stall tested fencing)")
    if not late:
        missed.append("no late attempt fenced out")
    restarts = chaos.counts["postgresql restart as answers were released"]
    print(f"{'PostgreSQL restarts as held-back answers were released':<56}{restarts:>5}   (target > 0)")
    if not restarts:
        missed.append("no PostgreSQL restart landed while answers were released")
    print(f"\nresult: {'FAIL: ' + ', '.join(missed) if missed else 'PASS'}")
    return not missed


# --- main --------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description="chaos run against real processes")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--settle-seconds", type=float, default=600, help="how long to wait for quiescence")
    parser.add_argument(
        "--keep-database",
        action="store_true",
        help="leave the throwaway PostgreSQL cluster's folder for a post-mortem",
    )
    args = parser.parse_args()
    rng = random.Random(args.seed)
    logs = Path(tempfile.mkdtemp(prefix=f"{TAG}-"))
    processes: list[Process] = []
    banks: dict[str, Bank] = {}
    postgres, broker = ThrowawayPostgres.create(), ThrowawayRedis.create()
    try:
        postgres.start()
        broker.start()
        postgres.create_database(TAG)
        CHILD_ENV.update(child_env(postgres.url(TAG), broker.url(15)))
        os.environ.update(
            DATABASE_URL=CHILD_ENV["DATABASE_URL"],
            CELERY_BROKER_URL=CHILD_ENV["CELERY_BROKER_URL"],
            CELERY_QUEUE=CHILD_ENV["CELERY_QUEUE"],
            DJANGO_SETTINGS_MODULE="agentplatform.settings",
            LOG_LEVEL="ERROR",
        )
        log(
            f"own PostgreSQL on port {postgres.port} ({postgres.folder}), own Redis on port {broker.port}; "
            f"database {TAG}, queue {CHILD_ENV['CELERY_QUEUE']}, logs in {logs}"
        )
        banks = {"bank": Bank("bank"), "bank2": Bank("bank2")}  # they start while the database migrates
        subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput"],
            cwd=ROOT,
            env=CHILD_ENV,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        for bank in banks.values():
            bank.wait_ready()
        import django

        django.setup()

        port = free_port()
        api_process = Process(
            "api",
            [
                sys.executable,
                "-m",
                "gunicorn",
                "agentplatform.wsgi",
                "-b",
                f"127.0.0.1:{port}",
                "-w",
                "3",
                "--timeout",
                "60",
            ],
            logs,
            "Booting worker",
        )
        beat = Process(
            "beat",
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "agentplatform",
                "beat",
                "-s",
                str(logs / "beat-schedule"),
                "--loglevel",
                "INFO",
            ],
            logs,
            "beat: Starting",
        )
        queues = (
            f"{CHILD_ENV['CELERY_QUEUE']},{CHILD_ENV['CELERY_QUEUE']}.sweeper"  # beat's sweeps have their own
        )
        workers = [
            Process(
                f"worker{i}",
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "agentplatform",
                    "worker",
                    "-P",
                    "threads",
                    "-c",
                    str(CONCURRENCY),
                    "-Q",
                    queues,
                    "-n",
                    f"chaos{i}-{os.getpid()}@%h",
                    *WORKER_STEPS_OFF,
                    "--loglevel",
                    "INFO",
                ],
                logs,
                " ready.",
            )
            for i in range(1, WORKERS + 1)
        ]
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
        chaos = Chaos(workers, [api_process, beat], banks, rng, postgres, broker)
        log(f"launching {args.runs} runs; chaos for {args.seconds:g} s")
        launcher.start()
        supervisor.start()
        chaos.play(args.seconds)

        log("chaos over: every process running again, no more faults; waiting for quiescence")
        broker.start()
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
        from django.db import connections

        connections.close_all()
        broker.destroy()
        if args.keep_database:
            postgres.stop()
            print(
                f"PostgreSQL cluster kept: {postgres.folder} (start it with pg_ctl -D {postgres.data} start)"
            )
        else:
            postgres.destroy()


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
