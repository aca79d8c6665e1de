"""A cgroup (v1) per execution: memory, pids and CPU quota, with cpuacct for the CPU bill.

Written as root under /sys/fs/cgroup/<controller>/agentsandbox/<name>. The sandbox never sees
these files (it has its own mount and cgroup namespace); the runner reads the counters after the
last process is gone, so usage is measured from outside, not reported by the code.
"""

from __future__ import annotations

import os
import signal
import time

ROOT = "/sys/fs/cgroup"
PARENT = "agentsandbox"
CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")


def available() -> str | None:
    """Why cgroup v1 cannot be used here, or None."""
    for controller in CONTROLLERS:
        path = os.path.join(ROOT, controller)
        if not os.path.isfile(os.path.join(path, "cgroup.procs")):
            return f"no cgroup v1 {controller} controller at {path}"
        if not os.access(path, os.W_OK):
            return f"{path} is not writable (the runner must run as root)"
    return None


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def _read(path: str, default: str = "") -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return default


class Cgroup:
    def __init__(self, name: str):
        self.name = name
        self.paths = {c: os.path.join(ROOT, c, PARENT, name) for c in CONTROLLERS}

    def create(self, *, memory_bytes: int, processes: int, cores: float) -> None:
        for path in self.paths.values():
            os.makedirs(path, exist_ok=True)
        memory = self.paths["memory"]
        _write(os.path.join(memory, "memory.limit_in_bytes"), memory_bytes)
        memsw = os.path.join(memory, "memory.memsw.limit_in_bytes")
        if os.path.exists(memsw):
            _write(memsw, memory_bytes)
        _write(os.path.join(memory, "memory.swappiness"), 0)
        _write(os.path.join(self.paths["pids"], "pids.max"), processes)
        cpu = self.paths["cpu"]
        _write(os.path.join(cpu, "cpu.cfs_period_us"), 100_000)
        _write(os.path.join(cpu, "cpu.cfs_quota_us"), max(1000, int(100_000 * cores)))

    def procs_files(self) -> list[str]:
        return [os.path.join(p, "cgroup.procs") for p in self.paths.values()]

    def pids(self) -> list[int]:
        return [int(x) for x in _read(os.path.join(self.paths["pids"], "cgroup.procs")).split()]

    def cpu_seconds(self) -> float:
        return int(_read(os.path.join(self.paths["cpuacct"], "cpuacct.usage"), "0") or 0) / 1e9

    def memory_peak(self) -> int:
        return int(_read(os.path.join(self.paths["memory"], "memory.max_usage_in_bytes"), "0") or 0)

    def oom_killed(self) -> bool:
        control = _read(os.path.join(self.paths["memory"], "memory.oom_control"))
        for line in control.splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value) > 0
        return int(_read(os.path.join(self.paths["memory"], "memory.failcnt"), "0") or 0) > 0

    def pids_refused(self) -> bool:
        events = _read(os.path.join(self.paths["pids"], "pids.events"))
        return any(line.split()[1] != "0" for line in events.splitlines() if line.startswith("max "))

    def kill_all(self, *, deadline: float) -> bool:
        """SIGKILL every process left until none is; True when the cgroup is empty."""
        while time.monotonic() < deadline:
            pids = self.pids()
            if not pids:
                return True
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.005)
        return not self.pids()

    def remove(self, *, tries: int = 200) -> None:
        for path in self.paths.values():
            for _ in range(tries):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.005)


def remove_stale() -> None:
    """Empty groups left by processes that are gone (a runner killed before its sweep)."""
    parent = os.path.join(ROOT, CONTROLLERS[0], PARENT)
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        pid, dash, _ = name.partition("-")
        if not dash or not pid.isdigit() or int(pid) == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        group = Cgroup(name)
        if not group.pids():
            group.remove(tries=1)
