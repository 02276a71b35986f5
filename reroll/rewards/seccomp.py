"""The sandbox's seccomp filter: a classic BPF program assembled here, loaded by ``bwrap --seccomp FD``.

A denylist, as Flatpak's: the program keeps every system call a Python program or its C
extensions make, and loses the kernel surfaces most exploited in recent years and the ones that
only administrators need. Each denied call fails with ``EPERM``:

==============  ===========================================================================
group           system calls
==============  ===========================================================================
io_uring        io_uring_setup, io_uring_enter, io_uring_register
userfaultfd     userfaultfd
bpf             bpf
perf            perf_event_open
keys            add_key, request_key, keyctl
file_handles    name_to_handle_at, open_by_handle_at
ptrace          ptrace, process_vm_readv, process_vm_writev, kcmp
mount           mount, umount2, pivot_root, chroot, open_tree, move_mount, fsopen, fsconfig,
                fsmount, fspick, mount_setattr
namespaces      unshare, setns, and clone with any CLONE_NEW* flag
kexec           kexec_load, kexec_file_load
system          init_module, finit_module, delete_module, reboot, swapon, swapoff, acct,
                settimeofday, clock_settime, syslog, quotactl, quotactl_fd, vhangup,
                fanotify_init, iopl and ioperm (x86_64)
==============  ===========================================================================

Besides: ``clone3`` fails with ``ENOSYS`` (its flags live in memory a filter cannot read; glibc then
falls back to ``clone``, whose flags it can), ``socket``/``socketpair`` only make ``AF_UNIX``,
``AF_INET``, ``AF_INET6`` and ``AF_NETLINK`` sockets (others fail with ``EAFNOSUPPORT``: ``AF_ALG``'s
kernel crypto, ``AF_VSOCK`` to a hypervisor, which no network namespace separates), and a call
through another ABI fails with ``ENOSYS``: the filter first checks the audit architecture (an
x86_64 process can still enter the i386 table with ``int 0x80``) and, on x86_64, the x32 bit
(``nr | 0x40000000`` reaches the same kernel functions under other numbers).

Tables for x86_64 and aarch64 are built in (numbers from the kernel's ``unistd_64.h`` and
``asm-generic/unistd.h``; ``tests/unit/test_sandbox_attacks_seccomp.py`` compares them with the
headers where installed). Elsewhere ``filter_problem`` says why there is no filter.
"""

from __future__ import annotations

import errno
import platform
import struct
from pathlib import Path

DENIED: dict[str, tuple[str, ...]] = {
    group: tuple(names.split())
    for group, names in {
        "io_uring": "io_uring_setup io_uring_enter io_uring_register",
        "userfaultfd": "userfaultfd",
        "bpf": "bpf",
        "perf": "perf_event_open",
        "keys": "add_key request_key keyctl",
        "file_handles": "name_to_handle_at open_by_handle_at",
        "ptrace": "ptrace process_vm_readv process_vm_writev kcmp",
        "mount": "mount umount2 pivot_root chroot open_tree move_mount fsopen fsconfig fsmount fspick "
        "mount_setattr",
        "namespaces": "unshare setns",
        "kexec": "kexec_load kexec_file_load",
        "system": "init_module finit_module delete_module reboot swapon swapoff acct settimeofday "
        "clock_settime syslog quotactl quotactl_fd vhangup fanotify_init iopl ioperm",
    }.items()
}
SOCKET_FAMILIES = (1, 2, 10, 16)  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK
CLONE_NEW_FLAGS = 0x7E020000  # NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET (NEWTIME is clone3's)
X32_SYSCALL_BIT = 0x40000000

# System call numbers: x86_64 from asm/unistd_64.h, aarch64 from asm-generic/unistd.h.
_X86_64 = {
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "userfaultfd": 323,
    "bpf": 321, "perf_event_open": 298, "add_key": 248, "request_key": 249, "keyctl": 250,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "ptrace": 101, "process_vm_readv": 310,
    "process_vm_writev": 311, "kcmp": 312, "mount": 165, "umount2": 166, "pivot_root": 155,
    "chroot": 161, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "mount_setattr": 442, "unshare": 272, "setns": 308, "kexec_load": 246,
    "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176,
    "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163, "settimeofday": 164,
    "clock_settime": 227, "syslog": 103, "quotactl": 179, "quotactl_fd": 443, "vhangup": 153,
    "fanotify_init": 300, "iopl": 172, "ioperm": 173,
    "clone": 56, "clone3": 435, "socket": 41, "socketpair": 53,
}  # fmt: skip
_AARCH64 = {
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "userfaultfd": 282,
    "bpf": 280, "perf_event_open": 241, "add_key": 217, "request_key": 218, "keyctl": 219,
    "name_to_handle_at": 264, "open_by_handle_at": 265, "ptrace": 117, "process_vm_readv": 270,
    "process_vm_writev": 271, "kcmp": 272, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442, "unshare": 97, "setns": 268, "kexec_load": 104, "kexec_file_load": 294,
    "init_module": 105, "finit_module": 273, "delete_module": 106, "reboot": 142, "swapon": 224,
    "swapoff": 225, "acct": 89, "settimeofday": 170, "clock_settime": 112, "syslog": 116,
    "quotactl": 60, "quotactl_fd": 443, "vhangup": 58, "fanotify_init": 262,
    "clone": 220, "clone3": 435, "socket": 198, "socketpair": 199,
}  # fmt: skip
# machine -> (AUDIT_ARCH_*, syscall numbers, whether the x32 bit exists)
ARCHES: dict[str, tuple[int, dict[str, int], bool]] = {
    "x86_64": (0xC000003E, _X86_64, True),
    "aarch64": (0xC00000B7, _AARCH64, False),
}

# classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h)
_LD_ABS_W, _JEQ, _JSET, _RET = 0x20, 0x15, 0x45, 0x06
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data (args[0]'s low half: little-endian)


def machine() -> str:
    """The architecture whose table applies to this interpreter's system calls."""
    name = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(name, name)


def filter_problem(arch: str | None = None) -> str | None:
    """Why no filter can be built for ``arch`` (default: here), else None."""
    arch = arch or machine()
    if arch not in ARCHES:
        return f"no seccomp table for {arch!r} (built in: {', '.join(ARCHES)})"
    if struct.calcsize("P") != 8:
        return f"this interpreter is 32-bit on a 64-bit {arch} kernel; the filter covers 64-bit processes"
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        status = "Seccomp:"  # no /proc to ask: let bwrap find out
    if "Seccomp:" not in status:
        return "the kernel has no seccomp (CONFIG_SECCOMP is off)"
    return None


def filter_program(arch: str | None = None) -> bytes:
    """The filter for ``arch`` (default: here) as ``struct sock_filter[]``, what ``bwrap --seccomp``
    reads. Raises ``ValueError`` where ``filter_problem`` names a problem with the architecture."""
    arch = arch or machine()
    if arch not in ARCHES:
        raise ValueError(filter_problem(arch))
    audit_arch, nrs, x32 = ARCHES[arch]
    eperm, enosys = RET_ERRNO | errno.EPERM, RET_ERRNO | errno.ENOSYS
    prog = [(_LD_ABS_W, 0, 0, _ARCH), (_JEQ, 1, 0, audit_arch), (_RET, 0, 0, enosys), (_LD_ABS_W, 0, 0, _NR)]
    if x32:
        prog += [(_JSET, 0, 1, X32_SYSCALL_BIT), (_RET, 0, 0, enosys)]
    for name in sorted({n for names in DENIED.values() for n in names if n in nrs}, key=nrs.get):
        prog += [(_JEQ, 0, 1, nrs[name]), (_RET, 0, 0, eperm)]
    prog += [(_JEQ, 0, 1, nrs["clone3"]), (_RET, 0, 0, enosys)]
    # clone: refused if its flags (args[0]) ask for a new namespace
    prog += [(_JEQ, 0, 4, nrs["clone"]), (_LD_ABS_W, 0, 0, _ARG0), (_JSET, 0, 1, CLONE_NEW_FLAGS)]
    prog += [(_RET, 0, 0, eperm), (_RET, 0, 0, RET_ALLOW)]
    # socket, socketpair: only the families in SOCKET_FAMILIES (args[0])
    n = len(SOCKET_FAMILIES)
    for name in ("socket", "socketpair"):
        prog += [(_JEQ, 0, n + 3, nrs[name]), (_LD_ABS_W, 0, 0, _ARG0)]
        prog += [(_JEQ, n - i, 0, family) for i, family in enumerate(SOCKET_FAMILIES)]
        prog += [(_RET, 0, 0, RET_ERRNO | errno.EAFNOSUPPORT), (_RET, 0, 0, RET_ALLOW)]
    prog.append((_RET, 0, 0, RET_ALLOW))
    return b"".join(struct.pack("=HBBI", *insn) for insn in prog)
