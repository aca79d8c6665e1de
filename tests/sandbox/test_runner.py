"""The runner process: a cleared environment, idempotent executions, per-tenant slot shares."""

from __future__ import annotations

import base64
import concurrent.futures
import os
import shutil
import subprocess
import tempfile
import time

import httpx
import pytest

from sandbox import cgroups
from sandbox.backends import Bubblewrap, Execution, _mount_tmpfs, _umount, reachable_by_slots
from sandbox.limits import Limits
from tests.sandbox_runner import AUTH, Runner, uid_base
from tests.servers import wait_for

WORK_ROOT = "/tmp/agentsandbox"  # the runner's default --work-root


def execute(url: str, *, key: str, tenant: str = "t1", code: str = "print(1)", **extra) -> httpx.Response:
    body = {"key": key, "tenant": tenant, "code": code} | extra
    return httpx.post(url + "/v1/executions", json=body, headers=AUTH, timeout=60)


def executions(url: str) -> int:
    return sum(httpx.get(url + "/metrics", headers=AUTH).json()["executions"].values())


def running(url: str) -> int:
    """Executions the runner has taken in and not yet answered (a slot's, or waiting for one)."""
    return httpx.get(url + "/metrics", headers=AUTH).json()["running"]


def test_it_holds_no_database_url_or_secret_key(runner_url):
    url, pid = runner_url
    environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    names = {e.split(b"=", 1)[0] for e in environ if e}
    assert b"DATABASE_URL" not in names and b"SECRET_KEY" not in names
    assert b"canary" not in b"".join(environ)
    assert names <= {b"PATH", b"PYTHONPATH", b"SANDBOX_RUNNER_CLEAN"}


def test_it_runs_code_with_inputs_and_returns_files(runner_url):
    url, _ = runner_url
    csv = b"id,amount\n1,10\n2,32\n"
    code = "import pandas as pd\nd = pd.read_csv('/in/t.csv')\nd.to_csv('/out/sum.csv', index=False)\nprint(int(d.amount.sum()))"
    r = execute(
        url,
        key="k-inputs",
        code=code,
        inputs=[{"name": "t.csv", "content_b64": base64.b64encode(csv).decode()}],
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["exit_code"] == 0, body["stderr"]
    assert body["stdout"].strip() == "42"
    assert [f["name"] for f in body["files"]] == ["sum.csv"]
    assert base64.b64decode(body["files"][0]["content_b64"]) == csv
    assert body["usage"]["cpu_seconds"] > 0 and body["usage"]["memory_peak_bytes"] > 0


def test_the_same_key_returns_the_result_already_produced(runner_url):
    url, _ = runner_url
    before = executions(url)
    code = "import random\nprint(random.random())"
    first = execute(url, key="k-once", code=code).json()
    second = execute(url, key="k-once", code=code).json()
    assert (first["replayed"], second["replayed"]) == (False, True)
    assert first["stdout"] == second["stdout"]
    assert executions(url) == before + 1
    other_tenant = execute(url, key="k-once", tenant="t2", code=code).json()
    assert other_tenant["replayed"] is False


def test_a_retry_while_the_first_still_runs_joins_it_instead_of_running_twice(runner_url):
    url, _ = runner_url
    before = executions(url)
    code = "import time, random\ntime.sleep(1)\nprint(random.random())"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(execute, url, key="k-join", code=code)
        # The retry arrives while the first is running (it sleeps 1 s inside its sandbox).
        wait_for(lambda: running(url) == 1, timeout=10, interval=0.01, what="the first execution running")
        second = pool.submit(execute, url, key="k-join", code=code)
        a, b = first.result().json(), second.result().json()
    assert a["stdout"] == b["stdout"]
    assert executions(url) == before + 1


def test_nothing_runs_and_no_result_is_read_without_the_platforms_token(runner_url):
    url, _ = runner_url
    done = execute(url, key="k-secret", code="print('balance 9,999')")
    assert done.status_code == 200 and "9,999" in done.json()["stdout"]
    before = executions(url)
    for headers in (
        {},
        {"Authorization": "Bearer " + "x" * 43},
        {"Authorization": AUTH["Authorization"] + "x"},
    ):
        # Another process on the host: it can neither run code nor read a kept result by its key.
        for key, code in (("k-other", "print(1)"), ("k-secret", "")):
            body = {"key": key, "tenant": "t1", "code": code}
            refused = httpx.post(url + "/v1/executions", json=body, headers=headers, timeout=10)
            assert refused.status_code == 401 and "9,999" not in refused.text
        assert httpx.get(url + "/metrics", headers=headers).status_code == 401
    assert executions(url) == before
    assert httpx.get(url + "/healthz").status_code == 200  # probes need no token


def test_the_runner_makes_a_private_token_file_when_none_exists(tmp_path):
    from sandbox.runner import load_token

    path = tmp_path / "token"
    token = load_token(str(path))
    assert len(token) >= 32 and path.stat().st_mode & 0o777 == 0o600
    assert load_token(str(path)) == token  # kept across restarts
    path.write_text("short")
    with pytest.raises(SystemExit, match="at least 32 characters"):
        load_token(str(path))


def test_bad_requests_get_a_field_error(runner_url):
    url, _ = runner_url
    r = execute(url, key="k-bad", limits={"memory_bytes": -1})
    assert r.status_code == 400 and r.json()["field"] == "limits"
    r = execute(url, key="k-bad2", inputs=[{"name": "../x", "content_b64": ""}])
    assert r.status_code == 400 and r.json()["field"] == "inputs[0].name"
    r = httpx.post(url + "/v1/executions", json={"tenant": "t"}, headers=AUTH)
    assert r.status_code == 400 and r.json()["field"] == "key"


def test_one_tenants_backlog_of_fork_bombs_leaves_another_tenant_its_slots(runner_url):
    url, _ = runner_url
    bomb = "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.001)"
    limits = {"wall_seconds": 3, "processes": 64}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        bombs = [
            pool.submit(execute, url, key=f"bomb-{i}", tenant="noisy", code=bomb, limits=limits)
            for i in range(6)
        ]
        # The noisy tenant now holds its share and queues the rest (a bomb refused a slot is done).
        wait_for(
            lambda: running(url) + sum(f.done() for f in bombs) >= len(bombs),
            timeout=10,
            interval=0.01,
            what="every bomb taken in",
        )
        started = time.monotonic()
        honest = execute(
            url, key="honest", tenant="quiet", code="print(sum(range(1000)))", limits={"wall_seconds": 3}
        )
        took = time.monotonic() - started
        done = [f.result() for f in bombs]
    assert honest.status_code == 200 and honest.json()["stdout"].strip() == "499500"
    assert took < 2.5, f"the quiet tenant waited {took:.1f} s behind the noisy one"
    assert all(r.status_code in (200, 503) for r in done)


def _leftovers(pid: int) -> list[str]:
    work = [n for n in os.listdir(WORK_ROOT) if n.startswith(f"x-{pid}-")] if os.path.isdir(WORK_ROOT) else []
    groups = [
        f"{c}/{n}"
        for c in cgroups.CONTROLLERS
        for n in os.listdir(os.path.join(cgroups.ROOT, c, cgroups.PARENT))
        if n.startswith(f"{pid}-")
    ]
    return work + groups


def test_a_stopped_runner_leaves_no_work_directory_or_cgroup_behind():
    # the teardown runs after the answer: stopping the runner must still let it finish
    runner = Runner(slots=2).start()
    try:
        for i in range(3):
            r = execute(runner.url, key=f"k-left-{i}", code="open('/out/a.txt', 'w').write('x')")
            assert r.status_code == 200, r.text
    finally:
        runner.stop()
    assert runner.proc.returncode == 0
    assert _leftovers(runner.proc.pid) == []


def test_a_runner_start_removes_what_a_killed_runner_left():
    gone = subprocess.Popen(["/bin/true"])
    gone.wait()  # a pid no process has any more, as a killed runner's
    work = os.path.join(WORK_ROOT, f"x-{gone.pid}-stale")
    os.makedirs(os.path.join(work, "in"))
    os.makedirs(os.path.join(work, "out"))
    with open(os.path.join(work, "in", "card.csv"), "w") as f:
        f.write("txn_id,amount\n1,10\n")
    _mount_tmpfs(os.path.join(work, "out"), size=1 << 20, inodes=4, uid=0)
    stale = cgroups.Cgroup(f"{gone.pid}-stale")
    stale.create(memory_bytes=64 << 20, processes=8, cores=1)
    alive = cgroups.Cgroup(f"{os.getpid()}-alive")  # a running process's group is not touched
    alive.create(memory_bytes=64 << 20, processes=8, cores=1)
    runner = Runner(slots=2)
    try:
        runner.start()
        assert _leftovers(gone.pid) == []
        assert not any(m.split()[1] == os.path.join(work, "out") for m in open("/proc/mounts"))
        assert all(os.path.isdir(p) for p in alive.paths.values())
    finally:
        runner.stop()
        alive.remove()
        stale.remove()
        _umount(os.path.join(work, "out"))
        shutil.rmtree(work, ignore_errors=True)


def test_a_runtime_under_a_directory_the_slots_cannot_enter_is_staged_where_they_can(tmp_path):
    # A checkout under /root or a mktemp directory (mode 0700): bwrap, running as the slot's uid,
    # could not open the runtime to bind it. The backend binds a copy the slots can reach.
    hidden = tmp_path / "private"
    (hidden / "runtime" / "site-packages").mkdir(parents=True)
    (hidden / "runtime" / "site-packages" / "staged_marker.py").write_text("VALUE = 'from the runtime'\n")
    os.chmod(hidden / "runtime" / "site-packages" / "staged_marker.py", 0o644)
    for path in (hidden / "runtime" / "site-packages", hidden / "runtime"):
        os.chmod(path, 0o755)
    os.chmod(hidden, 0o700)
    work_root = tempfile.mkdtemp(prefix="agentsandbox-staged-")  # pytest's tmp_path is 0700 too
    os.chmod(work_root, 0o711)
    try:
        _run_from_a_staged_runtime(hidden, work_root)
    finally:
        shutil.rmtree(work_root, ignore_errors=True)


def _run_from_a_staged_runtime(hidden, work_root: str) -> None:
    backend = Bubblewrap(runtime=str(hidden / "runtime"), work_root=work_root, uid_base=uid_base())
    assert not reachable_by_slots(str(hidden / "runtime"))
    backend.check()
    assert reachable_by_slots(backend.runtime) and reachable_by_slots(backend.harness)
    execution = Execution(
        code="import staged_marker\nprint(staged_marker.VALUE)", inputs={}, limits=Limits(wall_seconds=10)
    )
    outcome = backend.execute(execution, slot=0)
    assert outcome.exit_code == 0, outcome.stderr
    assert outcome.stdout.strip() == b"from the runtime"
    # A second backend (another runner, the next session) reuses the staged copy.
    again = Bubblewrap(runtime=str(hidden / "runtime"), work_root=work_root, uid_base=uid_base())
    again.check()
    assert again.runtime == backend.runtime
