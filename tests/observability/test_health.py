"""/healthz and /readyz in a process of their own, pointed at a dead database and then a dead
broker (closed local ports): nothing on the machine is stopped."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from django.test import Client

from tests.servers import ROOT, process_env

PROBE = """
import json, time, django
django.setup()
from django.test import Client
out = {}
for path in ("/healthz", "/readyz"):
    started = time.monotonic()
    response = Client().get(path)
    out[path] = {"status": response.status_code, "body": response.json(), "seconds": time.monotonic() - started}
print(json.dumps(out))
"""


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nobody listens once it is closed


def probe(**env: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**process_env(READY_TIMEOUT_SECONDS="2"), **env},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.django_db(transaction=True)
def test_ready_when_database_migrations_and_broker_answer():
    result = probe()
    assert result["/healthz"] == {
        "status": 200,
        "body": {"status": "ok"},
        "seconds": result["/healthz"]["seconds"],
    }
    assert result["/readyz"]["status"] == 200, result
    assert result["/readyz"]["body"] == {
        "status": "ready",
        "checks": {"database": "ok", "migrations": "ok", "broker": "ok"},
    }


@pytest.mark.django_db(transaction=True)
def test_not_ready_with_the_database_unreachable_but_alive():
    result = probe(DATABASE_URL=f"postgres://root@127.0.0.1:{closed_port()}/nowhere")
    assert result["/healthz"]["status"] == 200
    ready = result["/readyz"]
    assert ready["status"] == 503, ready
    checks = ready["body"]["checks"]
    assert checks["database"].startswith("OperationalError") and "refused" in checks["database"], checks
    assert checks["migrations"] == "unknown: database unreachable"
    assert checks["broker"] == "ok"
    assert ready["seconds"] < 5


@pytest.mark.django_db(transaction=True)
def test_not_ready_with_the_broker_unreachable():
    result = probe(CELERY_BROKER_URL=f"redis://127.0.0.1:{closed_port()}/0")
    assert result["/healthz"]["status"] == 200
    ready = result["/readyz"]
    assert ready["status"] == 503, ready
    checks = ready["body"]["checks"]
    assert checks["database"] == "ok" and checks["migrations"] == "ok"
    assert "refused" in checks["broker"].lower(), checks
    assert ready["seconds"] < 5


@pytest.mark.django_db(transaction=True)
def test_metrics_still_answer_with_the_broker_unreachable():
    script = (
        "import django; django.setup(); from django.test import Client; "
        "r = Client().get('/metrics'); print(r.status_code); print(r.content.decode())"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **process_env(READY_TIMEOUT_SECONDS="2"),
            "CELERY_BROKER_URL": f"redis://127.0.0.1:{closed_port()}/0",
        },
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("200\n")
    assert "agentplatform_broker_up 0.0" in done.stdout and "agentplatform_database_up 1.0" in done.stdout


def test_readiness_reports_unapplied_migrations(db):
    from observability import health

    applied = health.check_database()
    with pytest.raises(health.CheckFailed, match=r"1 migration\(s\) not applied, first runs\."):
        health._migrations_applied = False
        health.check_migrations({m for m in applied if m != max(m for m in applied if m[0] == "runs")})
    health.check_migrations(applied)
    assert Client().get("/healthz").status_code == 200
