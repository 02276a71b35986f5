"""Run an untrusted Python program in an operating-system sandbox: bubblewrap (``bwrap``).

``run_python`` runs one program in a fresh sandbox and returns a ``SandboxResult``. The boundary is
the kernel's: an unprivileged uid (65534, no capabilities, ``no_new_privs``) in new user, mount,
pid, network, IPC, UTS and cgroup namespaces; a root of read-only binds (system libraries, the
Python installation, the sources at ``/sandbox``) and a bounded tmpfs ``/tmp``; rlimits, a
``pids`` and a ``memory`` cgroup per run where reroll may make them; a seccomp filter
(``reroll.rewards.seccomp``). stdout, stderr and the results channel are pipes the parent reads
with a byte cap: the program holds no writable file on the host. docs/sandbox.md says what each
layer stops, how the tests measure it, and what is not promised; ``reroll.rewards.bwrap`` builds
the command line.

Defence in depth, not the boundary: an audit hook in the program's interpreter refuses process
creation, sockets, ``ctypes`` and file access outside ``/tmp``, ``/sandbox`` and the Python
installation. A program can switch it off from pure Python; ``tests/unit/test_sandbox_attacks*.py``
do, and check that the kernel still holds.

``sandbox="audit_hook"`` (the reward arg / tool option ``sandbox: audit_hook``) opts into the old,
weaker mode: the same child process, rlimits, cgroups, output pipes and audit hook, ``unshare -n``
where it works, no namespaces, uid change or seccomp filter; it logs a warning once per process.
Use it only for code you trust not to be hostile.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

from reroll.rewards.bwrap import bubblewrap_problem, bwrap_command, python_dirs, seccomp_fd, seccomp_problem
from reroll.rewards.cgroups import RunCgroup, cgroup_bases

__all__ = [
    "Limits", "Sandbox", "SandboxResult", "SandboxUnavailable", "bubblewrap_problem", "check_sandbox",
    "network_isolation", "run_python",
]  # fmt: skip

logger = logging.getLogger(__name__)

Sandbox = Literal["bubblewrap", "audit_hook"]

# Runs first in the child: set rlimits, install the audit hook, then run the program.
_GUARD = r"""
import json, os, resource, sys
_cfg = json.loads(sys.argv[1])
_root = os.path.realpath(_cfg["root"])
_allowed = tuple(os.path.realpath(p) for p in _cfg["read"])
_nproc = _cfg["nproc"]
if _nproc > 0 and _cfg["count_tasks"] and os.getuid() != 0:  # RLIMIT_NPROC counts all this user's tasks
    _uid = str(os.getuid())
    for _pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{_pid}/status") as _f:
                _st = dict(l.split(":", 1) for l in _f if ":" in l)
            _nproc += int(_st["Threads"]) if _st["Uid"].split()[0] == _uid else 0
        except (OSError, KeyError, ValueError):
            pass
for _lim, _val in (("RLIMIT_CPU", _cfg["cpu"]), ("RLIMIT_AS", _cfg["as"]), ("RLIMIT_FSIZE", _cfg["fsize"]),
                   ("RLIMIT_NPROC", _nproc)):
    if _val > 0:
        resource.setrlimit(getattr(resource, _lim), (_val, _val))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
import subprocess, _posixsubprocess  # fork_exec starts processes without an audit event: remove it
del _posixsubprocess.fork_exec
_NO_IMPORT = ("_posixsubprocess", "_ctypes")  # a fresh import would bring it back
_DEV = ("/dev/null", "/dev/urandom", "/dev/random")
_BLOCKED = ("os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
            "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "ctypes.dlopen", "ctypes.dlsym",
            "ctypes.cdata", "os.putenv", "os.unsetenv", "sys._current_frames")
_PATH_EVENTS = ("open", "os.listdir", "os.scandir", "os.remove", "os.rmdir", "os.rename",
                "os.mkdir", "os.chdir", "os.chmod", "os.chown", "os.link", "os.symlink",
                "os.truncate", "os.utime", "shutil.rmtree", "os.listxattr", "os.getxattr")
_rp, _sw, _isint = os.path.realpath, str.startswith, isinstance
def _inside(path):
    if _isint(path, int):
        return True
    p = _rp(os.fsdecode(path) if path is not None else ".")
    return p == _root or _sw(p, _root + os.sep) or p in _DEV or any(
        p == a or _sw(p, a + os.sep) for a in _allowed)
def _hook(event, args):
    if event == "import" and args[0] in _NO_IMPORT:
        raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
    if event in _BLOCKED or event.startswith("socket."):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event in _PATH_EVENTS and args:
        mode = args[1] if event == "open" and len(args) > 1 else None
        writing = _isint(mode, str) and any(c in mode for c in "wax+")
        if not _inside(args[0]) or (writing and not _inside_root(args[0])):
            raise PermissionError(f"sandbox: {event} {args[0]!r} is outside the sandbox")
def _inside_root(path):
    if _isint(path, int):
        return True
    p = _rp(os.fsdecode(path))
    return p == _root or _sw(p, _root + os.sep) or p in _DEV
import runpy, encodings.idna, site  # modules the program may need, loaded before the hook
site.setquit(), site.setcopyright(), site.sethelper()  # what -S skipped: exit(), quit(), help()
sys.path.extend(_cfg["site"])  # site-packages, without running their .pth files (100 ms of start-up)
_main = os.path.join(os.path.dirname(os.path.abspath(__file__)), "main.py")
sys.addaudithook(_hook)
del sys.argv[1:]
sys.argv[0] = "main.py"
runpy.run_path(_main, run_name=_cfg["run_name"])
"""


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot make its namespaces here; the message says how to fix it."""


@dataclass(frozen=True)
class Limits:
    """What one run may use."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 1024
    max_output_bytes: int = 1 << 20  # per stream: stdout, stderr, the results channel
    max_processes: int = 64  # tasks (processes and threads) the program may have; see docs/sandbox.md
    tmp_mb: int = 64  # size of the run's writable /tmp (bubblewrap)

    def __post_init__(self) -> None:
        bad = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if not getattr(self, f.name) > 0]
        if bad:
            raise ValueError(
                f"sandbox Limits: {', '.join(bad)}: each limit must be a number > 0 (seconds for cpu_s "
                "and wall_s, MB for memory_mb and tmp_mb)"
            )


@dataclass(frozen=True)
class SandboxResult:
    """One run's outcome. ``status``: ok | error (non-zero exit) | timeout | memory | output_limit.
    ``results``: what the program wrote to the file descriptor ``$REROLL_RESULTS_FD`` (capped)."""

    status: str
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    results: str = ""


def run_python(
    program: str,
    stdin: str = "",
    *,
    limits: Limits = Limits(),
    as_main: bool = True,
    sandbox: Sandbox = "bubblewrap",
) -> SandboxResult:
    """Run ``program`` (as ``main.py``) with ``stdin`` under ``limits`` in a fresh sandbox.

    ``as_main=False`` runs it as a module named ``solution`` (its ``if __name__ == "__main__"``
    block is skipped). ``sandbox``: see the module doc; ``"bubblewrap"`` raises
    ``SandboxUnavailable`` when bwrap cannot run here.
    """
    check_sandbox(sandbox)
    bwrap = sandbox == "bubblewrap"
    _warn_unenforced(bwrap)
    root = Path(tempfile.mkdtemp(prefix=f"reroll-sandbox-{os.getpid()}-"))
    cgroup = RunCgroup.make(
        limits.max_processes + _helper_tasks(sandbox), limits.memory_mb + limits.tmp_mb + 64
    )
    run = None
    try:
        src = _write_sources(root, program)
        footprint_bound = _footprint_bound(root, 0 if bwrap else limits.tmp_mb << 20)
        run = _Run(root, src, limits, bwrap, as_main)
        run.start(cgroup)
        outputs, timed_out, over = run.collect(stdin.encode(), limits.max_output_bytes, limits.wall_s)
        oom = bool(cgroup and cgroup.oom_killed())
        if cgroup is not None:
            cgroup.remove()  # kills what is left (audit_hook has no pid namespace) before the last read
        run.drain(outputs, limits.max_output_bytes)
        stdout, stderr, results = (b[: limits.max_output_bytes].decode(errors="replace") for b in outputs)
        returncode = _signal_code(run.proc.returncode) if bwrap else run.proc.returncode
        if over or max(map(len, outputs)) > limits.max_output_bytes:
            status = "output_limit"
        elif oom:
            status = "memory"
        else:
            status = _status(returncode, stderr, timed_out)
        grown = _footprint_excess(root, footprint_bound)
        if grown:
            status, stderr = "output_limit", f"{stderr}\nreroll: {grown}"
            logger.error("sandbox run refused: %s", grown)
        return SandboxResult(status, returncode, stdout, stderr, run.wall_s, results)
    finally:
        if run is not None:
            run.close()
        if cgroup is not None:
            cgroup.remove()
        shutil.rmtree(root, ignore_errors=True)


def _write_sources(root: Path, program: str) -> Path:
    """The program and its guard in ``root/src``, readable by the sandbox's uid (bound at /sandbox)."""
    src = root / "src"
    src.mkdir(mode=0o755)
    for name, text in (("main.py", program), ("_guard.py", _GUARD)):
        (src / name).write_text(text)
        (src / name).chmod(0o644)
    return src


def _guard_config(limits: Limits, bwrap: bool, root: Path, src: Path, as_main: bool) -> str:
    return json.dumps(
        {
            "root": "/tmp" if bwrap else str(root),
            "read": ["/sandbox" if bwrap else str(src), *python_dirs()],
            "cpu": limits.cpu_s,
            "as": limits.memory_mb << 20,
            "fsize": limits.max_output_bytes + 1,
            "nproc": limits.max_processes + (bwrap and os.geteuid() != 0),  # a user's bwrap init counts too
            "count_tasks": not bwrap,  # a bwrap run has its own user namespace: the count is its own
            "run_name": "__main__" if as_main else "solution",
            "site": [p for p in sys.path if "-packages" in p and os.path.isdir(p)],
        }
    )


class _Run:
    """One started sandbox: its process, the read ends of its stdout, stderr and results pipes, and
    (bubblewrap) a pidfd of its pid namespace's init."""

    def __init__(self, root: Path, src: Path, limits: Limits, bwrap: bool, as_main: bool) -> None:
        self.root, self.src, self.limits, self.bwrap, self.as_main = root, src, limits, bwrap, as_main
        self.init: int | None = None
        self.reads: list[int] = []
        self.wall_s = 0.0

    def start(self, cgroup: RunCgroup | None) -> None:
        pipes = [os.pipe() for _ in range(3)]  # stdout, stderr, results: (read, write)
        info_r, info_w = os.pipe() if self.bwrap else (-1, -1)
        filter_fd = seccomp_fd() if self.bwrap else -1
        home = "/tmp" if self.bwrap else str(self.root)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home, "TMPDIR": home}
        env["REROLL_RESULTS_FD"] = str(pipes[2][1])
        guard = _guard_config(self.limits, self.bwrap, self.root, self.src, self.as_main)
        python = [sys.executable, "-I", "-S", f"{'/sandbox' if self.bwrap else self.src}/_guard.py", guard]
        prefix = (
            bwrap_command(self.src, self.limits.tmp_mb, env, info_w, filter_fd)
            if self.bwrap
            else network_isolation()
        )
        cmd = [*(cgroup.join_command() if cgroup else []), *prefix, *python]
        reads = [r for r, _ in pipes]
        self.started = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                cmd, cwd=self.root, env={} if self.bwrap else env, stdin=subprocess.PIPE, stdout=pipes[0][1],
                stderr=pipes[1][1], pass_fds=[fd for fd in (pipes[2][1], info_w, filter_fd) if fd >= 0],
                start_new_session=True,
            )  # fmt: skip
        except BaseException:
            for fd in (*reads, info_r):
                if fd >= 0:
                    os.close(fd)
            raise
        finally:
            for fd in (*(w for _, w in pipes), info_w, filter_fd):  # only the run holds the write ends
                if fd >= 0:
                    os.close(fd)
        self.reads = reads
        if info_r >= 0:
            self.init = _namespace_init(self.proc, info_r)

    def collect(self, stdin: bytes, cap: int, wall_s: float) -> tuple[list[bytearray], bool, bool]:
        """Feed ``stdin`` and read the pipes until the run exits, a pipe passes ``cap`` bytes or
        ``wall_s`` is up; then kill what is left. (outputs, timed out, over the cap)."""
        outputs = [bytearray() for _ in self.reads]
        deadline = self.started + wall_s
        timed_out = over = False
        poller = select.poll()
        for fd in self.reads:
            os.set_blocking(fd, False)
            poller.register(fd, select.POLLIN)
        try:
            pidfd = os.pidfd_open(self.proc.pid)
            poller.register(pidfd, select.POLLIN)  # readable once the process has exited
        except OSError:  # Linux before 5.3: look every 50 ms instead
            pidfd = -1
        feed = _Feed(self.proc, stdin, poller)
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                ready = {fd for fd, _ in poller.poll(1000 * (left if pidfd >= 0 else min(left, 0.05)))}
                feed.step(ready)
                for i, fd in enumerate(self.reads):
                    if fd in ready:
                        over |= self._read(fd, outputs[i], cap, poller)
                if over or pidfd in ready or (pidfd < 0 and self.proc.poll() is not None):
                    break
        finally:
            if pidfd >= 0:
                os.close(pidfd)
            feed.close()
            _kill(self.proc, self.init)
            self.init = None
            self.wall_s = time.monotonic() - self.started
        return outputs, timed_out, over

    def _read(self, fd: int, into: bytearray, cap: int, poller: select.poll | None) -> bool:
        """Read what ``fd`` holds now into ``into``; True once past ``cap``."""
        while len(into) <= cap:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                return False
            if not chunk:
                if poller is not None:
                    poller.unregister(fd)
                return False
            into += chunk
        return True

    def drain(self, outputs: list[bytearray], cap: int) -> None:
        """Read what the run left in its pipes (its processes are dead), then close them."""
        for fd, into in zip(self.reads, outputs):
            self._read(fd, into, cap, None)
        self.close()

    def close(self) -> None:
        for fd in self.reads:
            os.close(fd)
        self.reads = []


class _Feed:
    """Writes stdin to the run without blocking, as the pipe takes it."""

    def __init__(self, proc: subprocess.Popen, data: bytes, poller: select.poll) -> None:
        self.pipe, self.data, self.poller = proc.stdin, memoryview(data), poller
        self.fd = self.pipe.fileno()
        os.set_blocking(self.fd, False)
        if self.data:
            poller.register(self.fd, select.POLLOUT)
        else:
            self.close()

    def step(self, ready: set[int]) -> None:
        if self.pipe is None or self.fd not in ready:
            return
        try:
            self.data = self.data[os.write(self.fd, self.data[: 1 << 16]) :]
        except BlockingIOError:
            return
        except OSError as e:  # the program closed its stdin or exited
            if e.errno not in (errno.EPIPE, errno.EBADF):
                raise
            self.data = self.data[:0]
        if not self.data:
            self.close()

    def close(self) -> None:
        if self.pipe is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.poller.unregister(self.fd)
            with contextlib.suppress(OSError):
                self.pipe.close()
            self.pipe = None


def _footprint(root: Path) -> list[tuple[int, int]]:
    """(bytes, bytes in allocated blocks) of each entry under ``root``, symlinks not followed."""
    sizes = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                sizes.append((st.st_size, st.st_blocks * 512))
    return sizes


def _footprint_bound(root: Path, allowance: int) -> tuple[int, int]:
    """Bounds on the run directory's total bytes and allocated bytes at the end of the run: what it
    holds now (the sources) plus ``allowance`` of each (audit_hook: the program's scratch files, as
    much as bubblewrap's /tmp, whose tmpfs counts pages as this counts blocks). Each entry of s
    bytes may end up taking ceil(s / block) blocks and one more for metadata, whatever stat says
    now (delayed allocation reports blocks late)."""
    block = os.statvfs(root).f_bsize
    entries = _footprint(root)
    blocks = sum(max(b, -(-s // block) * block) + block for s, b in entries)  # -(-s // b): ceil
    return sum(s for s, _ in entries) + allowance, blocks + allowance


def _footprint_excess(root: Path, bound: tuple[int, int]) -> str | None:
    entries = _footprint(root)
    size, blocks = sum(s for s, _ in entries), sum(b for _, b in entries)
    if size <= bound[0] and blocks <= bound[1]:
        return None
    return (
        f"the run directory {root} grew to {size} bytes, {blocks} bytes of blocks, past its bound of "
        f"{bound[0]} and {bound[1]}: the run is refused"
    )


def check_sandbox(sandbox: Sandbox) -> None:
    """Raise ``SandboxUnavailable`` (with the fix) if ``sandbox`` cannot run here; warn once for the weak one."""
    if sandbox == "audit_hook":
        _warn_audit_hook()
    elif sandbox == "bubblewrap":
        problem = bubblewrap_problem()
        if problem:
            raise SandboxUnavailable(problem)
    else:
        raise ValueError(f"unknown sandbox {sandbox!r}: use 'bubblewrap' or 'audit_hook'")


@functools.cache
def _warn_audit_hook() -> None:
    logger.warning(
        "sandbox 'audit_hook': programs run without an OS-level sandbox (no namespaces, no uid change; "
        "an audit hook the program itself can switch off). Use it only for code you trust; install "
        "bubblewrap (apt-get install bubblewrap) for the default sandbox, 'bubblewrap'"
    )


@functools.cache
def _warn_unenforced(bwrap: bool) -> None:
    """Say once per process which limits this machine does not let reroll enforce."""
    missing = [c for c in ("memory", "pids") if c not in cgroup_bases()]
    if missing:
        logger.warning(
            "sandbox: no %s cgroup can be made here (not root, and no delegated cgroup subtree): %s",
            " or ".join(missing),
            "; ".join(
                {
                    "memory": "memory is bounded per process only (RLIMIT_AS: memory_mb each, up to "
                    "max_processes processes), kernel memory and /tmp's pages not at all",
                    "pids": "tasks are bounded by RLIMIT_NPROC in the run's user namespace only",
                }[c]
                for c in missing
            ),
        )
    if bwrap and seccomp_problem():
        logger.warning(
            "sandbox: programs run without the seccomp filter (%s): io_uring, userfaultfd, bpf, "
            "perf_event_open, keyrings and file handles stay open to them",
            seccomp_problem(),
        )


def _helper_tasks(sandbox: Sandbox) -> int:
    """Processes of the sandbox itself in the run's pids cgroup: bwrap, the namespace's init, and as
    root the inner bwrap."""
    return 0 if sandbox == "audit_hook" else 3 if os.geteuid() == 0 else 2


def _namespace_init(proc: subprocess.Popen, info_r: int) -> int | None:
    """A pidfd of the sandbox's pid-namespace init (bwrap's child, from ``--info-fd``), or None."""
    data = b""
    with open(info_r, "rb", buffering=0) as info:
        while b"}" not in data and select.select([info], [], [], 10.0)[0]:
            chunk = info.read(4096)
            if not chunk:
                break
            data += chunk
    try:
        pid = int(json.loads(data)["child-pid"])
        pidfd = os.pidfd_open(pid)
    except (ValueError, KeyError, TypeError, OSError):
        return None
    with contextlib.suppress(OSError, IndexError, ValueError):  # the pid is still bwrap's child
        if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == proc.pid:
            return pidfd
    os.close(pidfd)
    return None


def _kill(proc: subprocess.Popen, init: int | None) -> None:
    """Kill the run: the namespace's init (the kernel then kills every process in it), then bwrap or the
    session. Returns once bwrap has exited, which it does only after the namespace's init."""
    if init is not None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(init, signal.SIGKILL)
        os.close(init)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _signal_code(returncode: int) -> int:
    """bwrap exits 128 + n when its command died of signal n: report it as ``-n`` like Popen."""
    return 128 - returncode if 128 < returncode < 128 + signal.NSIG else returncode


@functools.cache
def network_isolation() -> list[str]:
    """The ``audit_hook`` sandbox's command prefix for an empty network namespace here, or ``[]``."""
    if shutil.which("unshare") is None:
        return []
    for prefix in (["unshare", "-n", "--"], ["unshare", "-rn", "--"]):
        try:
            ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return prefix
    return []


def _status(returncode: int, stderr: str, timed_out: bool) -> str:
    if timed_out or returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout"
    if returncode == -signal.SIGXFSZ:
        return "output_limit"
    if returncode != 0 and "MemoryError" in stderr:
        return "memory"
    return "ok" if returncode == 0 else "error"
