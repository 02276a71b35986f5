"""The sandbox's seccomp filter: every denied group, live in the sandbox and in the filter's own logic.

Three checks per group, each able to fail on its own:

- the filter bwrap loads answers ``EPERM`` for every call of the group, on x86_64 and aarch64 (a
  small classic-BPF interpreter below runs the assembled program on ``struct seccomp_data``);
- in the sandbox, with the filter loaded (``/proc/self/status``), each call fails with ``EPERM``;
- the same calls in the same sandbox without the filter: where the kernel would answer otherwise
  (arguments are chosen so that it does: a bad descriptor, a NULL pointer, unknown flags), it did.
  Calls that check a capability first (``kexec_load``) answer ``EPERM`` either way; for those the
  first two checks carry the test.

The arguments never do anything on success: bad descriptors, NULL pointers and invalid flags.
"""

from __future__ import annotations

import errno
import re
import struct
from pathlib import Path

import pytest
from sandbox_attack import HOOK_OFF, assert_ran_inside

from reroll.rewards import bwrap, seccomp
from reroll.rewards import sandbox as sb
from reroll.rewards.seccomp import (
    ARCHES,
    CLONE_NEW_FLAGS,
    DENIED,
    RET_ALLOW,
    RET_ERRNO,
    X32_SYSCALL_BIT,
    filter_program,
    machine,
)

needs_bwrap = pytest.mark.skipif(
    bwrap.bubblewrap_problem() is not None, reason=f"no bubblewrap sandbox here: {bwrap.bubblewrap_problem()}"
)
needs_filter = pytest.mark.skipif(
    bwrap.bubblewrap_problem() is not None or bwrap.seccomp_problem() is not None,
    reason=f"no seccomp-filtered sandbox here: {bwrap.bubblewrap_problem() or bwrap.seccomp_problem()}",
)

NRS = ARCHES[machine()][1] if machine() in ARCHES else {}
DENY = RET_ERRNO | errno.EPERM
# (label, system call, its arguments, whether the kernel answers other than EPERM without the filter)
CALLS: dict[str, list[tuple[str, str, tuple[int, ...], bool]]] = {
    "io_uring": [
        ("io_uring_setup", "io_uring_setup", (0, 0), False),  # EINVAL, or EPERM where sysctl-disabled
        ("io_uring_enter", "io_uring_enter", (-1, 0, 0, 0, 0, 0), True),  # EBADF
        ("io_uring_register", "io_uring_register", (-1, 0, 0, 0), True),  # EBADF
    ],
    "userfaultfd": [("userfaultfd", "userfaultfd", (1 | 0x80000000,), True)],  # user-mode-only: EINVAL
    "bpf": [("bpf", "bpf", (0, 0, 1 << 20), True)],  # attr size past a page: E2BIG
    "perf": [("perf_event_open", "perf_event_open", (0, 0, -1, -1, 0), True)],  # NULL attr: EFAULT
    "keys": [
        ("add_key", "add_key", (0, 0, 0, 0, 0), True),  # EFAULT
        ("request_key", "request_key", (0, 0, 0, 0), True),  # EFAULT
        ("keyctl", "keyctl", (99999, 0, 0, 0, 0), True),  # EOPNOTSUPP
    ],
    "file_handles": [
        ("name_to_handle_at", "name_to_handle_at", (-1, 0, 0, 0, 0xFFFF), True),  # EINVAL
        ("open_by_handle_at", "open_by_handle_at", (-1, 0, 0), False),  # capability first
    ],
    "ptrace": [
        ("ptrace", "ptrace", (16, 0x3FFFFFFF, 0, 0), True),  # PTRACE_ATTACH to no such pid: ESRCH
        ("process_vm_readv", "process_vm_readv", (0x3FFFFFFF, 0, 0, 0, 0, 1), True),  # flags: EINVAL
        ("kcmp", "kcmp", (0x3FFFFFFF, 0x3FFFFFFF, 0, 0, 0), True),  # ESRCH
    ],
    "mount": [
        ("mount", "mount", (0, 0, 0, 0, 0), True),  # NULL target: EFAULT
        ("umount2", "umount2", (0, 0xFF00), True),  # flags: EINVAL
        ("chroot", "chroot", (0,), True),  # EFAULT
        ("open_tree", "open_tree", (-1, 0, 0xFFFFFFFF), True),  # EINVAL
        ("pivot_root", "pivot_root", (0, 0), False),  # capability first
        ("fsopen", "fsopen", (0, 0), False),  # capability first
    ],
    "namespaces": [
        ("unshare", "unshare", (1,), True),  # CSIGNAL bits: EINVAL
        ("setns", "setns", (-1, 0), True),  # EBADF
        ("clone NEWUSER", "clone", (0x10000000 | 17, 0, 0, 0, 0), True),  # bwrap --disable-userns: ENOSPC
    ],
    "kexec": [
        ("kexec_load", "kexec_load", (0, 0, 0, 0), False),  # capability first
        ("kexec_file_load", "kexec_file_load", (-1, -1, 0, 0, 0), False),  # capability first
    ],
    "system": [
        ("settimeofday", "settimeofday", (0, 0), False),  # both NULL: a no-op, or EPERM (LSM first)
        ("clock_settime", "clock_settime", (0, 0), True),  # NULL time: EFAULT
        ("reboot", "reboot", (0, 0, 0, 0), False),  # capability first
    ],
}
# Answered with another errno than EPERM, or allowed: (label, call, args, errno with the filter)
OTHER = [
    ("clone3", "clone3", (0, 0), errno.ENOSYS),  # glibc then falls back to clone
    ("socket AF_ALG", "socket", (38, 5, 0), errno.EAFNOSUPPORT),  # the kernel's crypto API
    ("socket AF_VSOCK", "socket", (40, 1, 0), errno.EAFNOSUPPORT),  # a hypervisor's, outside any netns
    ("socket AF_INET", "socket", (2, 2, 0), 0),  # allowed: a socket in the sandbox's own netns
    ("socketpair AF_UNIX", "socketpair", (1, 1, 0, 0), errno.EFAULT),  # allowed (NULL fds: EFAULT)
]

PROBE = """
import ctypes, errno as E, mmap, platform, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
status = dict(l.split(":", 1) for l in open("/proc/self/status"))
print("seccomp", status["Seccomp"].strip(), status.get("Seccomp_filters", "?").strip(), file=sys.stderr)
def call(label, nr, *args):
    rc = libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) for a in args))
    if rc == 0 and label.startswith("clone"):
        os._exit(0)  # a child, had the kernel made one
    err = ctypes.get_errno() if rc < 0 else 0
    print("call", label.replace(" ", "_"), E.errorcode.get(err, "ok"), file=sys.stderr)
for label, nr, args in CALLS:
    call(label, nr, *args)
if platform.machine() == "x86_64":
    call("x32 getpid", 39 | 0x40000000)
    # i386 getpid through int 0x80: mov eax, 20; int 0x80; ret (eax holds -errno or the pid)
    page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))
    fn = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
    rc = fn()
    print("call i386_getpid", E.errorcode.get(-rc, "?") if rc < 0 else "ok", file=sys.stderr)
pid = os.fork()  # clone without namespace flags
if pid == 0:
    os._exit(7)
print("fork", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), file=sys.stderr)
t = threading.Thread(target=print, args=("thread ran",), kwargs={"file": sys.stderr}); t.start(); t.join()
"""


def _probe_program() -> str:
    calls = [(label, NRS[name], args) for group in CALLS.values() for label, name, args, _ in group]
    calls += [(label, NRS[name], args) for label, name, args, _ in OTHER]
    return f"{HOOK_OFF}\nCALLS = {calls!r}\n{PROBE}"


@pytest.fixture(scope="module")
def probed() -> dict[bool, dict[str, str]]:
    """The probe's answers with the filter (True) and, in the same sandbox, without it (False)."""
    answers = {}
    for filtered in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            if not filtered:
                mp.setattr(sb, "seccomp_fd", lambda: -1)
            r = sb.run_python(_probe_program(), limits=sb.Limits(cpu_s=5, wall_s=20.0, memory_mb=256))
        assert_ran_inside(r)
        assert "fork 7" in r.stderr and "thread ran" in r.stderr, r.stderr  # the usual calls still work
        lines = [line.split() for line in r.stderr.splitlines()]
        answers[filtered] = {w[1]: w[2] for w in lines if w[0] == "call"}
        answers[filtered]["_seccomp"] = next(" ".join(w[1:]) for w in lines if w and w[0] == "seccomp")
    return answers


def run_filter(program: bytes, nr: int, arch: int, args: tuple[int, ...] = ()) -> int:
    """Classic BPF, as the kernel runs it on ``struct seccomp_data`` (the four opcodes the filter uses)."""
    args64 = [a & (2**64 - 1) for a in (*args, 0, 0, 0, 0, 0, 0)[:6]]
    data = struct.pack("=iIQ6Q", nr, arch, 0, *args64)
    insns = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == 0x20:  # ld [k]
            acc = struct.unpack_from("=I", data, k)[0]
        elif code == 0x15:  # jeq #k
            pc += jt if acc == k else jf
        elif code == 0x45:  # jset #k
            pc += jt if acc & k else jf
        elif code == 0x06:  # ret #k
            return k
        else:
            raise AssertionError(f"opcode {code:#x} not expected in the filter")


@pytest.mark.parametrize("arch", sorted(ARCHES))
def test_the_filter_decides_each_call_on_both_architectures(arch):
    program, (audit, nrs, x32) = filter_program(arch), ARCHES[arch]
    for name in {n for names in DENIED.values() for n in names if n in nrs}:
        assert run_filter(program, nrs[name], audit) == DENY, name
    for allowed in ("socket", "clone"):  # an AF_INET socket; a fork
        assert run_filter(program, nrs[allowed], audit, (2 if allowed == "socket" else 17,)) == RET_ALLOW
    assert run_filter(program, nrs["clone"], audit, (0x10000000 | 17,)) == DENY  # CLONE_NEWUSER
    assert run_filter(program, nrs["clone"], audit, (CLONE_NEW_FLAGS,)) == DENY
    assert run_filter(program, nrs["clone3"], audit) == RET_ERRNO | errno.ENOSYS
    assert run_filter(program, nrs["socket"], audit, (38,)) == RET_ERRNO | errno.EAFNOSUPPORT
    assert run_filter(program, nrs["socketpair"], audit, (40,)) == RET_ERRNO | errno.EAFNOSUPPORT
    assert run_filter(program, 0, 0x40000003) == RET_ERRNO | errno.ENOSYS  # AUDIT_ARCH_I386
    assert run_filter(program, 0, audit) == RET_ALLOW  # read / io_setup: a call not in the list
    if x32:
        assert run_filter(program, nrs["socket"] | X32_SYSCALL_BIT, audit, (2,)) == RET_ERRNO | errno.ENOSYS


@pytest.mark.parametrize(
    "header, arch", [("x86_64-linux-gnu/asm/unistd_64.h", "x86_64"), ("asm-generic/unistd.h", "aarch64")]
)
def test_syscall_numbers_match_the_kernel_headers(header, arch):
    path = Path("/usr/include") / header
    if not path.exists():
        pytest.skip(f"{path} is not installed (linux-libc-dev)")
    defined = {m[1]: int(m[2]) for m in re.finditer(r"#define __NR(?:3264)?_(\w+)\s+(\d+)", path.read_text())}
    assert {name: defined.get(name) for name in ARCHES[arch][1]} == ARCHES[arch][1]


@needs_filter
@pytest.mark.parametrize("group", sorted(CALLS))
def test_denied_group_fails_with_eperm_in_the_sandbox(group, probed):
    program, (audit, _, _) = filter_program(), ARCHES[machine()]
    assert probed[True]["_seccomp"].startswith("2")  # mode 2: a filter is loaded
    assert not probed[False]["_seccomp"].startswith("2")  # and without it, none: the control
    for name in DENIED[group]:
        if name in NRS:
            assert run_filter(program, NRS[name], audit) == DENY, name
    for label, _, _, differs in CALLS[group]:
        key = label.replace(" ", "_")
        assert probed[True][key] == "EPERM", (label, probed[True][key])
        if differs:  # without the filter the kernel answers otherwise: the filter is what said EPERM
            assert probed[False][key] != "EPERM", (label, probed[False][key])


@needs_filter
def test_clone3_other_abis_and_socket_families(probed):
    for label, _, _, code in OTHER:
        key = label.replace(" ", "_")
        assert probed[True][key] == errno.errorcode.get(code, "ok"), (label, probed[True][key])
    assert probed[False]["clone3"] != "ENOSYS"  # the kernel has clone3 (5.3+): the filter hid it
    if machine() == "x86_64":  # another ABI's table: refused whether this kernel has it or not
        assert probed[True]["x32_getpid"] == "ENOSYS" and probed[True]["i386_getpid"] == "ENOSYS"


@needs_bwrap
def test_without_a_table_for_the_machine_the_run_goes_on_and_says_what_is_open(monkeypatch, caplog):
    """Another architecture (riscv64 here, pretended): no filter, a warning naming what stays open,
    and the program still runs in the sandbox."""
    monkeypatch.setattr(seccomp, "machine", lambda: "riscv64")
    bwrap._probe.cache_clear()
    sb._warn_unenforced.cache_clear()
    try:
        assert "no seccomp table for 'riscv64'" in (bwrap.seccomp_problem() or "")
        assert bwrap.seccomp_fd() == -1
        with caplog.at_level("WARNING", logger=sb.__name__):
            r = sb.run_python(HOOK_OFF + 'print(open("/proc/self/status").read().count("Seccomp:\\t0"))')
        assert_ran_inside(r)
        assert r.stdout == "1\n"  # ran, unfiltered
        assert any("without the seccomp filter" in m and "io_uring" in m for m in caplog.messages)
    finally:
        monkeypatch.undo()
        bwrap._probe.cache_clear()
        sb._warn_unenforced.cache_clear()


@needs_bwrap
def test_a_filter_bwrap_cannot_load_is_reported_and_left_out(monkeypatch):
    """A kernel or bwrap that refuses the filter (here: a program the kernel rejects) must not fail
    every run: the probe finds out once, ``seccomp_problem`` says why, runs go on without it."""
    monkeypatch.setattr(bwrap, "filter_program", lambda: struct.pack("=HBBI", 0xFFFF, 0, 0, 0))
    bwrap._probe.cache_clear()
    try:
        assert "bwrap could not load the seccomp filter" in (bwrap.seccomp_problem() or "")
        assert bwrap.bubblewrap_problem() is None and bwrap.seccomp_fd() == -1
        r = sb.run_python(HOOK_OFF + "print(6 * 7)")
        assert_ran_inside(r)
        assert r.stdout == "42\n"
    finally:
        monkeypatch.undo()
        bwrap._probe.cache_clear()
