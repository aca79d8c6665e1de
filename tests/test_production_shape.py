"""The production shape: scripts/serve.sh with uvicorn (ASGI), a worker, beat and Flower on PostgreSQL + Redis,
configured only by environment variables."""

from __future__ import annotations

import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import httpx
import psycopg
import pytest
from django.conf import settings

from tests.observability.conftest import parse, value
from tests.servers import ROOT, BankServer, database_url, wait_for
from tests.services import free_port
from tests.stream.sse import follow

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
  - {agent: looker, run: ["group:agents"]}
agents:
  - name: looker
    versions:
      - {model: scripted, instructions: Look it up., tools: [bank__lookup_transaction]}
    aliases: {prod: 1}
"""


METRICS_TOKEN = secrets.token_urlsafe(32)
# Each test migrates a fresh database before the stack answers: minutes on a loaded machine.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def prod_database():
    name = f"prodshape_{os.getpid()}"
    server = database_url().rsplit("/", 1)[0]  # the server the test database is on
    admin = f"{server}/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    yield f"{server}/{name}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'DROP DATABASE IF EXISTS "{name}_keys" WITH (FORCE)')  # the content key store


def test_it_serves_api_admin_worker_beat_and_flower_from_environment(prod_database, var_dir):
    tmp_path = var_dir
    bank = BankServer().start()
    port, flower_port, sandbox_port = free_port(), free_port(), free_port()
    from tenants.crypto import generate_key

    # TLS ends at a proxy in front of uvicorn; the test plays the proxy with X-Forwarded-Proto.
    env = dict(
        os.environ,
        AGENTPLATFORM_ENV="production",
        SECRET_KEY=secrets.token_urlsafe(50),
        SECURE_PROXY_SSL_HEADER="X-Forwarded-Proto",
        SECRET_ENCRYPTION_KEYS=generate_key(),
        DATABASE_URL=prod_database,
        CONTENT_KEYS_DATABASE_URL=f"{prod_database}_keys",
        CELERY_BROKER_URL=settings.CELERY_BROKER_URL,
        CELERY_QUEUE=f"prodshape-{os.getpid()}",
        BIND=f"127.0.0.1:{port}",
        FLOWER_PORT=str(flower_port),
        WORKER_CONCURRENCY="8",
        SWEEP_INTERVAL_SECONDS="1",
        QUEUED_TOO_LONG_SECONDS="2",
        AGENTPLATFORM_VAR_DIR=str(tmp_path),
        BANK_MCP_URL=bank.mcp_url,
        PY=str(ROOT / ".venv/bin/python"),
        METRICS_TOKEN=METRICS_TOKEN,
        ASSERTION_ISSUER="https://agents.prod-bank.example",
        PUBLIC_BASE_URL="https://agents.prod-bank.example",
        FLOWER_UNAUTHENTICATED_API="true",
        RUN_STREAM_HEARTBEAT_SECONDS="1",
        SANDBOX_RUNNER_PORT=str(sandbox_port),
        # Started as root, serve.sh runs every process but the sandbox runner as SERVE_USER, with
        # no SERVE_AS_ROOT: where the user cannot run this Python (under /root here) serve gives
        # it one it can (scripts/service_python.py).
        SERVE_USER=SERVICE_USER,
    )
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.pop("TEST_DATABASE_NAME", None)
    serve = subprocess.Popen(
        ["bash", "scripts/serve.sh"],
        cwd=ROOT,
        env=env,
        stdout=(tmp_path / "serve.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        http = httpx.Client(headers=PROXIED, timeout=60)  # a loaded machine hashes a password slowly
        # /healthz, not the schema: generating it can take longer than one probe waits on a loaded machine.
        wait_for(lambda: _ok(f"{base}/healthz"), timeout=420, what="uvicorn")
        wait_for(
            lambda: _ok(f"http://127.0.0.1:{sandbox_port}/healthz"), timeout=60, what="the sandbox runner"
        )
        assert httpx.get(f"{base}/v1/schema").status_code == 301  # plain HTTP is sent to HTTPS
        config = tmp_path / "prod.yaml"
        config.write_text(CONFIG)
        subprocess.run(
            [str(ROOT / ".venv/bin/python"), "manage.py", "apply", str(config)],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
        )
        token = http.post(
            f"{base}/v1/auth/token", json={"username": "pat", "password": "pat-password"}
        ).json()["token"]
        headers = {"Authorization": f"Token {token}"}
        run = http.post(
            f"{base}/v1/runs", json={"agent": "looker", "input": {"q": "TXN-1001"}}, headers=headers
        )
        assert run.status_code == 201, run.text
        run_id = run.json()["id"]
        done = wait_for(
            lambda: (
                (r := http.get(f"{base}/v1/runs/{run_id}", headers=headers).json())["status"]
                in ("succeeded", "failed", "stopped")
                and r
            ),
            timeout=90,
            what="run end",
        )
        assert done["status"] == "succeeded", done
        # The run's live stream (ASGI): every event as /events shows it, then the end.
        stream = follow(
            http, f"{base}/v1/runs/{run_id}/stream", headers={"Authorization": f"Bearer {token}"}, seconds=60
        )
        assert stream.status == 200 and stream.content_type == "text/event-stream"
        assert [m.data for m in stream.events] == http.get(
            f"{base}/v1/runs/{run_id}/events", headers=headers
        ).json()
        assert stream.end is not None and stream.end.data["status"] == "succeeded", [
            m.data for m in stream.messages
        ]
        steps = http.get(f"{base}/v1/runs/{run_id}/steps", headers=headers).json()
        assert [(s["kind"], s["status"]) for s in steps] == [
            ("model", "succeeded"),
            ("tool", "succeeded"),
            ("model", "succeeded"),
        ]
        assert "TXN-1001" in steps[1]["observation"]
        # The start-up output ends with where everything is and how to begin.
        log = wait_for(
            lambda: (
                "== agent platform started (ready)" in (text := (tmp_path / "serve.log").read_text()) and text
            ),
            timeout=60,
            what="start-up banner",
        )
        banner = log[log.index("== agent platform started") :]
        for needle in (
            f"{base}/v1/docs",
            f"{base}/admin/",
            f"{base}/healthz",
            f"{base}/metrics",
            f"http://127.0.0.1:{flower_port}/",
            "manage.py createsuperuser",
            "manage.py apply",
            "run_python: on (bubblewrap)",
        ):
            assert needle in banner, banner
        # The sandbox runner answers the platform's token only (serve.sh made it and handed it over).
        runner = f"http://127.0.0.1:{sandbox_port}"
        assert (
            httpx.post(f"{runner}/v1/executions", json={"key": "k", "tenant": "t", "code": ""}).status_code
            == 401
        )
        token_file = tmp_path / "sandbox-runner.token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        assert (
            httpx.get(
                f"{runner}/metrics", headers={"Authorization": f"Bearer {token_file.read_text().strip()}"}
            ).status_code
            == 200
        )
        # Nothing but the sandbox runner runs as root: the worker that ran the step above, uvicorn,
        # beat and Flower are the service user's processes, with no capabilities.
        processes = _session_processes(serve.pid)
        for name, marker in SERVICES.items():
            mine = [p for p in processes if marker in p["args"]]
            assert mine, (name, processes)
            assert {(p["uid"], p["caps"]) for p in mine} == {(SERVICE_UID, "0000000000000000")}, (name, mine)
        runners = [p for p in processes if "sandbox.runner" in p["args"]]
        assert runners and {p["uid"] for p in runners} == {0}
        assert "runs the services with" in (tmp_path / "serve.log").read_text()
        assert httpx.get(f"{base}/healthz").json() == {"status": "ok"}
        assert httpx.get(f"{base}/readyz").json()["status"] == "ready"
        # Counters from the worker process and gauges from the database, through uvicorn.
        assert httpx.get(f"{base}/metrics").status_code == 401
        metrics = httpx.get(
            f"{base}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=60
        )
        assert metrics.status_code == 200
        samples = parse(metrics.text)
        assert value(samples, "agentplatform_steps_total", kind="model", tool="", outcome="succeeded") == 2
        assert (
            value(
                samples,
                "agentplatform_steps_total",
                kind="tool",
                tool="bank__lookup_transaction",
                outcome="succeeded",
            )
            == 1
        )
        assert value(samples, "agentplatform_runs", tenant="prod-bank", status="running") == 0
        assert value(samples, "agentplatform_broker_up") == 1
        # Beat runs the sweeper: a run whose message never reached the broker still finishes.
        with psycopg.connect(prod_database, autocommit=True) as conn:
            conn.execute(
                "UPDATE runs_run SET status='queued', finished_at=NULL, last_enqueued_at=NULL, "
                "started_at=NULL WHERE id=%s",
                (run_id,),
            )
            conn.execute("UPDATE budgets_reservation SET step_id=NULL WHERE run_id=%s", (run_id,))
            conn.execute("DELETE FROM runs_step WHERE run_id=%s", (run_id,))
        again = wait_for(
            lambda: (
                (r := http.get(f"{base}/v1/runs/{run_id}", headers=headers).json())["status"] == "succeeded"
                and r
            ),
            timeout=60,
            what="sweeper recovery",
        )
        events = http.get(f"{base}/v1/runs/{run_id}/events", headers=headers).json()
        assert any(e["kind"] == "recovery" for e in events), events
        assert again["status"] == "succeeded"
        assert http.get(f"{base}/admin/login/").status_code == 200
        assert http.get(f"{base}/static/admin/css/base.css").status_code == 200
        wait_for(lambda: _ok(f"http://127.0.0.1:{flower_port}/"), timeout=60, what="flower")
        # A run while Flower is surely listening (the first may have ended before it connected).
        seen = http.post(
            f"{base}/v1/runs", json={"agent": "looker", "input": {"q": "TXN-1002"}}, headers=headers
        )
        assert seen.status_code == 201, seen.text
        live = follow(http, f"{base}/v1/runs/{seen.json()['id']}/stream", headers=headers, seconds=90)
        assert live.end is not None, (
            http.get(f"{base}/v1/runs/{seen.json()['id']}", headers=headers).json(),
            [m.data for m in live.events],
        )
        assert live.end.data["status"] == "succeeded" and [m.id for m in live.events] == list(
            range(1, len(live.events) + 1)
        )
        wait_for(
            lambda: (
                http.get(f"{base}/v1/runs/{seen.json()['id']}", headers=headers).json()["status"]
                == "succeeded"
            ),
            timeout=60,
            what="a run Flower sees",
        )
        # Flower lists the engine's steps with what each did; the sweeper's passes stay out of it.
        tasks = wait_for(
            lambda: (
                (t := httpx.get(f"http://127.0.0.1:{flower_port}/api/tasks", timeout=10).json())
                and all(task["state"] == "SUCCESS" for task in t.values())
                and t
            ),
            timeout=30,
            what="flower tasks",
        )
        assert {task["name"] for task in tasks.values()} == {"runs.tasks.advance_run"}, tasks
        assert any(
            "'kind': 'tool', 'tool': 'bank__lookup_transaction', 'outcome': 'succeeded'" in task["result"]
            for task in tasks.values()
        ), tasks
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
        bank.stop()
        print(Path(tmp_path / "serve.log").read_text()[-3000:])


def test_without_the_sandbox_runtime_it_serves_without_run_python_and_says_so(prod_database, var_dir):
    tmp_path = var_dir
    # The runner once started anyway, exited ("backend unavailable") and took the whole stack down
    # about 40 s after "ready". Now it is checked first and left out, and the rest serves.
    port, flower_port, sandbox_port = free_port(), free_port(), free_port()
    from tenants.crypto import generate_key

    env = dict(
        os.environ,
        AGENTPLATFORM_ENV="production",
        SECRET_KEY=secrets.token_urlsafe(50),
        SECURE_PROXY_SSL_HEADER="X-Forwarded-Proto",
        SECRET_ENCRYPTION_KEYS=generate_key(),
        DATABASE_URL=prod_database,
        CONTENT_KEYS_DATABASE_URL=f"{prod_database}_keys",
        CELERY_BROKER_URL=settings.CELERY_BROKER_URL,
        CELERY_QUEUE=f"prodshape-bare-{os.getpid()}",
        BIND=f"127.0.0.1:{port}",
        FLOWER_PORT=str(flower_port),
        WORKER_CONCURRENCY="2",
        AGENTPLATFORM_VAR_DIR=str(tmp_path),
        PY=str(ROOT / ".venv/bin/python"),
        METRICS_TOKEN=METRICS_TOKEN,
        ASSERTION_ISSUER="https://agents.prod-bank.example",
        PUBLIC_BASE_URL="https://agents.prod-bank.example",
        SANDBOX_RUNNER_PORT=str(sandbox_port),
        SANDBOX_RUNTIME=str(tmp_path / "no-runtime-here"),
        SERVE_USER=SERVICE_USER,
    )
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.pop("TEST_DATABASE_NAME", None)
    serve = subprocess.Popen(
        ["bash", "scripts/serve.sh"],
        cwd=ROOT,
        env=env,
        stdout=(tmp_path / "serve.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        log = wait_for(
            lambda: (
                "== agent platform started (ready)" in (text := (tmp_path / "serve.log").read_text()) and text
            ),
            timeout=600,
            what="start-up banner",
        )
        assert (
            "sandbox runner not started, serving without run_python: sandbox backend bubblewrap unavailable"
            in log
        )
        assert "run_python: off: sandbox backend bubblewrap unavailable" in log
        assert serve.poll() is None
        assert httpx.get(f"http://127.0.0.1:{port}/readyz").json()["status"] == "ready"
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{sandbox_port}/healthz", timeout=2)
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
        print(Path(tmp_path / "serve.log").read_text()[-3000:])


PROXIED = {"X-Forwarded-Proto": "https"}
# Started as root, serve drops to `nobody` (it exists everywhere, so no user is created here).
SERVICE_USER = "nobody" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
SERVICE_UID = pwd.getpwnam(SERVICE_USER).pw_uid
SERVICES = {
    "web": "uvicorn agentplatform.asgi:application",
    "worker": "celery -A agentplatform worker",
    "beat": "celery -A agentplatform beat",
    "flower": "celery -A agentplatform flower",
}


@pytest.fixture
def var_dir():
    """A var directory the service user can reach (pytest's tmp_path is under a root-only 0700)."""
    path = Path(tempfile.mkdtemp(prefix="prodshape-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _session_processes(session: int) -> list[dict]:
    """Each process of serve's session: its real uid, effective capabilities and command line."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) != session:
                continue
            status = dict(
                line.split(":\t", 1) for line in (entry / "status").read_text().splitlines() if ":\t" in line
            )
            args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
        found.append({"uid": int(status["Uid"].split()[0]), "caps": status["CapEff"], "args": args})
    return found


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5, headers=PROXIED).status_code == 200
    except httpx.HTTPError:
        return False


def test_every_variable_serve_sh_reads_is_in_the_environment_doc():
    script = (ROOT / "scripts" / "serve.sh").read_text()
    readme = (ROOT / "README.md").read_text() + (ROOT / "docs" / "environment.md").read_text()
    names = set(re.findall(r"\$\{([A-Z_]+):-", script))
    assert {
        "PY",
        "BIND",
        "FLOWER_PORT",
        "WORKER_CONCURRENCY",
        "WEB_WORKERS",
        "AGENTPLATFORM_VAR_DIR",
    } <= names
    assert not [name for name in names if f"`{name}`" not in readme]
    concurrency = re.search(r"WORKER_CONCURRENCY:-(\d+)", script).group(1)
    assert f"-c {concurrency}" in readme and f"`WORKER_CONCURRENCY` | `{concurrency}`" in readme
