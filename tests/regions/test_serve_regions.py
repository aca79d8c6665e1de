"""`make serve-regions` (scripts/serve_regions.sh, docs/regions.md "How to operate it"), seen from
outside: two regions on one machine, each its own PostgreSQL cluster, Redis and serve.sh, every
port free and everything under a temporary folder (the machine's PostgreSQL, Redis and RabbitMQ are
never touched).

The tenant, its people and grants are applied at the home (Mumbai) and reach Frankfurt by logical
replication; Frankfurt's own model endpoint, tool and agent are applied there. A run started
through Frankfurt's API spends from a slice the home granted (both statuses show it); the link is
cut and Frankfurt's status shows it down, healed and up again; TERM stops everything.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from tests.servers import ROOT
from tests.services import ThrowawayPostgres, free_port

# Two fresh databases migrated at once on a loaded machine take minutes, as in the production-shape test.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PY = str(ROOT / ".venv/bin/python")
HOME, AWAY = "mumbai", "frankfurt"
PORTS = (
    "HOME_API_PORT",
    "AWAY_API_PORT",
    "HOME_FLOWER_PORT",
    "AWAY_FLOWER_PORT",
    "HOME_SANDBOX_PORT",
    "AWAY_SANDBOX_PORT",
    "HOME_PG_PORT",
    "AWAY_PG_PORT",
    "HOME_REDIS_PORT",
    "AWAY_REDIS_PORT",
    "LINK_API_PORT",
    "LINK_PG_PORT",
)
# Started as root, serve.sh drops to `nobody` (as in tests/test_production_shape.py).
SERVICE_USER = "nobody" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name

# The agent's rows (endpoint, tool, agent) are applied in each region, in the same order, so their
# ids agree: the grants written at home name them by id (docs/regions.md, "State of the build").
LOCAL = """
model_endpoints:
  - name: scripted
    kind: scripted
    prices: {input: 1.0, output: 2.0}
    config:
      turns:
        - tool_calls: [{name: platform__echo, arguments: {said: hello}}]
        - text: echoed
tool_servers:
  - {name: platform, kind: builtin}
tools:
  - {server: platform, name: echo, enabled: true, effect: read_only, approval: never}
agents:
  - name: echoer
    versions:
      - {model: scripted, instructions: Echo it., tools: [platform__echo]}
    aliases: {prod: 1}
"""
AT_HOME = (
    """
tenant:
  slug: two-regions
  name: Two Regions
  time_zone: Asia/Kolkata
  daily_budget: 5.0
  regions: {home: mumbai, allowed: [mumbai, frankfurt], revocation_reach: 60}
groups:
  - {name: desk, roles: [supervisor]}
users:
  - {username: pat, password: pat-password, groups: [desk]}
grants:
  - {tool: platform__echo, use: ["group:desk"]}
  - {agent: echoer, run: ["group:desk"]}
"""
    + LOCAL
)
AT_FRANKFURT = "tenant: {slug: two-regions}\n" + LOCAL


@pytest.fixture
def var_dir():
    """A var directory the service user and PostgreSQL's user can reach (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="serve-regions-"))
    path.chmod(0o755)
    yield path
    _kill_leftovers(path)
    shutil.rmtree(path, ignore_errors=True)


def _kill_leftovers(path: Path) -> None:
    """Whatever the script left running (it should leave nothing): processes started with this
    folder in their command line or environment, and the clusters' postmasters."""
    for data in path.glob("regions/*/pg"):
        subprocess.run(
            ["runuser", "-u", "postgres", "--"] * (os.geteuid() == 0)
            + [f"{_pg_bin()}/pg_ctl", "-D", str(data), "-m", "immediate", "stop"],
            capture_output=True,
        )
    marker = str(path).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "cmdline").read_bytes() or marker in (entry / "environ").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def _pg_bin() -> str:
    return str(ThrowawayPostgres.binaries())


def _region_env(var: Path, region: str) -> dict[str, str]:
    """The environment of manage.py against one region: the file the script wrote for operators."""
    pairs = (line.split("=", 1) for line in (var / "regions" / region / "env").read_text().splitlines())
    return {**_base_env(), **dict(pairs)}


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    # The suite's own services: each region gets its own from the script.
    for name in (
        "DATABASE_URL",
        "CELERY_BROKER_URL",
        "CACHE_URL",
        "PROMETHEUS_MULTIPROC_DIR",
        "TEST_DATABASE_NAME",
    ):
        env.pop(name, None)
    return env


def _manage(var: Path, region: str, *args: str) -> str:
    done = subprocess.run(
        [PY, "manage.py", *args], cwd=ROOT, env=_region_env(var, region), capture_output=True, text=True
    )
    assert done.returncode == 0, (args, done.stdout[-3000:], done.stderr[-3000:])
    return done.stdout


def _until(predicate, *, timeout: float, what: str, script: subprocess.Popen, log: Path):
    """predicate()'s first truthy value; fails at once if the script has exited."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if script.poll() is not None:
            raise AssertionError(
                f"serve_regions.sh exited ({script.returncode}) waiting for {what}: {_tail(log)}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}: {_tail(log)}")
        time.sleep(0.5)


def _tail(log: Path) -> str:
    lines = [
        line
        for line in log.read_text(errors="replace").splitlines()
        if "celery.app.trace" not in line and "celery.worker.strategy" not in line
    ]
    return "\n".join(lines[-60:])


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _token(base: str) -> dict[str, str]:
    # A loaded machine hashes a password slowly.
    answer = httpx.post(
        f"{base}/v1/auth/token", json={"username": "pat", "password": "pat-password"}, timeout=60
    )
    assert answer.status_code == 200, answer.text
    return {"Authorization": f"Bearer {answer.json()['token']}"}


def _status(base: str, headers: dict) -> dict:
    answer = httpx.get(f"{base}/v1/regions/status", headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _scalar(url: str, sql: str):
    with psycopg.connect(url.replace("postgres://", "postgresql://", 1), autocommit=True) as conn:
        row = conn.execute(sql).fetchone()
    return row[0] if row else None


def test_two_regions_replicate_lend_a_slice_and_survive_a_cut_link(var_dir):
    ports: dict[str, str] = {}
    while len(set(ports.values())) < len(PORTS):
        ports = {name: str(free_port()) for name in PORTS}
    env = {
        **_base_env(),
        **ports,
        "AGENTPLATFORM_VAR_DIR": str(var_dir),
        "PY": PY,
        "SERVE_USER": SERVICE_USER,
        "WORKER_CONCURRENCY": "8",
        "WEB_WORKERS": "1",
        "START_TIMEOUT": "1200",
    }
    log = var_dir / "serve-regions.log"
    script = subprocess.Popen(
        ["bash", "scripts/serve_regions.sh"],
        cwd=ROOT,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    home = f"http://127.0.0.1:{ports['HOME_API_PORT']}"
    away = f"http://127.0.0.1:{ports['AWAY_API_PORT']}"
    until = lambda predicate, timeout, what: _until(  # noqa: E731
        predicate, timeout=timeout, what=what, script=script, log=log
    )
    try:
        until(lambda: "== two regions started" in log.read_text(), 1500, "both regions to start")
        assert _answers(f"{home}/healthz") and _answers(f"{away}/healthz")
        text = log.read_text()
        # Every line of output names its region (or pg, redis, link, regions).
        prefixes = {line.split(" | ", 1)[0] for line in text.splitlines() if line.strip()}
        assert prefixes <= {HOME, AWAY, "pg", "psql", f"redis {HOME}", f"redis {AWAY}", "link", "regions"}, (
            prefixes
        )
        assert f"{AWAY} | subscribed to authority" in text
        key = var_dir / "regions" / "region.key"
        assert key.stat().st_mode & 0o777 == 0o600
        home_env, away_env = _region_env(var_dir, HOME), _region_env(var_dir, AWAY)
        assert home_env["REGION_KEYS"] == f"{AWAY}={key.read_text().strip()}"
        assert away_env["REGION_KEYS"] == f"{HOME}={key.read_text().strip()}"
        assert away_env["REGION_PEERS"] == f"{HOME}=http://127.0.0.1:{ports['LINK_API_PORT']}"

        # The tenant, its people and grants, written at home, reach Frankfurt by replication.
        (var_dir / "home.yaml").write_text(AT_HOME)
        _manage(var_dir, HOME, "apply", str(var_dir / "home.yaml"))
        regions_row = (
            "SELECT allowed::text FROM regions_tenantregions r JOIN tenants_tenant t ON t.id = r.tenant_id "
            "WHERE t.slug = 'two-regions'"
        )
        allowed = until(
            lambda: _scalar(away_env["DATABASE_URL"], regions_row), 120, "the tenant's regions at Frankfurt"
        )
        assert allowed == '["mumbai", "frankfurt"]'
        lag = float(_manage(var_dir, AWAY, "regions_replication", "lag").strip())
        assert 0 <= lag < 60, lag
        # Frankfurt's own rows: the model endpoint, the tool, the agent.
        (var_dir / "frankfurt.yaml").write_text(AT_FRANKFURT)
        _manage(var_dir, AWAY, "apply", str(var_dir / "frankfurt.yaml"))

        # A run started through Frankfurt's API, on a slice the home lends it.
        headers = _token(away)
        started = httpx.post(
            f"{away}/v1/runs", json={"agent": "echoer", "input": {"q": "hello"}}, headers=headers, timeout=60
        )
        assert started.status_code == 201, started.text
        run_id = started.json()["id"]
        done = until(
            lambda: (
                (r := httpx.get(f"{away}/v1/runs/{run_id}", headers=headers, timeout=30).json())["status"]
                in ("succeeded", "failed", "stopped")
                and r
            ),
            300,
            "the run at Frankfurt to end",
        )
        assert done["status"] == "succeeded", done
        steps = httpx.get(f"{away}/v1/runs/{run_id}/steps", headers=headers, timeout=30).json()
        assert [(s["kind"], s["status"]) for s in steps] == [
            ("model", "succeeded"),
            ("tool", "succeeded"),
            ("model", "succeeded"),
        ]
        # The run lives in Frankfurt only.
        runs_at_home = _scalar(home_env["DATABASE_URL"], "SELECT count(*) FROM runs_run")
        assert runs_at_home == 0
        # Both sides show the slice: Frankfurt's day limit is what the home lent it, the home's day
        # limit is the day less that (read until no request is in flight between the two reads).
        home_headers = _token(home)

        def books() -> tuple[dict, dict] | None:
            there, at_home = _status(away, headers), _status(home, home_headers)
            lent = [s for s in at_home["slices"] if s["region"] == AWAY and s["user"] is None]
            granted = there["day_account"]["limit_micros"]
            agree = (
                granted > 0
                and there["pending_requests"]["n"] == 0
                and len(lent) == 1
                and lent[0]["outstanding_micros"] == granted
                and at_home["day_account"]["limit_micros"] == 5_000_000 - granted
            )
            return (there, at_home) if agree else None

        there, at_home = until(books, 60, "the slice in both regions' statuses")
        assert (there["region"], there["home"], there["is_home"]) == (AWAY, HOME, False)
        assert there["link"]["state"] == "up", there
        assert there["day_account"]["spent_micros"] > 0, there
        assert (at_home["region"], at_home["is_home"]) == (HOME, True), at_home

        # The link cut: Frankfurt's keeper finds the home unreachable; healed: up again, and the
        # copy of the home's authority fresh again (replication runs through the link too).
        link = ["scripts/region_link.py", "--state-dir", str(var_dir / "regions" / "link")]
        subprocess.run([PY, link[0], "cut", *link[1:]], cwd=ROOT, check=True, capture_output=True)
        assert not _answers(f"http://127.0.0.1:{ports['LINK_API_PORT']}/healthz")
        down = until(lambda: (s := _status(away, headers))["link"]["state"] == "down" and s, 120, "link down")
        assert down["link"]["last_error"], down
        subprocess.run([PY, link[0], "heal", *link[1:]], cwd=ROOT, check=True, capture_output=True)
        assert _answers(f"http://127.0.0.1:{ports['LINK_API_PORT']}/healthz")
        until(lambda: _status(away, headers)["link"]["state"] == "up", 120, "link up again")
        until(lambda: _status(away, headers)["authority_age_seconds"] < 30, 120, "replication after the cut")

        # TERM stops everything the script started: both stacks, the link, Redis and PostgreSQL.
        script.send_signal(signal.SIGTERM)
        script.wait(180)
        assert "regions | stopped" in log.read_text(), _tail(log)
        assert not [name for name, port in ports.items() if _listening(int(port))]
        assert not _processes_under(var_dir)
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGTERM)
            try:
                script.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(script.pid, signal.SIGKILL)
        print(_tail(log))


def _processes_under(path: Path) -> str:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(path) in args:
            found.append(args)
    return "\n".join(found)


def test_every_variable_serve_regions_reads_is_in_the_regions_doc():
    script = (ROOT / "scripts" / "serve_regions.sh").read_text()
    doc = (ROOT / "docs" / "regions.md").read_text()
    names = set(re.findall(r"\$\{([A-Z_]+):-", script))
    assert set(PORTS) | {"HOME_REGION", "AWAY_REGION", "AGENTPLATFORM_VAR_DIR"} <= names
    assert not [name for name in sorted(names) if f"`{name}`" not in doc]
