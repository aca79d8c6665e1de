"""The dispute story, end to end, on embedded defaults.

Starts the example bank MCP server, applies examples/dispute.yaml, runs an in-process Celery
worker on the in-memory broker and the REST API on a local port, then plays the console
(as asha) and the supervisor (as ravi) over HTTP and prints the run's timeline.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import httpx

ROOT = Path(__file__).resolve().parent.parent
STORY_INPUT = {
    "transaction_id": "TXN-1001",
    "amount": 12499,
    "currency": "INR",
    "customer_email": "meera@example.com",
    "message": "Customer Meera says she was charged twice for INR 12,499 at Croma on 12 Nov.",
}


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):
        pass


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


@contextmanager
def bank_server():
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "bank_server.py"), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
    )
    try:
        line = proc.stdout.readline()
        if not line.startswith("BANK_SERVER_READY"):
            raise RuntimeError("the example bank server did not start")
        yield line.split()[1]
    finally:
        proc.terminate()
        proc.wait(10)


@contextmanager
def api_server():
    from django.core.wsgi import get_wsgi_application

    server = make_server(
        "127.0.0.1", 0, get_wsgi_application(), server_class=_ThreadingServer, handler_class=_QuietHandler
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()


@contextmanager
def inprocess_worker():
    from celery.contrib.testing.worker import start_worker

    from agentplatform.celery import app

    with start_worker(
        app, pool="threads", concurrency=4, perform_ping_check=False, loglevel="WARNING", shutdown_timeout=30
    ):
        yield


def _money(micros) -> str:
    """Every amount of the story in one format, the admin's (core/money.py): `USD 0.002469`."""
    from core.money import platform_money

    return platform_money(micros)


def _at(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def _pairs(mapping: dict) -> str:
    """`amount 12499, currency INR`: arguments and counts as a person reads them, not a Python dict."""
    return ", ".join(f"{key} {value}" for key, value in mapping.items()) or "none"


class Console:
    def __init__(self, base: str, username: str, password: str):
        self.http = httpx.Client(base_url=base, timeout=30)
        token = self.http.post("/v1/auth/token", json={"username": username, "password": password})
        token.raise_for_status()
        self.http.headers["Authorization"] = f"Token {token.json()['token']}"

    def get(self, path: str):
        response = self.http.get(path)
        response.raise_for_status()
        return response.json()

    def post(self, path: str, body: dict, **headers):
        response = self.http.post(path, json=body, headers=headers)
        if response.status_code >= 400:
            raise RuntimeError(f"POST {path} -> {response.status_code}: {response.text}")
        return response.json()


def _wait_status(
    console: Console,
    run_id: str,
    statuses: set[str],
    out,
    printed: list,
    t0: dt.datetime,
    timeout: float = 120,
) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        _print_new_events(console, run_id, out, printed, t0)
        run = console.get(f"/v1/runs/{run_id}")
        if run["status"] in statuses:
            _print_new_events(console, run_id, out, printed, t0)
            return run
        if time.monotonic() > deadline:
            raise RuntimeError(f"run stuck in {run['status']}")
        time.sleep(0.2)


def _print_new_events(console: Console, run_id: str, out, printed: list, t0: dt.datetime) -> None:
    """Each event at its own time (since the run was created), not at the time it was printed; its
    message with amounts in the story's one format."""
    from tenants.admin_site import money_in_text

    after = printed[-1] if printed else 0
    for event in console.get(f"/v1/runs/{run_id}/events?after={after}"):
        printed.append(event["id"])
        marker = {
            "budget": "   $",
            "status": " ==>",
            "approval_requested": "  ??",
            "approval_approved": "  OK",
            "step": "    ",
        }.get(event["kind"], "  - ")
        since = (_at(event["at"]) - t0).total_seconds()
        out.write(f"{since:6.2f}s {marker} {money_in_text(event['message'])}\n")


@contextmanager
def warnings_to_file(out):
    """The platform's log lines go to var/demo.log, not between the story's events; the story ends
    by saying how many warnings there were and where to read them."""
    from django.conf import settings

    path = Path(settings.VAR_DIR) / "demo.log"
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    consoles = [
        h
        for h in root.handlers
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
    ]
    for console in consoles:
        root.removeHandler(console)
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()
        for console in consoles:
            root.addHandler(console)
        lines = [line for line in path.read_text().splitlines() if " WARNING " in line or " ERROR " in line]
        out.write(
            f"== log: {len(lines)} warning(s) in {path}"
            + (f", e.g. {lines[0].split(' ', 2)[2]}" if lines else "")
            + "\n"
        )


def run_demo(*, config_path: str, out) -> int:
    from django.core.management import call_command

    from configuration.apply import apply_config, load_file

    call_command("migrate", verbosity=0)
    with bank_server() as bank_url:
        os.environ["BANK_MCP_URL"] = f"{bank_url}/mcp"
        report = apply_config(load_file(ROOT / config_path))
        out.write(f"applied {config_path}: {report}\n")
        # After the worker has set up its logging, so that its handlers are the ones moved aside.
        with inprocess_worker(), api_server() as api, warnings_to_file(out):
            return _story(api, bank_url, out)


def _story(api: str, bank_url: str, out) -> int:
    asha = Console(api, "asha", "demo-password-asha")
    ravi = Console(api, "ravi", "demo-password-ravi")
    printed: list[int] = []
    out.write("\n== asha (support console) opens a dispute: POST /v1/runs\n")
    run = asha.post(
        "/v1/runs",
        {"agent": "dispute-agent", "alias": "prod", "input": STORY_INPUT},
        **{"Idempotency-Key": f"demo-{uuid.uuid4()}"},
    )
    t0 = _at(run["created_at"])
    out.write(f"run {run['id']} pinned dispute-agent v{run['version']} (alias prod)\n\n")
    run = _wait_status(
        asha, run["id"], {"waiting_approval", "succeeded", "failed", "stopped", "cancelled"}, out, printed, t0
    )
    if run["status"] == "waiting_approval":
        pending = ravi.get(f"/v1/approvals?status=pending&run={run['id']}")["results"]
        approval = pending[0]
        out.write(
            f"\n== the run waits, holding no worker. ravi (supervisor) sees {approval['tool']} "
            f"({_pairs(approval['arguments'])}) because: {approval['reason']}\n"
        )
        ravi.post(f"/v1/approvals/{approval['id']}/approve", {"reason": "duplicate charge verified"})
        out.write("== ravi approves: POST /v1/approvals/{id}/approve\n\n")
        run = _wait_status(
            asha,
            run["id"],
            {"succeeded", "failed", "stopped", "cancelled", "needs_attention"},
            out,
            printed,
            t0,
        )
    _print_summary(asha, run, bank_url, out)
    return 0 if run["status"] == "succeeded" else 1


def _print_summary(console: Console, run: dict, bank_url: str, out) -> None:
    out.write("\n== steps\n")
    out.write(f"{'seq':>3} {'kind':<5} {'tool':<28} {'status':<12} {'cost':>13} {'ms':>6}\n")
    for step in console.get(f"/v1/runs/{run['id']}/steps"):
        out.write(
            f"{step['seq']:>3} {step['kind']:<5} {step['tool'] or '(model)':<28} {step['status']:<12} "
            f"{_money(step['cost_micros']):>13} {step['duration_ms'] or 0:>6}\n"
        )
    budget = run["budget"]
    out.write(
        f"\n== budget: limit {_money(budget['limit_micros'])}, spent {_money(budget['spent_micros'])}, "
        f"reserved {_money(budget['reserved_micros'])}, held {_money(budget['held_micros'])}\n"
    )
    effects = httpx.get(f"{bank_url}/ledger", timeout=10).json()["effects"]
    counts: dict[str, int] = {}
    for effect in effects:
        counts[effect["tool"]] = counts.get(effect["tool"], 0) + 1
    out.write(
        f"== effects applied at the bank: {_pairs(counts)} (transfer_funds: {counts.get('transfer_funds', 0)})\n"
    )
    out.write(f"== final status: {run['status']}\n== answer: {run['final_output']}\n")
