"""The seccomp filter every bubblewrap sandbox runs under, compiled once per runner process.

Default allow, with a deny list: the sandbox's own namespaces and mounts already stop most of
these, the filter is the second wall behind them (and the first for the kernel's attack surface:
keyrings, bpf, perf, userfaultfd). Sockets other than AF_UNIX are refused, so even a sandbox
with a network namespace that went wrong has no TCP, UDP or raw socket to use.
"""

from __future__ import annotations

import errno
import functools
import socket
import tempfile

DENIED = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsmount",
    "fsconfig",
    "fspick",
    "mount_setattr",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "open_by_handle_at",
    "name_to_handle_at",
    "quotactl",
    "swapon",
    "swapoff",
    "reboot",
    "settimeofday",
    "clock_settime",
    "acct",
    "personality",
    "iopl",
    "ioperm",
    "lookup_dcookie",
    "vhangup",
    "syslog",
)
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)


@functools.cache
def compiled(*, allow_inet: bool = False) -> bytes:
    """The BPF program bwrap --seccomp loads. `allow_inet` exists only for the contract tests,
    which show that the network test fails without this wall."""
    import pyseccomp as seccomp  # the runner only: ctypes loads libseccomp

    f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    deny = seccomp.ERRNO(errno.EPERM)
    for name in DENIED:
        f.add_rule(deny, name)
    # clone with a namespace flag; clone3 passes its flags in memory a filter cannot read, so it
    # is refused as unknown and glibc falls back to clone.
    for flag in CLONE_NAMESPACE_FLAGS:
        f.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    if not allow_inet:
        f.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), "socket", seccomp.Arg(0, seccomp.NE, socket.AF_UNIX))
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()
