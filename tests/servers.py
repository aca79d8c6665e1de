"""Processes the end-to-end tests run: Celery workers, the example bank server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from django.conf import settings
from django.db import connection

ROOT = Path(__file__).resolve().parent.parent


def database_url() -> str:
    """The URL of the database the tests use right now (pytest-django's test database)."""
    s = connection.settings_dict
    return f"postgres://{s['USER'] or 'root'}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


def process_env(**extra: str) -> dict:
    env = dict(os.environ)
    env.update(
        DATABASE_URL=database_url(),
        CELERY_BROKER_URL=settings.CELERY_BROKER_URL,
        CELERY_QUEUE=settings.CELERY_TASK_DEFAULT_QUEUE,
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


# As in production (scripts/serve.sh): the design uses none of these consumer steps.
WITHOUT_STEPS = ("gossip", "mingle", "heartbeat")


class Worker:
    """A real `celery worker` process consuming the runs queue."""

    def __init__(self, name: str, *, concurrency: int = 4, pool: str = "threads", env: dict | None = None):
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"worker-{name}-", suffix=".log", delete=False)
        self.args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "agentplatform",
            "worker",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-Q",
            settings.CELERY_TASK_DEFAULT_QUEUE,
            "-n",
            f"{name}@%h",
            "--loglevel",
            "INFO",
            *(f"--without-{step}" for step in WITHOUT_STEPS),
        ]
        self.env = process_env(**(env or {}))
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> Worker:
        """Start the process and wait until Celery says it is ready. A worker that does not get
        ready in time is stopped before the error is raised: left running, it would consume the
        queue of every later test on this pytest process."""
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> Worker:
        self.log.truncate(0)
        self.proc = subprocess.Popen(
            self.args, cwd=ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if b" ready." in Path(self.log.name).read_bytes():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited: {Path(self.log.name).read_text()[-3000:]}")
            time.sleep(0.1)
        raise RuntimeError(f"worker not ready: {Path(self.log.name).read_text()[-3000:]}")

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL: no cleanup, no acks — like a machine losing power."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")


class BankServer:
    """examples/bank_server.py in its own process; counts the effects it applied."""

    def __init__(self, label: str = "bank", *extra: str):
        self.label = label
        self.extra = list(extra)
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout: float = 30) -> BankServer:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "examples" / "bank_server.py"),
                "--port",
                "0",
                "--label",
                self.label,
                *self.extra,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("BANK_SERVER_READY"):
                self.url = line.split()[1]
                return self
            if self.proc.poll() is not None:
                break
        raise RuntimeError("bank server did not start")

    @property
    def mcp_url(self) -> str:
        return f"{self.url}/mcp"

    def effects(self, tool: str | None = None) -> list[dict]:
        effects = httpx.get(f"{self.url}/ledger", timeout=10).json()["effects"]
        return [e for e in effects if tool is None or e["tool"] == tool]

    def fault(self, **spec) -> None:
        httpx.post(f"{self.url}/faults", json=spec, timeout=10).raise_for_status()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def wait_for(predicate, *, timeout: float = 60, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
