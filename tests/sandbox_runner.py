"""A sandbox runner process for tests (python -m sandbox.runner on a free port), and a local HTTP
tool server that answers CSV files, the kind of tool whose answer becomes an artifact."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ROOT / "var" / "sandbox-runtime"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def uid_base() -> int:
    """Ten slot uids of this test process's own (the backend's four, then a runner's four):
    pytest-xdist workers and other sessions run sandboxes at once, and RLIMIT_NPROC and the
    orphan checks count per uid across the host."""
    return 62000 + (os.getpid() % 300) * 10


# The shared secret every test runner answers to (sandbox/runner.py): tests send AUTH, and point the
# platform at it with settings.SANDBOX_RUNNER_TOKEN = TOKEN.
TOKEN = secrets.token_urlsafe(32)
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Runner:
    def __init__(self, *, slots: int = 4, share: float = 0.5, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token_file = Path(tempfile.mkdtemp(prefix="runner-token-")) / "token"
        self.token_file.write_text(TOKEN)
        self.token_file.chmod(0o600)
        self.args = [
            sys.executable, "-m", "sandbox.runner", "--port", str(self.port), "--slots", str(slots),
            "--tenant-share", str(share), "--runtime", str(RUNTIME), "--uid-base", str(uid_base() + 4),
            "--token-file", str(self.token_file),
        ]  # fmt: skip
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 20) -> Runner:
        self.proc = subprocess.Popen(
            self.args, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the sandbox runner did not start: {self.proc.stdout.read().decode()}")
            time.sleep(0.05)

    def metrics(self) -> dict:
        return httpx.get(self.url + "/metrics", headers=AUTH, timeout=5).json()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        shutil.rmtree(self.token_file.parent, ignore_errors=True)


class FileToolServer:
    """POST /<name> answers files[name] as text/csv with a file name; counts the calls."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.calls: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                name = self.path.strip("/")
                server.calls.append(name)
                body = server.files.get(name)
                if body is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/csv; charset=utf-8")
                self.send_header("Content-Disposition", f'attachment; filename="{name}.csv"')
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"

    def start(self) -> FileToolServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def make_data():
    """The example bank's exports (examples/bank_server.py): 30,000 card transactions and the
    ledger as CSV, the true counts of duplicates, missing entries and mismatches, the missing ids."""
    from examples.bank_server import reconciliation_exports  # the MCP SDK it imports takes seconds

    return reconciliation_exports()
