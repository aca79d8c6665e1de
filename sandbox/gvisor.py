"""The gVisor backend: the same execution under runsc, a user-space kernel between the code and
the host's (ptrace platform: it needs no KVM and works in a container).

Everything around the sandbox is the bubblewrap backend's (work directory, /out tmpfs, cgroup,
collection after the last process, limits and their kinds); only the launcher differs: an OCI
bundle with a read-only root of /usr and the runtime, no network (`--network=none`: loopback
inside gVisor's own network stack), the slot's uid inside, and the harness's report in a file
(runsc passes no extra descriptor). The cgroup holds gVisor's sentry and gofer, so memory and
CPU are the sandbox's whole; processes inside are the sentry's tasks, not host processes.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import socket
import subprocess

from sandbox import seccomp_filter
from sandbox.backends import SLOT_UID_BASE, BackendUnavailable, Bubblewrap
from sandbox.limits import Limits

MOUNT_POINTS = ("usr", "runtime", "in", "out", "tmp", "proc", "dev", "report")
MAP_LOCKED = 0x2000  # <linux/mman.h> on x86-64 and arm64; Python's mmap module does not name it


def pin(path: str) -> mmap.mmap:
    """Read `path` into the page cache now, from this process, and lock it there.

    A page of a file is charged to the memory cgroup of whoever reads it in. runsc is exec'd
    inside the execution's cgroup, so when its 24 MB were not in the cache (a cold host, or
    evicted) they were charged to the sandbox: code that then ran into its memory limit made
    the kernel reclaim runsc's own text instead of killing anything, runsc faulted it back in,
    and a memory bomb spun at the limit until it was stopped as `cpu` or `timeout` 20 s later
    (tests/sandbox/test_bombs.py evicts the file to show it). Read here, outside any
    execution's cgroup, and locked (the runner is root), the pages stay charged to the runner.
    """
    with open(path, "rb") as f:
        return mmap.mmap(
            f.fileno(), 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE | MAP_LOCKED, prot=mmap.PROT_READ
        )


def _container(work: str) -> str:
    """The container's name, from its execution's own work directory: executions run at once
    under one backend, so nothing per execution may live on the backend object."""
    return "sbx" + "".join(c for c in os.path.basename(work) if c.isalnum())


def oci_seccomp() -> dict:
    """The bubblewrap filter's deny list as an OCI profile, which gVisor enforces in its sentry:
    the same code gets the same refusals under either backend."""
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64"],
        "syscalls": [
            {"names": list(seccomp_filter.DENIED), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM},
            {
                "names": ["socket"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": errno.EAFNOSUPPORT,
                "args": [{"index": 0, "value": socket.AF_UNIX, "op": "SCMP_CMP_NE"}],
            },
        ],
    }


class Gvisor(Bubblewrap):
    name = "gvisor"

    def __init__(
        self,
        *,
        runtime: str,
        work_root: str = "/tmp/agentsandbox",
        python: str = "/usr/bin/python3",
        uid_base: int = SLOT_UID_BASE,
    ):
        super().__init__(runtime=runtime, work_root=work_root, python=python, uid_base=uid_base)
        self.runsc = shutil.which("runsc") or "/usr/bin/runsc"
        self.state = os.path.join(work_root, "runsc-state")
        self.rootfs = os.path.join(work_root, "gvisor-rootfs")
        self.pinned: mmap.mmap | None = None

    def check(self) -> None:
        if not os.access(self.runsc, os.X_OK):
            raise BackendUnavailable("runsc is missing (apt-get install runsc)")
        super().check()
        os.makedirs(self.state, mode=0o700, exist_ok=True)
        os.makedirs(self.rootfs, mode=0o755, exist_ok=True)
        for name in MOUNT_POINTS:
            os.makedirs(os.path.join(self.rootfs, name), exist_ok=True)
        open(os.path.join(self.rootfs, "runtime-harness.py"), "a").close()
        for link in ("lib", "lib64", "bin", "sbin"):
            target = os.path.join(self.rootfs, link)
            if os.path.islink(f"/{link}") and not os.path.lexists(target):
                os.symlink(os.readlink(f"/{link}"), target)

    def prepare(self) -> None:
        super().prepare()
        if self.pinned is None:
            self.pinned = pin(os.path.realpath(self.runsc))

    def _launcher(self, work: str, limits: Limits, uid: int, group, seccomp_fd, report_fd: int) -> list[str]:
        report = os.path.join(work, "report")
        os.mkdir(report, 0o700)
        os.chown(report, uid or 0, uid or 0)
        bundle = os.path.join(work, "bundle")
        os.mkdir(bundle, 0o700)
        numbers = (
            -1,
            # The sentry's task clock is not the host's: on a busy host it ran 2 s of "CPU" while the
            # cgroup billed 0.87 s, and its RLIMIT_CPU killed the code before the runner's watch
            # could name the limit. The cgroup is the limit that counts; inside, a backstop no
            # single-threaded loop reaches before the wall clock stops it.
            int(max(limits.cpu_seconds, limits.wall_seconds)) + 1,
            max(limits.tmp_bytes, limits.output_bytes),
            limits.open_files,
            limits.memory_bytes,
            limits.processes,
            0,
        )
        config = {
            "ociVersion": "1.0.0",
            "root": {"path": self.rootfs, "readonly": True},
            "hostname": "sandbox",
            "process": {
                "terminal": False,
                "user": {"uid": uid, "gid": uid},
                "args": [self.python, "-I", "-S", "-B", "/runtime-harness.py", *map(str, numbers)],
                "env": [
                    "HOME=/tmp",
                    "PATH=/usr/bin:/bin",
                    "LANG=C.UTF-8",
                    "OPENBLAS_NUM_THREADS=1",
                    "OMP_NUM_THREADS=1",
                ],
                "cwd": "/tmp",
                "noNewPrivileges": True,
                "capabilities": {
                    "bounding": [],
                    "effective": [],
                    "inheritable": [],
                    "permitted": [],
                    "ambient": [],
                },
            },
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]},
                {
                    "destination": "/runtime",
                    "type": "bind",
                    "source": self.runtime,
                    "options": ["rbind", "ro"],
                },
                {
                    "destination": "/runtime-harness.py",
                    "type": "bind",
                    "source": self.harness,
                    "options": ["bind", "ro"],
                },
                {
                    "destination": "/in",
                    "type": "bind",
                    "source": os.path.join(work, "in"),
                    "options": ["rbind", "ro"],
                },
                {
                    "destination": "/out",
                    "type": "bind",
                    "source": os.path.join(work, "out"),
                    "options": ["rbind", "rw"],
                },
                {"destination": "/report", "type": "bind", "source": report, "options": ["rbind", "rw"]},
                {
                    "destination": "/tmp",
                    "type": "tmpfs",
                    "source": "tmpfs",
                    "options": [f"size={limits.tmp_bytes}"],
                },
            ],
            "linux": {
                "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
                "seccomp": oci_seccomp(),
            },
        }
        with open(os.path.join(bundle, "config.json"), "w") as f:
            json.dump(config, f)
        return [
            "/bin/sh", "-c",
            'for f in $1; do echo $$ > "$f" || exit 125; done; shift; exec "$@"',
            "sh", " ".join(group.procs_files()),
            self.runsc, "--root", self.state, "--platform=ptrace", "--network=none", "--ignore-cgroups", "--oci-seccomp",
            "run", "--bundle", bundle, _container(work),
        ]  # fmt: skip

    def _host_processes(self, limits: Limits) -> int:
        # The sentry's and gofer's own threads count too (about a hundred with the ptrace
        # platform), besides one stub process per process of the code.
        return limits.processes + 192

    def _late_report(self, work: str) -> str | None:
        subprocess.run(
            [self.runsc, "--root", self.state, "delete", "--force", _container(work)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={},
        )
        try:
            with open(os.path.join(work, "report", "kind")) as f:
                kind = f.read().strip()
        except OSError:
            return None
        return kind or None
