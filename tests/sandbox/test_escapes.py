"""Contract: every escape attempt fails (network, files, processes). Every backend must pass it.

Each test runs model-style code that tries to get out and prints what it reached; the test then
checks both the sandbox's own account and the host side (the listener accepted nothing, the file
is unchanged, no process is left).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import uuid
from pathlib import Path
from urllib.parse import urlparse

import pytest

from sandbox.backends import input_name

ROOT = Path(__file__).resolve().parents[2]

TRY = """
import json, socket, sys
def attempt(fn):
    try:
        return "reached: " + repr(fn())
    except BaseException as exc:
        return "refused: " + type(exc).__name__ + ": " + str(exc)
"""


def results(outcome) -> dict:
    assert outcome.exit_code == 0, outcome.stderr.decode()
    return json.loads(outcome.stdout.decode().strip().splitlines()[-1])


def assert_all_refused(found: dict) -> None:
    reached = {k: v for k, v in found.items() if not v.startswith("refused")}
    assert not reached, f"reached from inside the sandbox: {reached}"


# -- network ---------------------------------------------------------------------------------


def _service_ports() -> list[int]:
    ports = []
    for var in ("DATABASE_URL", "CELERY_BROKER_URL"):
        parsed = urlparse(os.environ.get(var, ""))
        if parsed.hostname in ("127.0.0.1", "localhost") and parsed.port:
            ports.append(parsed.port)
    return ports


def test_it_cannot_reach_a_tcp_listener_on_the_host_loopback(run):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    ports = [listener.getsockname()[1], *_service_ports()]
    code = (
        TRY
        + f"""
found = {{}}
for port in {ports!r}:
    for host in ("127.0.0.1", "localhost", "::1"):
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        found[f"{{host}}:{{port}}"] = attempt(lambda: socket.create_connection((host, port), timeout=1).getpeername())
found["raw"] = attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
found["packet"] = attempt(lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW))
found["netlink"] = attempt(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0))
print(json.dumps(found))
"""
    )
    found = results(run(code))
    assert_all_refused(found)
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()


def test_it_cannot_send_udp_or_resolve_names(run):
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    receiver.settimeout(0.3)
    port = receiver.getsockname()[1]
    code = (
        TRY
        + f"""
def send():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    return s.sendto(b"leak", ("127.0.0.1", {port}))
found = {{"udp": attempt(send), "dns": attempt(lambda: socket.getaddrinfo("example.com", 443)),
          "dns-localhost": attempt(lambda: socket.getaddrinfo("db.internal", 5432))}}
print(json.dumps(found))
"""
    )
    found = results(run(code))
    assert_all_refused(found)
    with pytest.raises(TimeoutError):
        receiver.recvfrom(100)
    receiver.close()


def test_it_cannot_connect_to_an_abstract_or_a_host_unix_socket(run, tmp_path):
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Unique per call: a listener a failed run of the other backend left open must not collide.
    name = f"\0agentsandbox-contract-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    abstract.bind(name)
    abstract.listen(4)
    abstract.settimeout(0.2)
    path = tmp_path / "host.sock"
    on_disk = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    on_disk.bind(str(path))
    on_disk.listen(4)
    on_disk.settimeout(0.2)
    os.chmod(tmp_path, 0o777)
    os.chmod(path, 0o777)
    pg_sockets = ["/var/run/postgresql/.s.PGSQL.5432", "/tmp/.s.PGSQL.5432"]
    code = (
        TRY
        + f"""
def connect(address):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(address)
    return "connected"
found = {{"abstract": attempt(lambda: connect({name!r})), "host": attempt(lambda: connect({str(path)!r}))}}
for p in {pg_sockets!r}:
    found[p] = attempt(lambda: connect(p))
print(json.dumps(found))
"""
    )
    found = results(run(code))
    assert_all_refused(found)
    for listener in (abstract, on_disk):
        with pytest.raises(TimeoutError):
            listener.accept()
        listener.close()


# -- files -----------------------------------------------------------------------------------


def test_it_cannot_read_host_files_the_checkout_or_another_process_environment(run, monkeypatch):
    monkeypatch.setenv("SECRET_ENCRYPTION_KEYS", "canary-key-in-the-host-environment")
    host_pid = os.getpid()
    paths = [
        str(ROOT / "manage.py"),
        str(ROOT / "agentplatform" / "settings.py"),
        "/etc/shadow",
        "/etc/passwd",
        "/root/.bash_history",
        f"/proc/{host_pid}/environ",
        f"/proc/{os.getppid()}/cmdline",
        "/proc/1/root/etc/shadow",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ]
    code = (
        TRY
        + f"""
import os
found = {{p: attempt(lambda: open(p, "rb").read(200)) for p in {paths!r}}}
seen = b""
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    for what in ("environ", "cmdline"):
        try:
            seen += open(f"/proc/{{pid}}/{{what}}", "rb").read()
        except OSError:
            pass
found["canary"] = "reached" if b"canary" in seen or b"DATABASE_URL" in seen else "refused: not in any /proc"
found["env"] = "refused: empty" if set(os.environ) <= {{"HOME", "PATH", "LANG", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MPLBACKEND", "PWD"}} else "reached: " + repr(dict(os.environ))
print(json.dumps(found))
"""
    )
    assert_all_refused(results(run(code)))


def test_it_cannot_write_outside_out_and_inputs_stay_unchanged(run, tmp_path):
    data = b"id,amount\n1,10.00\n"
    inputs = {"ledger.csv": data}
    code = (
        TRY
        + """
import os
found = {}
for p in ("/evil", "/usr/evil", "/runtime/evil", "/in/evil", "/in/ledger.csv", "/out/../evil", "/proc/evil", "/dev/evil"):
    found["write " + p] = attempt(lambda: open(p, "wb").write(b"x"))
found["append input"] = attempt(lambda: open("/in/ledger.csv", "ab").write(b"x"))
found["chmod input"] = attempt(lambda: os.chmod("/in/ledger.csv", 0o666))
found["unlink input"] = attempt(lambda: os.unlink("/in/ledger.csv"))
found["rename input"] = attempt(lambda: os.rename("/in/ledger.csv", "/out/moved.csv"))
found["mkdir root"] = attempt(lambda: os.mkdir("/newdir"))
print(json.dumps(found))
"""
    )
    outcome = run(code, inputs=inputs)
    assert_all_refused(results(outcome))
    assert outcome.files == {}
    assert hashlib.sha256(inputs["ledger.csv"]).digest() == hashlib.sha256(data).digest()


@pytest.mark.parametrize(
    "name", ["../../etc/x", "/etc/passwd", "a/../../b", "..", ".hidden", "a\x00b", "c:\\x", ""]
)
def test_it_refuses_input_names_that_leave_in(name):
    with pytest.raises(ValueError):
        input_name(name)


def test_it_collects_only_regular_files_and_never_follows_a_symlink_or_fifo(run, tmp_path):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("host secret")
    os.chmod(tmp_path, 0o755)
    code = f"""
import os
open("/out/result.csv", "w").write("ok\\n")
os.symlink({str(secret)!r}, "/out/link-to-host")
os.symlink("/etc/passwd", "/out/link-to-etc")
os.mkfifo("/out/pipe")
os.mkdir("/out/dir")
print("done")
"""
    outcome = run(code)
    assert outcome.exit_code == 0, outcome.stderr
    assert outcome.files == {"result.csv": b"ok\n"}
    # (gVisor keeps a fifo inside its own kernel: it never reaches the host's /out to be skipped)
    assert (
        {"dir", "link-to-etc", "link-to-host"}
        <= set(outcome.skipped)
        <= {"dir", "link-to-etc", "link-to-host", "pipe"}
    )


# -- processes -------------------------------------------------------------------------------


def test_it_sees_no_host_process_and_cannot_signal_one(run):
    host_pid = os.getpid()
    code = (
        TRY
        + f"""
import os, signal
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
found = {{"kill host": attempt(lambda: os.kill({host_pid}, 0)),
          "host pid visible": "reached" if {host_pid} in pids and {host_pid} > 8 else "refused: not listed",
          "many pids": "reached: " + repr(pids) if len(pids) > 5 else "refused: only the sandbox's own"}}
print(json.dumps(found))
"""
    )
    assert_all_refused(results(run(code)))


def test_it_cannot_ptrace_unshare_mount_chroot_or_setuid(run):
    code = (
        TRY
        + """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def call(fn, *args):
    if fn(*args) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return "succeeded"
def trace_child():
    pid = os.fork()
    if pid == 0:
        import time; time.sleep(5); os._exit(0)
    try:
        return call(libc.ptrace, 16, pid, None, None)  # PTRACE_ATTACH
    finally:
        os.kill(pid, 9)
found = {
    "ptrace traceme": attempt(lambda: call(libc.ptrace, 0, 0, None, None)),
    "ptrace attach": attempt(trace_child),
    "unshare user": attempt(lambda: call(libc.unshare, 0x10000000)),
    "unshare net": attempt(lambda: call(libc.unshare, 0x40000000)),
    "unshare mount": attempt(lambda: call(libc.unshare, 0x00020000)),
    "mount tmpfs": attempt(lambda: call(libc.mount, b"tmpfs", b"/tmp", b"tmpfs", 0, None)),
    "mount proc": attempt(lambda: call(libc.mount, b"proc", b"/tmp", b"proc", 0, None)),
    "chroot": attempt(lambda: os.chroot("/tmp")),
    "setuid 0": attempt(lambda: os.setuid(0)),
    "setgid 0": attempt(lambda: os.setgid(0)),
    "keyctl": attempt(lambda: call(libc.syscall, 250, 0, 0, 0, 0)),
    "bpf": attempt(lambda: call(libc.syscall, 321, 0, 0, 0)),
}
print(json.dumps(found))
"""
    )
    assert_all_refused(results(run(code)))


def _processes_of(uid: int) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                found.append(int(pid))
        except FileNotFoundError:
            pass
    return found


def test_a_double_forked_orphan_does_not_outlive_the_sandbox(run, backend):
    code = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
    os._exit(0)
time.sleep(0.2)
print("parent done")
"""
    outcome = run(code, slot=3)
    assert outcome.exit_code == 0, outcome.stderr
    if "uid" not in getattr(backend, "weaken", ()):
        assert _processes_of(backend.uid_base + 3) == []


# -- tenants ---------------------------------------------------------------------------------


def test_two_executions_at_once_see_nothing_of_each_other(run):
    marker = "tenant-a-marker-7311"
    first = f"""
import os, time
open("/tmp/{marker}", "w").write("a")
open("/out/{marker}", "w").write("a")
time.sleep(1.5)
print("a done")
"""
    second = """
import json, os, time
time.sleep(0.5)
seen = []
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    try:
        seen.append(open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace"))
    except OSError:
        pass
print(json.dumps({"tmp": os.listdir("/tmp"), "out": os.listdir("/out"), "procs": seen}))
"""
    outcomes = {}
    a = threading.Thread(target=lambda: outcomes.setdefault("a", run(first, slot=0)))
    a.start()
    outcomes["b"] = run(second, slot=1)
    a.join()
    assert outcomes["a"].exit_code == 0
    seen = json.loads(outcomes["b"].stdout.decode().splitlines()[-1])
    assert marker not in json.dumps(seen)
    assert outcomes["a"].files == {marker: b"a"}
    assert outcomes["b"].files == {}
