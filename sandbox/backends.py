"""Backends that run one execution in a fresh sandbox: bubblewrap (shipped) and gVisor's runsc.

A backend takes an Execution (code, input files, limits) and a slot (its uid), and returns an
Outcome: exit status, output tails, the regular files left in /out, the limit hit and the usage
measured from outside. The runner (sandbox/runner.py) picks slots and keeps results; a backend
holds no state between executions, and nothing of one sandbox survives it.

Bubblewrap, in the order it happens:
1. a work directory: inputs copied into in/ (root-owned, read-only), a tmpfs of the output cap
   mounted on out/ (owned by the slot's uid, a fixed number of inodes);
2. a cgroup (sandbox/cgroups.py) the launcher joins before it execs, so every process of the
   sandbox is counted from the first;
3. setpriv drops to the slot's uid, bwrap unshares every namespace (user, pid, net with loopback
   only, mount, ipc, uts, cgroup), builds a read-only root of /usr and the runtime, /in, /out, a
   size-capped /tmp, a private /proc and /dev, loads the seccomp filter and runs the harness;
4. the runner watches wall clock, CPU (cpuacct) and output size, and kills the cgroup's
   processes on a limit;
5. only once the cgroup is empty are /out's regular files read (no symlink, fifo or device is
   followed) and the counters read; then the outcome is returned while a sweeper thread
   unmounts the tmpfs, removes the work directory and the cgroup: that teardown waits on the
   kernel dropping the sandbox's mount namespace (milliseconds under load) and nothing in the
   outcome depends on it. Nothing of the sandbox is left running by then: the cgroup is empty.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import os
import queue
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
import uuid

from sandbox import cgroups, seccomp_filter
from sandbox.limits import ADVICE, CPU, KINDS, MEMORY, OUTPUT, PROCESSES, TIMEOUT, Limits

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness.py")
REPO = os.path.dirname(os.path.dirname(HARNESS))
SLOT_UID_BASE = 62000
WEAKEN = frozenset({"network", "seccomp", "pid", "hostfs", "cgroup", "rlimits", "uid"})


@dataclasses.dataclass(frozen=True)
class Execution:
    code: str
    inputs: dict[str, bytes]
    limits: Limits


@dataclasses.dataclass
class Outcome:
    exit_code: int | None
    limit: str | None
    stdout: bytes
    stderr: bytes
    files: dict[str, bytes]
    skipped: list[str]
    cpu_seconds: float
    memory_peak_bytes: int
    wall_seconds: float
    backend: str
    # From the call to the harness about to run the code (work dir, cgroup, sandbox, interpreter);
    # None where the backend cannot tell (gVisor's harness has no report descriptor).
    start_seconds: float | None = None

    @property
    def message(self) -> str:
        if self.limit:
            return ADVICE[self.limit]
        return "exited with status 0" if self.exit_code == 0 else f"exited with status {self.exit_code}"


class BackendUnavailable(RuntimeError):
    pass


class Backend:
    """One way to run an Execution in a fresh sandbox."""

    name = ""

    def check(self) -> None:
        """Raise BackendUnavailable when this machine cannot run the backend."""
        raise NotImplementedError

    def execute(self, execution: Execution, *, slot: int) -> Outcome:
        raise NotImplementedError

    def prepare(self) -> None:
        """Work done once when a runner starts, not on the path of any execution."""


def input_name(name: str) -> str:
    """An input file's name inside /in: a plain file name, nothing that walks out of it."""
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or name.startswith(".")
        or any(c in name for c in "/\\\x00")
        or len(name) > 200
    ):
        raise ValueError(f"input name {name!r} is not a plain file name (no path, no leading dot)")
    return name


_libc = ctypes.CDLL(None, use_errno=True)
MNT_DETACH = 2


def _mount_tmpfs(path: str, *, size: int, inodes: int, uid: int) -> None:
    options = f"size={size},nr_inodes={inodes},mode=0700,uid={uid},gid={uid}".encode()
    flags = 0x2 | 0x4 | 0x8  # MS_NOSUID | MS_NODEV | MS_NOEXEC
    if _libc.mount(b"tmpfs", path.encode(), b"tmpfs", flags, options) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs on {path}: {os.strerror(err)}")


def _umount(path: str) -> None:
    _libc.umount2(path.encode(), MNT_DETACH)


def _prepare_work_dir(root: str, execution: Execution, uid: int) -> str:
    os.makedirs(root, mode=0o711, exist_ok=True)
    # named after this process, so that a later runner can tell a dead one's leftovers
    work = tempfile.mkdtemp(prefix=f"x-{os.getpid()}-", dir=root)
    try:
        return _fill_work_dir(work, execution, uid)
    except BaseException:
        _umount(os.path.join(work, "out"))
        shutil.rmtree(work, ignore_errors=True)
        raise


def _fill_work_dir(work: str, execution: Execution, uid: int) -> str:
    os.chmod(work, 0o711)
    inputs = os.path.join(work, "in")
    os.mkdir(inputs, 0o755)
    for name, data in execution.inputs.items():
        path = os.path.join(inputs, input_name(name))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    os.chmod(inputs, 0o555)
    out = os.path.join(work, "out")
    os.mkdir(out, 0o700)
    _mount_tmpfs(out, size=execution.limits.output_bytes, inodes=execution.limits.output_files + 1, uid=uid)
    return work


class _Sweeper:
    """Removes what executions leave on the host (the work directory with its /out tmpfs, the
    empty cgroup), in order, off the path of the call; drained when the process exits."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, work: str, group: cgroups.Cgroup) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sandbox-sweeper", daemon=True)
                self._thread.start()
                atexit.register(self.drain)
        self._queue.put((work, group))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._sweep(*item)

    @staticmethod
    def _sweep(work: str, group: cgroups.Cgroup) -> None:
        _umount(os.path.join(work, "out"))
        shutil.rmtree(work, ignore_errors=True)
        group.remove()

    def drain(self) -> None:
        """Let every pending removal finish (at exit the daemon thread would be cut short)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(None)
        thread.join(timeout=30)
        while True:  # whatever a stuck thread left
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._sweep(*item)


def reachable_by_slots(path: str) -> bool:
    """Whether any uid can reach `path`: bwrap runs as the slot's uid and opens the sources of
    its binds with that uid's rights, so every directory above them must be searchable by others
    (a checkout under /root or a mktemp directory, both 0700, is not)."""
    path = os.path.abspath(path)
    try:
        if not os.stat(path).st_mode & stat.S_IROTH:
            return False
        parent = os.path.dirname(path)
        while True:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
            if parent == "/":
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


def staged_for_slots(runtime: str, harness: str, work_root: str) -> tuple[str, str]:
    """The runtime and the harness, or, where a slot could not reach them, a copy of both under
    the work root (hard links where it is the same file system), made once per runtime build.
    The copy is what a sandbox binds read-only; the checkout itself stays as it is."""
    if reachable_by_slots(runtime) and reachable_by_slots(harness):
        return runtime, harness
    build = os.stat(os.path.join(runtime, "site-packages"))
    key = f"{build.st_dev:x}-{build.st_ino:x}-{int(build.st_mtime_ns):x}-{os.stat(harness).st_mtime_ns:x}"
    os.makedirs(work_root, mode=0o711, exist_ok=True)
    staged = os.path.join(work_root, f"runtime-{key}")
    if not os.path.isdir(staged):
        for name in os.listdir(work_root):  # copies of earlier builds
            if name.startswith("runtime-") and name != os.path.basename(staged):
                shutil.rmtree(os.path.join(work_root, name), ignore_errors=True)
        partial = tempfile.mkdtemp(prefix=".runtime-", dir=work_root)
        shutil.copytree(runtime, os.path.join(partial, "runtime"), copy_function=_link_or_copy, symlinks=True)
        shutil.copy(harness, os.path.join(partial, "harness.py"))
        for top, _dirs, files in os.walk(partial):
            os.chmod(top, 0o755)
            for name in files:
                target = os.path.join(top, name)
                if not os.path.islink(target):
                    os.chmod(target, os.stat(target).st_mode | 0o444)
        try:
            os.rename(partial, staged)
        except OSError:  # another runner (or test process) staged the same build first
            shutil.rmtree(partial, ignore_errors=True)
            if not os.path.isdir(staged):
                raise
    return os.path.join(staged, "runtime"), os.path.join(staged, "harness.py")


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def remove_stale(work_root: str) -> None:
    """What runners that are gone left on the host (killed between an answer and its sweep, or
    mid-execution): work directories and empty cgroups named after a pid no longer running."""
    try:
        names = os.listdir(work_root)
    except OSError:
        names = []
    for name in names:
        pid = name.split("-")[1] if name.startswith("x-") and name.count("-") >= 2 else ""
        if pid.isdigit() and int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            work = os.path.join(work_root, name)
            _umount(os.path.join(work, "out"))
            shutil.rmtree(work, ignore_errors=True)
    cgroups.remove_stale()


_sweeper = _Sweeper()


def _collect(out: str, limits: Limits) -> tuple[dict[str, bytes], list[str], bool]:
    """Regular files directly in /out; anything else is skipped by name, never followed."""
    files: dict[str, bytes] = {}
    skipped: list[str] = []
    over = False
    total = 0
    for entry in sorted(os.scandir(out), key=lambda e: e.name):
        st = entry.stat(follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            skipped.append(entry.name)
            continue
        if len(files) >= limits.output_files or total + st.st_size > limits.output_bytes:
            skipped.append(entry.name)
            over = True
            continue
        fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            data = f.read(limits.output_bytes - total + 1)
        total += len(data)
        files[entry.name] = data
    return files, skipped, over


class Bubblewrap(Backend):
    """bwrap + seccomp + a cgroup v1 per execution + rlimits, as the slot's own uid.

    `weaken` switches one wall off; it exists for the contract tests alone (tests/sandbox),
    which show that each escape test fails without the wall it checks. The runner refuses it.
    """

    name = "bubblewrap"

    def __init__(
        self,
        *,
        runtime: str,
        work_root: str = "/tmp/agentsandbox",
        python: str = "/usr/bin/python3",
        weaken: frozenset[str] = frozenset(),
        uid_base: int = SLOT_UID_BASE,
    ):
        unknown = set(weaken) - WEAKEN
        if unknown:
            raise ValueError(f"unknown walls: {sorted(unknown)}")
        self.runtime = os.path.abspath(runtime)
        self.harness = HARNESS
        self.work_root = work_root
        self.python = python
        self.weaken = frozenset(weaken)
        # Slot n runs as uid_base + n. Two runners on one host need bases of their own:
        # RLIMIT_NPROC and the orphan check count per uid across the whole host.
        self.uid_base = uid_base
        self.bwrap = shutil.which("bwrap") or "/usr/bin/bwrap"
        self.setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"

    def check(self) -> None:
        for path, what in ((self.bwrap, "bwrap (apt-get install bubblewrap)"), (self.setpriv, "setpriv")):
            if not os.access(path, os.X_OK):
                raise BackendUnavailable(f"{what} is missing")
        if os.geteuid() != 0:
            raise BackendUnavailable("the bubblewrap runner must run as root (cgroups, per-slot uids)")
        why = cgroups.available()
        if why:
            raise BackendUnavailable(why)
        if not os.path.isdir(os.path.join(self.runtime, "site-packages")):
            raise BackendUnavailable(f"no sandbox runtime at {self.runtime} (scripts/ensure_sandbox.sh)")
        seccomp_filter.compiled()
        # Last: from here on the sandboxes bind what a slot's uid can reach.
        self.runtime, self.harness = staged_for_slots(self.runtime, self.harness, self.work_root)

    def prepare(self) -> None:
        remove_stale(self.work_root)

    def _bwrap_args(self, work: str, limits: Limits, seccomp_fd: int | None, report_fd: int) -> list[str]:
        args = [self.bwrap, "--unshare-user", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup"]
        if "network" not in self.weaken:
            args.append("--unshare-net")
        if "pid" not in self.weaken:
            # The harness is the namespace's pid 1: no bwrap init in between, which, once the
            # outer bwrap has gone, would be left a zombie for the host's init to reap (and
            # this machine's init does not). When pid 1 exits the kernel kills the rest.
            args += ["--unshare-pid", "--as-pid-1"]
        args += ["--die-with-parent", "--new-session", "--hostname", "sandbox"]
        args += ["--ro-bind", "/usr", "/usr"]
        for link in ("lib", "lib64", "bin", "sbin"):
            if os.path.islink(f"/{link}"):
                args += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
        if "hostfs" in self.weaken:
            # the contract tests' "what if the host's files were there": /etc and the checkout
            args += ["--ro-bind", "/etc", "/etc", "--ro-bind", REPO, REPO]
        args += [
            "--ro-bind", self.runtime, "/runtime",
            "--ro-bind", self.harness, "/runtime-harness.py",
            "--ro-bind", os.path.join(work, "in"), "/in",
            "--bind", os.path.join(work, "out"), "/out",
            "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp",
            "--proc", "/proc",
            "--dev", "/dev",
            "--remount-ro", "/dev",
            "--remount-ro", "/",
            "--chdir", "/tmp",
            "--clearenv",
            "--setenv", "HOME", "/tmp",
            "--setenv", "PATH", "/usr/bin:/bin",
            "--setenv", "LANG", "C.UTF-8",
            "--setenv", "OPENBLAS_NUM_THREADS", "1",
            "--setenv", "OMP_NUM_THREADS", "1",
            "--setenv", "MPLBACKEND", "Agg",
        ]  # fmt: skip
        if seccomp_fd is not None:
            args += ["--seccomp", str(seccomp_fd)]
        numbers = (
            report_fd,
            int(limits.cpu_seconds) + 1,
            max(limits.tmp_bytes, limits.output_bytes),
            limits.open_files,
            limits.memory_bytes,
            limits.processes,
            int("rlimits" in self.weaken),
        )
        args += [self.python, "-I", "-S", "-B", "/runtime-harness.py", *map(str, numbers)]
        return args

    def _launcher(self, work: str, limits: Limits, uid: int, group, seccomp_fd, report_fd: int) -> list[str]:
        """sh joins the cgroup and execs setpriv, which drops to the slot's uid and execs bwrap:
        every process of the sandbox is in the cgroup from its first instruction."""
        launcher = [
            "/bin/sh", "-c",
            'for f in $1; do echo $$ > "$f" || exit 125; done; shift; exec "$@"',
            "sh", " ".join(group.procs_files()),
        ]  # fmt: skip
        if uid:
            launcher += [self.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
        return launcher + self._bwrap_args(work, limits, seccomp_fd, report_fd)

    def _late_report(self, work: str) -> str | None:
        return None

    def _host_processes(self, limits: Limits) -> int:
        """The pids cgroup's limit: under bubblewrap every process of the code is a host process."""
        return limits.processes

    def execute(self, execution: Execution, *, slot: int) -> Outcome:
        limits = execution.limits
        uid = 0 if "uid" in self.weaken else self.uid_base + slot
        started = time.monotonic()
        work = _prepare_work_dir(self.work_root, execution, uid or self.uid_base)
        group = cgroups.Cgroup(f"{os.getpid()}-{uuid.uuid4().hex[:12]}")
        seccomp_fd = None
        report_r = report_w = None
        try:
            if "cgroup" in self.weaken:
                group.create(memory_bytes=1 << 40, processes=1 << 20, cores=os.cpu_count() or 1)
            else:
                group.create(
                    memory_bytes=limits.memory_bytes,
                    processes=self._host_processes(limits),
                    cores=limits.cores,
                )
            if "seccomp" not in self.weaken:
                seccomp_fd = os.memfd_create("seccomp", 0)
                os.write(seccomp_fd, seccomp_filter.compiled(allow_inet="network" in self.weaken))
                os.lseek(seccomp_fd, 0, os.SEEK_SET)
            report_r, report_w = os.pipe()
            launcher = self._launcher(work, limits, uid, group, seccomp_fd, report_w)
            fds = [report_w] + ([seccomp_fd] if seccomp_fd is not None else [])
            proc = subprocess.Popen(
                launcher,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={},
                pass_fds=fds,
                start_new_session=True,
            )
            os.close(report_w)
            report_w = None
            if seccomp_fd is not None:
                os.close(seccomp_fd)
                seccomp_fd = None
            outcome = self._watch(proc, execution, group, report_r, started)
            if not outcome.limit:
                outcome.limit = self._late_report(work)
        finally:
            for fd in (seccomp_fd, report_r, report_w):
                if fd is not None:
                    os.close(fd)
            group.kill_all(deadline=time.monotonic() + 5)
            try:
                files, skipped, over = _collect(os.path.join(work, "out"), limits)
            except OSError:
                files, skipped, over = {}, [], False
            # the counters are read before the group goes to the sweeper
            cpu, peak, oom, refused = (
                group.cpu_seconds(),
                group.memory_peak(),
                group.oom_killed(),
                group.pids_refused(),
            )
            _sweeper.put(work, group)
        outcome.files, outcome.skipped = files, skipped
        if over and not outcome.limit:
            outcome.limit = OUTPUT
        outcome.cpu_seconds = cpu
        outcome.memory_peak_bytes = peak
        if oom:
            outcome.limit = MEMORY
        elif refused and outcome.exit_code != 0:
            outcome.limit = PROCESSES
        return outcome

    def _watch(self, proc, execution, group, report_r, started) -> Outcome:
        limits = execution.limits
        for step in (lambda: proc.stdin.write(execution.code.encode()), proc.stdin.close):
            try:
                step()
            except BrokenPipeError:
                pass  # the launcher is gone already: its exit status says why
        streams = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
        seen = dict.fromkeys(streams, 0)
        report = bytearray()
        sel = selectors.DefaultSelector()
        for fd in streams:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        os.set_blocking(report_r, False)
        sel.register(report_r, selectors.EVENT_READ)
        open_fds = set(streams) | {report_r}
        limit = None
        start_seconds = None
        deadline = started + limits.wall_seconds
        while open_fds:
            now = time.monotonic()
            if now >= deadline:
                limit = TIMEOUT
                break
            for key, _ in sel.select(timeout=min(0.05, deadline - now)):
                fd = key.fd
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    open_fds.discard(fd)
                    continue
                if fd == report_r:
                    if start_seconds is None and chunk.startswith(b"+"):
                        start_seconds = time.monotonic() - started
                        chunk = chunk[1:]
                    report += chunk[: 4096 - len(report)]
                    continue
                seen[fd] += len(chunk)
                buf = streams[fd]
                buf += chunk
                if len(buf) > limits.stdout_bytes:
                    del buf[: len(buf) - limits.stdout_bytes]
                if seen[fd] > limits.stdout_bytes:
                    limit = OUTPUT
            if limit:
                break
            if group.cpu_seconds() >= limits.cpu_seconds:
                limit = CPU
                break
        if limit:
            group.kill_all(deadline=time.monotonic() + 5)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        sel.close()
        code = proc.wait()
        wall = time.monotonic() - started
        proc.stdout.close()
        proc.stderr.close()
        if not limit:
            limit = bytes(report).decode(errors="replace") or None
            if limit not in KINDS:
                limit = None
            if code in (128 + signal.SIGXCPU, -signal.SIGXCPU):
                limit = CPU
        stdout, stderr = (bytes(b) for b in streams.values())
        return Outcome(
            exit_code=None if limit in (TIMEOUT, CPU, OUTPUT) and code != 0 else code,
            limit=limit,
            stdout=stdout,
            stderr=stderr,
            files={},
            skipped=[],
            cpu_seconds=0.0,
            memory_peak_bytes=0,
            wall_seconds=wall,
            backend=self.name,
            start_seconds=start_seconds,
        )
