"""Fixtures for the sandbox contract suite: a backend per test session, and a runner process.

Every test runs once per backend: bubblewrap, and gVisor where runsc is installed.
SANDBOX_CONTRACT_WEAKEN=network,seccomp (names from sandbox.backends.WEAKEN) builds the backend
with those walls off: run that way, the tests of those walls must fail. It exists to show that
each test can fail, and is never set by `make test`.
"""

from __future__ import annotations

import os
import shutil

import pytest

from sandbox.backends import Bubblewrap, Execution
from sandbox.limits import Limits
from tests.sandbox_runner import RUNTIME, Runner, uid_base


def weakened() -> frozenset[str]:
    return frozenset(w for w in os.environ.get("SANDBOX_CONTRACT_WEAKEN", "").split(",") if w)


def _backends():
    """bubblewrap always; gVisor where runsc is installed (scripts/ensure_sandbox.sh tries to),
    unless SANDBOX_CONTRACT_GVISOR=0."""
    yield "bubblewrap"
    if shutil.which("runsc") and os.environ.get("SANDBOX_CONTRACT_GVISOR") != "0" and not weakened():
        yield "gvisor"


@pytest.fixture(scope="session", params=list(_backends()))
def backend(request):
    if request.param == "gvisor":
        from sandbox.gvisor import Gvisor

        chosen = Gvisor(runtime=str(RUNTIME), uid_base=uid_base())
    else:
        chosen = Bubblewrap(runtime=str(RUNTIME), weaken=weakened(), uid_base=uid_base())
    chosen.check()
    chosen.prepare()  # as sandbox.runner does before its first execution
    return chosen


@pytest.fixture
def run(backend):
    """run(code, inputs=None, slot=0, **limits) -> Outcome, with test-sized limits."""

    def run(code: str, *, inputs: dict | None = None, slot: int = 0, **limits):
        defaults = {"wall_seconds": 10, "cpu_seconds": 5, "memory_bytes": 256 << 20}
        execution = Execution(code=code, inputs=inputs or {}, limits=Limits(**(defaults | limits)))
        return backend.execute(execution, slot=slot)

    return run


@pytest.fixture
def runner_url():
    """A runner process (python -m sandbox.runner) with 4 slots, 2 per tenant, started from an
    environment that holds a database URL and a secret key (which it must drop)."""
    env = dict(
        os.environ,
        DATABASE_URL=os.environ.get("DATABASE_URL", "postgres://canary"),
        SECRET_KEY="canary-secret",
    )
    runner = Runner(slots=4, share=0.5, env=env).start()
    yield runner.url, runner.proc.pid
    runner.stop()
