"""Fixtures for the sandbox contract suite: a backend per test session, and a runner process.

SANDBOX_CONTRACT_WEAKEN=network,seccomp (names from sandbox.backends.WEAKEN) builds the backend
with those walls off: run that way, the tests of those walls must fail. It exists to show that
each test can fail, and is never set by `make test`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from sandbox.backends import Bubblewrap, Execution
from sandbox.limits import Limits

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "var" / "sandbox-runtime"


def weakened() -> frozenset[str]:
    return frozenset(w for w in os.environ.get("SANDBOX_CONTRACT_WEAKEN", "").split(",") if w)


def _backends():
    yield "bubblewrap"
    if os.environ.get("SANDBOX_CONTRACT_GVISOR") == "1":
        yield "gvisor"


@pytest.fixture(scope="session", params=list(_backends()))
def backend(request):
    if request.param == "gvisor":
        from sandbox.gvisor import Gvisor

        chosen = Gvisor(runtime=str(RUNTIME))
    else:
        chosen = Bubblewrap(runtime=str(RUNTIME), weaken=weakened())
    chosen.check()
    return chosen


@pytest.fixture
def run(backend):
    """run(code, inputs=None, slot=0, **limits) -> Outcome, with test-sized limits."""

    def run(code: str, *, inputs: dict | None = None, slot: int = 0, **limits):
        defaults = {"wall_seconds": 10, "cpu_seconds": 5, "memory_bytes": 256 << 20}
        execution = Execution(code=code, inputs=inputs or {}, limits=Limits(**(defaults | limits)))
        return backend.execute(execution, slot=slot)

    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def runner_url(tmp_path):
    """A runner process (python -m sandbox.runner) with 4 slots, 2 per tenant."""
    port = free_port()
    env = dict(
        os.environ,
        DATABASE_URL=os.environ.get("DATABASE_URL", "postgres://canary"),
        SECRET_KEY="canary-secret",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandbox.runner", "--port", str(port), "--slots", "4", "--tenant-share", "0.5",
         "--runtime", str(RUNTIME)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the runner did not start: {proc.stdout.read().decode()}")
        time.sleep(0.05)
    yield url, proc.pid
    proc.terminate()
    proc.wait(10)
