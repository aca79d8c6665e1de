"""The chaos run, short: 20 runs through the API for 30 s of kills, a stall, a Redis restart, two
PostgreSQL restarts (of the run's own throwaway servers) and provider faults, with a payment gateway
that applies every POST and lags behind its answers (bench/chaos.py; `make chaos` runs the long
version). It exits non-zero when a target is missed: a duplicate effect, a known outcome that
became unknown, no late attempt fenced out, an effect the step log disagrees with, a reservation
left open, a run stuck neither finished nor waiting for a person."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.mark.timeout(600)
def test_it_keeps_every_guarantee_under_chaos():
    env = {k: v for k, v in os.environ.items() if k not in ("CELERY_QUEUE", "TEST_DATABASE_NAME")}
    finished = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "chaos.py"),
            "--runs",
            "20",
            "--seconds",
            "30",
            "--settle-seconds",
            "150",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=580,
    )
    report = finished.stdout[finished.stdout.find("chaos run:") :]
    print(report)
    assert finished.returncode == 0, f"{report}\n{finished.stdout[-4000:]}\n{finished.stderr[-4000:]}"
    assert "result: PASS" in report
