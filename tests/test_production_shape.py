"""The production shape: scripts/serve.sh with gunicorn, a worker, beat and Flower on PostgreSQL + Redis,
configured only by environment variables."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import httpx
import psycopg
import pytest
from django.conf import settings

from tests.servers import ROOT, BankServer, database_url, wait_for

CONFIG = """
tenant: {slug: prod-bank, name: Prod Bank, time_zone: Europe/London, daily_budget: 5.0}
groups: [{name: agents}]
users:
  - {username: pat, password: pat-password, groups: [agents]}
model_endpoints:
  - name: scripted
    kind: scripted
    prices: {input: 1.0, output: 2.0}
    config:
      turns:
        - tool_calls: [{name: bank__lookup_transaction, arguments: {transaction_id: TXN-1001}}]
        - text: found it
tool_servers:
  - {name: bank, kind: mcp, transport: streamable_http, url: "${BANK_MCP_URL}", discover: true}
tools:
  - {server: bank, name: lookup_transaction, enabled: true, effect: read_only, approval: never}
grants:
  - {tool: bank__lookup_transaction, use: ["group:agents"]}
agents:
  - name: looker
    versions:
      - {model: scripted, instructions: Look it up., tools: [bank__lookup_transaction]}
    aliases: {prod: 1}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prod_database():
    name = f"prodshape_{os.getpid()}"
    server = database_url().rsplit("/", 1)[0]          # the server the test database is on
    admin = f"{server}/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    yield f"{server}/{name}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_it_serves_api_admin_worker_beat_and_flower_from_environment(prod_database, tmp_path):
    bank = BankServer().start()
    port, flower_port = _free_port(), _free_port()
    from tenants.crypto import generate_key
    env = dict(os.environ, AGENTPLATFORM_ENV="production", SECRET_KEY="x" * 50,
               SECRET_ENCRYPTION_KEYS=generate_key(), DATABASE_URL=prod_database,
               CELERY_BROKER_URL=settings.CELERY_BROKER_URL, CELERY_QUEUE=f"prodshape-{os.getpid()}",
               BIND=f"127.0.0.1:{port}", FLOWER_PORT=str(flower_port), WORKER_CONCURRENCY="8",
               SWEEP_INTERVAL_SECONDS="1", QUEUED_TOO_LONG_SECONDS="2", VAR_DIR=str(tmp_path),
               AGENTPLATFORM_VAR_DIR=str(tmp_path), BANK_MCP_URL=bank.mcp_url, PY=str(ROOT / ".venv/bin/python"))
    env.pop("TEST_DATABASE_NAME", None)
    serve = subprocess.Popen(["bash", "scripts/serve.sh"], cwd=ROOT, env=env, stdout=(tmp_path / "serve.log").open("w"),
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _ok(f"{base}/v1/schema"), timeout=120, what="gunicorn")
        config = tmp_path / "prod.yaml"
        config.write_text(CONFIG)
        subprocess.run([str(ROOT / ".venv/bin/python"), "manage.py", "apply", str(config)], cwd=ROOT, env=env,
                       check=True, capture_output=True)
        token = httpx.post(f"{base}/v1/auth/token", json={"username": "pat", "password": "pat-password"}).json()["token"]
        headers = {"Authorization": f"Token {token}"}
        run = httpx.post(f"{base}/v1/runs", json={"agent": "looker", "input": {"q": "TXN-1001"}}, headers=headers)
        assert run.status_code == 201, run.text
        run_id = run.json()["id"]
        done = wait_for(lambda: (r := httpx.get(f"{base}/v1/runs/{run_id}", headers=headers).json())["status"]
                        in ("succeeded", "failed", "stopped") and r, timeout=90, what="run end")
        assert done["status"] == "succeeded", done
        steps = httpx.get(f"{base}/v1/runs/{run_id}/steps", headers=headers).json()
        assert [(s["kind"], s["status"]) for s in steps] == [("model", "succeeded"), ("tool", "succeeded"),
                                                            ("model", "succeeded")]
        assert "TXN-1001" in steps[1]["observation"]
        # Beat runs the sweeper: a run whose message never reached the broker still finishes.
        with psycopg.connect(prod_database, autocommit=True) as conn:
            conn.execute("UPDATE runs_run SET status='queued', finished_at=NULL, last_enqueued_at=NULL, "
                         "started_at=NULL WHERE id=%s", (run_id,))
            conn.execute("UPDATE budgets_reservation SET step_id=NULL WHERE run_id=%s", (run_id,))
            conn.execute("DELETE FROM runs_step WHERE run_id=%s", (run_id,))
        again = wait_for(lambda: (r := httpx.get(f"{base}/v1/runs/{run_id}", headers=headers).json())["status"]
                         == "succeeded" and r, timeout=60, what="sweeper recovery")
        events = httpx.get(f"{base}/v1/runs/{run_id}/events", headers=headers).json()
        assert any(e["kind"] == "recovery" for e in events), events
        assert again["status"] == "succeeded"
        assert httpx.get(f"{base}/admin/login/").status_code == 200
        assert httpx.get(f"{base}/static/admin/css/base.css").status_code == 200
        wait_for(lambda: _ok(f"http://127.0.0.1:{flower_port}/"), timeout=60, what="flower")
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
        bank.stop()
        print(Path(tmp_path / "serve.log").read_text()[-3000:])


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
