"""The runner: a loopback HTTP service that runs executions in fresh sandboxes, one per call.

    python -m sandbox.runner --port 8790 [--backend bubblewrap|gvisor] [--slots N]

It imports nothing of Django and re-executes itself with a cleared environment, so it holds no
database URL, broker URL or secret key even when started from a shell that has them.

The platform authenticates itself with a shared secret: the token in `--token-file` (created,
mode 0600, with a random token when missing; the platform reads the same file or
SANDBOX_RUNNER_TOKEN), sent as `Authorization: Bearer <token>`. Without it nothing runs and no
result is read: anything else that can reach the port (another local user, a process in a
container sharing the network) gets 401, and a finished execution's result, files included, is
returned only to the platform.

POST /v1/executions  {"key", "tenant", "code", "inputs": [{"name", "content_b64"}], "limits"}
    -> 200 {"exit_code", "limit", "message", "stdout", "stderr", "files": [...], "usage", ...}
    -> 400 {"error", "field"} on a bad request; 503 {"error"} when no slot came free in time;
       401 without the token.
GET /healthz -> {"status": "ok", "backend", "slots"} (open: it says nothing of executions)
GET /metrics -> executions by outcome (ok, error, the limit hit), running, seconds of queue
    wait, wall and CPU in total, slots free (with the token)

Concurrency: `slots` sandboxes at once, each with a uid of its own; a tenant holds at most
`tenant_share` of them, so one tenant's backlog or fork bomb leaves the others their slots.
Idempotency: the (tenant, key) of a finished execution returns the result already produced; a
request for a key still running waits for that run instead of starting a second one. Results
are kept in memory for `keep_seconds` (a worker retries within its lease, minutes at most).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import collections
import hashlib
import hmac
import json
import math
import os
import secrets
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from sandbox.backends import Backend, BackendUnavailable, Bubblewrap, Execution, Outcome, input_name
from sandbox.limits import Limits

MAX_BODY = 256 * 1024 * 1024


class BadRequest(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class Busy(RuntimeError):
    pass


class Slots:
    """`count` slots; a tenant may hold at most `share` of them. Waiters are served in arrival
    order among those allowed to take a slot, so a tenant at its share does not block others."""

    def __init__(self, count: int, share: int):
        self.count = count
        self.share = max(1, min(share, count))
        self.free = list(range(count))
        self.held: collections.Counter[str] = collections.Counter()
        self.cond = threading.Condition()

    def acquire(self, tenant: str, *, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not (self.free and self.held[tenant] < self.share):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Busy(f"no sandbox slot came free within {timeout:g} s")
                self.cond.wait(left)
            self.held[tenant] += 1
            return self.free.pop(0)

    def release(self, tenant: str, slot: int) -> None:
        with self.cond:
            self.held[tenant] -= 1
            self.free.append(slot)
            self.cond.notify_all()


class Runner:
    def __init__(
        self,
        backend: Backend,
        *,
        slots: int,
        tenant_share: int,
        cap: Limits = Limits(),
        keep_seconds: float = 3600.0,
    ):
        self.backend = backend
        self.slots = Slots(slots, tenant_share)
        self.cap = cap
        self.keep_seconds = keep_seconds
        self.results: collections.OrderedDict[tuple[str, str], tuple[float, dict]] = collections.OrderedDict()
        self.running: dict[tuple[str, str], threading.Event] = {}
        self.lock = threading.Lock()
        self.executions: collections.Counter[str] = collections.Counter()
        # /metrics: totals since start, by outcome ("ok", "error" or the limit hit)
        self.seconds: collections.defaultdict[str, float] = collections.defaultdict(float)

    def parse(self, body: dict) -> tuple[str, str, Execution, float]:
        if not isinstance(body, dict):
            raise BadRequest("body", "the body must be a JSON object")
        key = _string(body, "key")
        tenant = _string(body, "tenant")
        code = _string(body, "code", empty=True)
        inputs = {}
        for i, item in enumerate(body.get("inputs") or []):
            try:
                name = input_name(item["name"])
                data = base64.b64decode(item["content_b64"], validate=True)
            except (KeyError, TypeError, binascii.Error) as exc:
                raise BadRequest(f"inputs[{i}]", f"needs a name and base64 content_b64 ({exc})") from None
            except ValueError as exc:
                raise BadRequest(f"inputs[{i}].name", str(exc)) from None
            if name in inputs:
                raise BadRequest(f"inputs[{i}].name", f"two inputs are named {name}")
            inputs[name] = data
        try:
            limits = Limits.from_dict(body.get("limits"), cap=self.cap)
        except (ValueError, TypeError) as exc:
            raise BadRequest("limits", str(exc)) from None
        queue_timeout = body.get("queue_timeout", limits.wall_seconds)
        if not isinstance(queue_timeout, (int, float)) or queue_timeout < 0:
            raise BadRequest("queue_timeout", "queue_timeout must be a number of seconds")
        return tenant, key, Execution(code=code, inputs=inputs, limits=limits), float(queue_timeout)

    def run(self, body: dict) -> dict:
        tenant, key, execution, queue_timeout = self.parse(body)
        ident = (tenant, key)
        while True:
            with self.lock:
                self._expire()
                if ident in self.results:
                    return self.results[ident][1] | {"replayed": True}
                waiting = self.running.get(ident)
                if waiting is None:
                    done = self.running[ident] = threading.Event()
                    break
            waiting.wait(execution.limits.wall_seconds + queue_timeout + 30)
        try:
            result = self._execute(tenant, execution, queue_timeout)
            with self.lock:
                self.results[ident] = (time.monotonic(), result)
            return result | {"replayed": False}
        finally:
            with self.lock:
                self.running.pop(ident, None)
            done.set()

    def _execute(self, tenant: str, execution: Execution, queue_timeout: float) -> dict:
        asked = time.monotonic()
        slot = self.slots.acquire(tenant, timeout=queue_timeout)
        queue_seconds = time.monotonic() - asked
        try:
            outcome = self.backend.execute(execution, slot=slot)
        finally:
            self.slots.release(tenant, slot)
        kind = outcome.limit or ("ok" if outcome.exit_code == 0 else "error")
        with self.lock:
            self.executions[kind] += 1
            self.seconds["queue_wait"] += queue_seconds
            self.seconds["wall"] += outcome.wall_seconds
            self.seconds["cpu"] += outcome.cpu_seconds
        return result_body(outcome, execution.limits, queue_seconds)

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.keep_seconds
        while self.results and next(iter(self.results.values()))[0] < cutoff:
            self.results.popitem(last=False)


def _string(body: dict, field: str, *, empty: bool = False) -> str:
    value = body.get(field)
    if not isinstance(value, str) or (not empty and not value):
        raise BadRequest(field, f"{field} must be a non-empty string")
    return value


def result_body(outcome: Outcome, limits: Limits, queue_seconds: float) -> dict:
    return {
        "exit_code": outcome.exit_code,
        "limit": outcome.limit,
        "message": outcome.message,
        "stdout": outcome.stdout.decode(errors="replace"),
        "stderr": outcome.stderr.decode(errors="replace"),
        "files": [
            {
                "name": name,
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "content_b64": base64.b64encode(data).decode(),
            }
            for name, data in outcome.files.items()
        ],
        "skipped_files": outcome.skipped,
        "usage": {
            "cpu_seconds": round(outcome.cpu_seconds, 6),
            "memory_peak_bytes": outcome.memory_peak_bytes,
            "wall_seconds": round(outcome.wall_seconds, 6),
            # memory billed as the limit held for the wall time: what the slot kept from others
            "gib_seconds": round(limits.memory_bytes / 2**30 * outcome.wall_seconds, 6),
        },
        "limits": limits.as_dict(),
        "queue_seconds": round(queue_seconds, 6),
        "start_seconds": None if outcome.start_seconds is None else round(outcome.start_seconds, 6),
        "backend": outcome.backend,
    }


MIN_TOKEN_LENGTH = 32


def load_token(path: str) -> str:
    """The shared secret in `path`, made (random, mode 0600) if the file does not exist."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(32) + "\n")
    with open(path) as handle:
        token = handle.read().strip()
    if len(token) < MIN_TOKEN_LENGTH:
        raise SystemExit(f"--token-file {path}: the token must be at least {MIN_TOKEN_LENGTH} characters")
    return token


def make_handler(runner: Runner, token: str):
    expected = f"Bearer {token}".encode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):
            pass

        def _authorised(self) -> bool:
            given = (self.headers.get("Authorization") or "").encode()
            if hmac.compare_digest(given, expected):
                return True
            self._send(401, {"error": "the runner answers the platform only (Authorization: Bearer <token>)"})
            return False

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/healthz":
                self._send(200, {"status": "ok", "backend": runner.backend.name, "slots": runner.slots.count})
            elif self.path == "/metrics":
                if not self._authorised():
                    return
                with runner.lock:
                    body = {
                        "executions": dict(runner.executions),
                        "running": len(runner.running),
                        "seconds_total": {k: round(v, 6) for k, v in runner.seconds.items()},
                        "slots": runner.slots.count,
                        "slots_free": len(runner.slots.free),
                    }
                self._send(200, body)
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self):
            if self.path != "/v1/executions":
                self._send(404, {"error": "not found"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            if not self._authorised():
                self.close_connection = True  # the body is not read
                return
            if length > MAX_BODY:
                self._send(413, {"error": f"the request is larger than {MAX_BODY} bytes", "field": "body"})
                return
            try:
                body = json.loads(self.rfile.read(length) or b"null")
                self._send(200, runner.run(body))
            except ValueError as exc:
                field = exc.field if isinstance(exc, BadRequest) else "body"
                self._send(400, {"error": str(exc), "field": field})
            except Busy as exc:
                self._send(503, {"error": str(exc)})

    return Handler


def make_backend(name: str, *, runtime: str, work_root: str, uid_base: int) -> Backend:
    if name == "bubblewrap":
        return Bubblewrap(runtime=runtime, work_root=work_root, uid_base=uid_base)
    if name == "gvisor":
        from sandbox.gvisor import Gvisor  # only a runner started for gVisor needs it

        return Gvisor(runtime=runtime, work_root=work_root, uid_base=uid_base)
    raise SystemExit(f"unknown backend {name!r}: bubblewrap or gvisor")


def serve(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sandbox.runner")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--backend", default="bubblewrap")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--runtime", default=os.path.join(root, "var", "sandbox-runtime"))
    parser.add_argument("--work-root", default="/tmp/agentsandbox")
    parser.add_argument("--uid-base", type=int, default=62000, help="slot n runs as this uid + n")
    parser.add_argument(
        "--token-file",
        default=os.path.join(root, "var", "sandbox-runner.token"),
        help="the shared secret the platform sends (created, mode 0600, when missing)",
    )
    parser.add_argument(
        "--check", action="store_true", help="say whether the backend can run here, and exit (0: it can)"
    )
    parser.add_argument("--slots", type=int, default=max(2, (os.cpu_count() or 1) * 2))
    parser.add_argument(
        "--tenant-share", type=float, default=0.5, help="fraction of the slots one tenant may hold"
    )
    parser.add_argument(
        "--cap",
        default="{}",
        help="the runner's ceiling on any request's limits, as JSON over the defaults "
        '(sandbox.limits.Limits names: \'{"memory_bytes": 4294967296, "wall_seconds": 120}\')',
    )
    args = parser.parse_args(argv)
    try:
        cap = Limits.from_dict(json.loads(args.cap))
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"--cap: {exc}") from None
    if args.host not in ("127.0.0.1", "::1", "localhost"):
        raise SystemExit("the runner listens on loopback only")
    backend = make_backend(
        args.backend, runtime=args.runtime, work_root=args.work_root, uid_base=args.uid_base
    )
    try:
        backend.check()
    except BackendUnavailable as exc:
        raise SystemExit(f"sandbox backend {args.backend} unavailable: {exc}") from None
    if args.check:
        print(f"sandbox backend {args.backend} available", flush=True)
        return
    token = load_token(args.token_file)
    backend.prepare()
    # SIGTERM (make serve's stop, a test's terminate) exits through atexit, which lets the
    # backend finish removing what the last executions left on the host
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    share = max(1, math.ceil(args.slots * args.tenant_share))
    runner = Runner(backend, slots=args.slots, tenant_share=share, cap=cap)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(runner, token))
    server.daemon_threads = True
    print(
        f"sandbox runner on http://{args.host}:{server.server_port} ({backend.name}, "
        f"{args.slots} slots, {share} per tenant)",
        flush=True,
    )
    server.serve_forever()


def main() -> None:
    # Whatever started us (make serve, a test, an operator's shell) may hold DATABASE_URL,
    # SECRET_KEY or a broker URL: start again with none of it before anything is read.
    if os.environ.get("SANDBOX_RUNNER_CLEAN") != "1":
        env = {"SANDBOX_RUNNER_CLEAN": "1", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root
        os.execve(sys.executable, [sys.executable, "-m", "sandbox.runner", *sys.argv[1:]], env)
    serve()


if __name__ == "__main__":
    main()
