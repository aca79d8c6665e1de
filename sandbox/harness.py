"""Runs inside the sandbox, before the model's code: sets the rlimits (the second line behind the
cgroup), runs the code read from stdin as __main__, and reports the kind of limit an exception
shows on the report fd. Arguments are plain numbers and imports are few: every millisecond here is
start latency (json and traceback alone cost more than bwrap). The runner trusts none of it for usage or isolation; the cgroup's counters win.

Standard library only, and nothing of the platform: this file is all of the project the
sandbox sees.
"""

import errno
import os
import resource
import sys


def _limit_of(exc):
    if isinstance(exc, MemoryError):
        return "memory"
    if isinstance(exc, RuntimeError) and "thread" in str(exc):
        return "processes"
    if isinstance(exc, OSError):
        if exc.errno == errno.EAGAIN and isinstance(exc, BlockingIOError):
            return "processes"
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            return "open_files"
        if exc.errno == errno.EFBIG:
            return "file_size"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            # a write() error names no file: a full /out is the output cap, anything else /tmp
            out = os.statvfs("/out")
            return "output" if out.f_bavail == 0 or out.f_favail == 0 else "file_size"
    return None


def main():
    report_fd, cpu, file_size, open_files, memory, processes, skip = (int(a) for a in sys.argv[1:8])
    sys.path.insert(0, "/runtime/site-packages")
    code = sys.stdin.read()
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    rlimits = (
        ()
        if skip
        else (
            (resource.RLIMIT_CPU, cpu),
            (resource.RLIMIT_FSIZE, file_size),
            (resource.RLIMIT_NOFILE, open_files),
            (resource.RLIMIT_CORE, 0),
            # Address space well above the cgroup's memory: numpy and glibc reserve far more than
            # they touch, and the cgroup is the limit that counts.
            (resource.RLIMIT_AS, memory * 4 + (2 << 30)),
            (resource.RLIMIT_NPROC, processes * 2),
        )
    )
    for which, value in rlimits:
        # CPU's hard limit a second above the soft one: at the soft limit the code gets SIGXCPU,
        # which the runner reads as "cpu"; at equal limits the kernel sends SIGKILL, which names nothing.
        resource.setrlimit(which, (value, value + 1 if which == resource.RLIMIT_CPU else value))
    if report_fd >= 0:
        os.set_inheritable(report_fd, False)
    kind = None
    status = 0
    if report_fd >= 0:
        # One byte when the code starts: the runner measures its start latency from outside.
        os.write(report_fd, b"+")
    try:
        exec(compile(code, "<run_python>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:
        kind = _limit_of(exc)
        status = 1
        try:
            import traceback  # only on a failure: its imports cost milliseconds of every start

            traceback.print_exc()
        except BaseException:
            pass
    try:
        sys.stdout.flush()
    except BaseException as exc:
        kind = kind or _limit_of(exc)
    try:
        if report_fd < 0:  # gVisor passes no extra descriptor: a file in the report directory
            with open("/report/kind", "w") as f:
                f.write(kind or "")
        else:
            os.write(report_fd, (kind or "").encode())
    except BaseException:
        pass
    os._exit(status & 0xFF)


main()
