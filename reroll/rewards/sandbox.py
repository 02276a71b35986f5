"""Run an untrusted Python program in an operating-system sandbox: bubblewrap (``bwrap``).

The boundary is the kernel's. Each run of ``run_python`` (``sandbox="bubblewrap"``, the default):

- **User** runs as an unprivileged uid with no capabilities and ``no_new_privs``, in its own user
  namespace, where it cannot make another one (``bwrap --disable-userns``). As root, bwrap first
  builds the sandbox (root may bind the interpreter from ``/root``), then ``setpriv`` sets the real
  host uid and gid to 65534 (nobody), clears all capability sets and sets ``no_new_privs``, and a
  second, unprivileged bwrap makes the user namespace (65534 inside and outside). Not bwrap's own
  ``--uid 65534`` as root: it maps 65534 to host uid 0, and a host-root process could open
  ``/proc/sys/kernel/core_pattern`` for writing. As another user the program runs as that user's uid
  (65534 inside).
- **Namespaces** new mount, pid, network (its own loopback only), IPC, UTS and cgroup namespaces.
  The host's processes, network and System V IPC cannot be named, signalled or entered (``setns``
  needs capabilities the program does not have); ``/proc/sys`` is not writable by its uid.
- **Files** the root is an empty tmpfs. Read-only binds of only what the interpreter needs: the
  system library directories (``/usr/lib``, ``/lib*``), the Python installation(s) and their
  site-packages, and the run's two source files at ``/sandbox``. No ``/etc``, ``/home``, ``/root``,
  host ``/tmp`` or the repository. ``/proc`` is the sandbox's own; ``/dev`` holds only null, zero,
  full, random, urandom and tty. The only writable place is ``/tmp`` (the working directory and
  ``HOME``), a tmpfs of ``Limits.tmp_mb``; it vanishes with the run. The interpreter starts with
  ``-I -S``: site-packages are on ``sys.path`` but their ``.pth`` files are not run (they cost
  100 ms a start here, more than bwrap).
- **Processes** the pid namespace's init is bwrap; when it exits the kernel kills every process
  left in the namespace (``setsid`` or double-forked ones too), and ``run_python`` returns only
  after it has exited. At the wall deadline reroll kills that init (by pidfd). ``RLIMIT_NPROC =
  max_processes`` counts the tasks (threads too) of the run's own user namespace. Where reroll may
  make cgroups (root, or a delegated subtree), each run also gets its own ``pids`` cgroup
  (``max_processes`` plus bwrap's own processes) and ``memory`` cgroup (``memory_mb + tmp_mb`` plus
  64 MB, which bounds tmpfs pages too), named after the reward worker's pid and removed afterwards.
- **Resources** ``RLIMIT_CPU``, ``RLIMIT_AS`` (``MemoryError`` in the program), no core dumps,
  ``RLIMIT_FSIZE = max_output_bytes + 1`` per file. stdout, stderr and the results channel go to
  files the parent opened (the program only holds their descriptors), so the host disk takes at
  most three times ``max_output_bytes`` per run; only ``max_output_bytes`` of each are read back.
- **Environment** the program gets only ``PATH``, ``HOME``, ``TMPDIR``, ``LANG`` and
  ``REROLL_RESULTS_FD``, never the reward worker's environment.

Defence in depth, not the boundary: an audit hook in the program's interpreter refuses process
creation, sockets, ``ctypes`` and file access outside ``/tmp``, ``/sandbox`` and the Python
installation. A program can switch it off from pure Python (by walking frames to it); the tests
in ``tests/unit/test_sandbox_attacks.py`` do, and check that the kernel still holds. No seccomp
filter is installed. The program can read the Python installation and system libraries, and the
source of its own harness, so a result written to the results channel (``code_tests``' call-style
cases) could be forged by a policy that learned to; stdin/stdout cases compare what the process printed.

Why bubblewrap: a small helper, not setuid on current distributions, maintained by the containers
project for Flatpak and packaged everywhere (``apt-get install bubblewrap``; 0.8 or newer for
``--size`` and ``--disable-userns``), whose command line states each mount and namespace, and which
adds about 15 ms a run here. nsjail does as much and more (seccomp policies, cgroups) but is not
in Debian 12 and would need a build from source; firejail is packaged but setuid-root with a large
profile language; raw ``unshare``/``mount`` calls would re-implement bwrap's pivot_root, mount and
capability-dropping order, where mistakes are easy and silent. When bwrap is missing, too old or
cannot make namespaces, ``run_python`` raises ``SandboxUnavailable`` naming the fix. ``sandbox="audit_hook"`` (the reward arg / tool option
``sandbox: audit_hook``) opts into the old, weaker mode: the same child process, rlimits, cgroups
and audit hook, ``unshare -n`` where it works, no namespaces or uid change; it logs a warning
once per process. Use it only for code you trust not to be hostile.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from reroll.rewards.cgroups import RunCgroup

logger = logging.getLogger(__name__)

Sandbox = Literal["bubblewrap", "audit_hook"]
NOBODY = 65534

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
    max_output_bytes: int = 1 << 20
    max_processes: int = 64  # tasks (processes and threads) the program may have; see the module doc
    tmp_mb: int = 64  # size of the run's writable /tmp (bubblewrap)


@dataclass(frozen=True)
class RunResult:
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
) -> RunResult:
    """Run ``program`` (as ``main.py``) with ``stdin`` under ``limits`` in a fresh sandbox.

    ``as_main=False`` runs it as a module named ``solution`` (its ``if __name__ == "__main__"``
    block is skipped). ``sandbox``: see the module doc; ``"bubblewrap"`` raises
    ``SandboxUnavailable`` when bwrap cannot run here.
    """
    check_sandbox(sandbox)
    bwrap = sandbox == "bubblewrap"
    root = Path(tempfile.mkdtemp(prefix=f"reroll-sandbox-{os.getpid()}-"))
    cgroup = RunCgroup.make(
        limits.max_processes + _helper_tasks(sandbox), limits.memory_mb + limits.tmp_mb + 64
    )
    try:
        with contextlib.ExitStack() as stack:
            files = [stack.enter_context(open(root / n, "w+b")) for n in (".stdout", ".stderr", ".results")]
            src = _write_sources(root, program)
            home = "/tmp" if bwrap else str(root)
            env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home, "TMPDIR": home}
            env["REROLL_RESULTS_FD"] = str(files[2].fileno())
            guard = _guard_config(limits, bwrap, root, src, as_main)
            python = [sys.executable, "-I", "-S", f"{'/sandbox' if bwrap else src}/_guard.py", guard]
            info_r, info_w = os.pipe() if bwrap else (-1, -1)
            prefix = _bwrap_command(limits, src, env, info_w) if bwrap else network_isolation()
            cmd = [*(cgroup.join_command() if cgroup else []), *prefix, *python]
            start = time.monotonic()
            returncode, timed_out = _launch(
                cmd, {} if bwrap else env, root, stdin, files, (info_r, info_w), limits
            )
            wall = time.monotonic() - start
            returncode = _signal_code(returncode) if bwrap else returncode
            stdout, stderr, results = (_read_capped(f, limits.max_output_bytes) for f in files)
            if max(os.fstat(f.fileno()).st_size for f in files) > limits.max_output_bytes:
                status = "output_limit"
            elif cgroup and cgroup.oom_killed():
                status = "memory"
            else:
                status = _status(returncode, stderr, timed_out)
            return RunResult(status, returncode, stdout, stderr, wall, results)
    finally:
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
            "read": ["/sandbox" if bwrap else str(src), *_python_dirs()],
            "cpu": limits.cpu_s,
            "as": limits.memory_mb << 20,
            "fsize": limits.max_output_bytes + 1,
            "nproc": limits.max_processes + (bwrap and os.geteuid() != 0),  # a user's bwrap init counts too
            "count_tasks": not bwrap,  # a bwrap run has its own user namespace: the count is its own
            "run_name": "__main__" if as_main else "solution",
            "site": [p for p in sys.path if "-packages" in p and os.path.isdir(p)],
        }
    )


def _launch(
    cmd: list[str], env: dict, cwd: Path, stdin: str, files: list, info: tuple[int, int], limits: Limits
) -> tuple[int, bool]:
    """Run ``cmd`` to its end or the wall deadline, then kill what is left: (returncode, timed out)."""
    info_r, info_w = info
    try:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=files[0], stderr=files[1],
            pass_fds=[fd for fd in (files[2].fileno(), info_w) if fd >= 0], start_new_session=True,
        )  # fmt: skip
    except BaseException:
        if info_r >= 0:
            os.close(info_r)
        raise
    finally:
        if info_w >= 0:
            os.close(info_w)
    init = _namespace_init(proc, info_r) if info_r >= 0 else None
    timed_out = False
    try:
        proc.communicate(stdin.encode(), timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        _kill(proc, init)
    return proc.returncode, timed_out


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
def bubblewrap_problem() -> str | None:
    """Why the bubblewrap sandbox cannot run here (bwrap missing, or its namespaces refused), else None."""
    fix = (
        "install it with `apt-get install bubblewrap` (Debian/Ubuntu; `make install` does it as root), "
        "or set `sandbox: audit_hook` (reward args / PythonTool) to accept a weaker in-process guard"
    )
    missing = [tool for tool in ("bwrap", "setpriv") if shutil.which(tool) is None]
    if "bwrap" in missing or (missing and os.geteuid() == 0):
        return f"the code sandbox needs bubblewrap's `bwrap` (and util-linux's setpriv as root): {fix}"
    try:
        version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, timeout=30).stdout
        if tuple(int(x) for x in version.split()[-1].split(".")[:2]) < (0, 8):
            return (
                f"the code sandbox needs bubblewrap 0.8 or newer (--size, --disable-userns); this is "
                f"{version.strip()!r}: {fix}"
            )
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        return f"`bwrap --version` failed ({e}): {fix}"
    with tempfile.TemporaryDirectory(prefix=f"reroll-sandbox-{os.getpid()}-") as src:
        os.chmod(src, 0o755)
        cmd = [*_bwrap_command(Limits(), Path(src), {}, -1), sys.executable, "-I", "-S", "-c", "pass"]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={})
        except (OSError, subprocess.SubprocessError) as e:
            return f"bwrap could not be run ({e}): {fix}"
    if run.returncode != 0:
        return (
            f"bwrap is installed but failed to make the sandbox ({run.stderr.strip()[-300:]}); it needs "
            "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
            f"user.max_user_namespaces > 0), or, in a container, its seccomp/AppArmor to allow them: {fix}"
        )
    return None


def _helper_tasks(sandbox: Sandbox) -> int:
    """Processes of the sandbox itself in the run's pids cgroup: bwrap, the namespace's init, and as
    root the inner bwrap."""
    return 0 if sandbox == "audit_hook" else 3 if os.geteuid() == 0 else 2


def _bwrap_command(limits: Limits, src: Path, env: dict[str, str], info_fd: int) -> list[str]:
    """The argv prefix that runs a command in the sandbox described in the module doc."""
    bwrap, setpriv = shutil.which("bwrap") or "bwrap", shutil.which("setpriv") or "setpriv"
    tools = [bwrap, setpriv] if os.geteuid() == 0 else []
    common = [
        "--die-with-parent", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
        "--unshare-cgroup-try", "--hostname", "sandbox", *_filesystem(src, limits.tmp_mb, tools),
        "--chdir", "/tmp", "--clearenv",
    ]  # fmt: skip
    for key, value in env.items():
        common += ["--setenv", key, value]
    info = ["--info-fd", str(info_fd)] if info_fd >= 0 else []
    user = ["--unshare-user", "--disable-userns", "--uid", str(NOBODY), "--gid", str(NOBODY)]
    if os.geteuid() != 0:
        return [bwrap, "--new-session", *info, *common, *user, "--"]
    return [
        bwrap, "--new-session", *info, *common,
        "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP",
        "--", setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
        "--bounding-set=-all", "--no-new-privs",
        "--", bwrap, "--die-with-parent", *user, "--bind", "/", "/", "--",
    ]  # fmt: skip


def _filesystem(src: Path, tmp_mb: int, tools: list[str]) -> list[str]:
    """bwrap mount options: read-only system libraries, Python and ``tools`` (files), the sources, a
    bounded /tmp."""
    args, made, dirs = [], set(), list(_python_dirs())
    for path in ("/lib", "/lib32", "/lib64", "/usr/lib", "/usr/lib32", "/usr/lib64"):
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            dirs.append(path)
    dirs = _covering(dirs)
    for path in sorted([*dirs, *(t for t in tools if not any(_under(t, d) for d in dirs))]):
        for parent in reversed(Path(path).parents[:-1]):  # bwrap would make them 0700 as root
            if str(parent) not in made and not os.path.islink(parent):
                made.add(str(parent))
                args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", path, path]
    return [
        *args, "--ro-bind", str(src), "/sandbox", "--proc", "/proc", "--dev", "/dev",
        "--size", str(tmp_mb << 20), "--perms", "1777", "--tmpfs", "/tmp",
    ]  # fmt: skip


def _under(path: str, base: str) -> bool:
    return path == base or path.startswith(base.rstrip("/") + "/")


def _covering(paths) -> list[str]:
    """The paths not inside another one of them."""
    real = sorted({os.path.normpath(p) for p in paths if p and os.path.isdir(p)})
    return [p for p in real if not any(q != p and _under(p, q) for q in real)]


@functools.cache
def _python_dirs() -> tuple[str, ...]:
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, *sysconfig.get_paths().values()}
    paths |= {p for p in sys.path if p and os.path.isdir(p) and "site-packages" in p}
    paths |= {os.path.dirname(sys.executable), os.path.dirname(os.path.realpath(sys.executable))}
    return tuple(_covering(paths))


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


def _read_capped(f, limit: int) -> str:
    f.seek(0)
    return f.read(limit).decode(errors="replace")


def _status(returncode: int, stderr: str, timed_out: bool) -> str:
    if timed_out or returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout"
    if returncode == -signal.SIGXFSZ:
        return "output_limit"
    if returncode != 0 and "MemoryError" in stderr:
        return "memory"
    return "ok" if returncode == 0 else "error"
