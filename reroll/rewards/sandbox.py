"""Run an untrusted Python program in a separate, limited process.

Each run gets a fresh temporary directory (its working directory and ``HOME``), removed afterwards.
What is enforced, and how:

- **CPU time** ``RLIMIT_CPU`` and **wall time** (the whole process group is killed at the deadline).
- **Memory** ``RLIMIT_AS`` (an allocation past it raises ``MemoryError`` in the program).
- **Output size** stdout/stderr go to files in the run directory under ``RLIMIT_FSIZE``; only the
  first ``max_output_bytes`` are read back.
- **Processes** where this host lets reroll make a cgroup in the ``pids`` controller (root, or a
  delegated cgroup; see ``pids_cgroup_root``), each run gets its own with ``pids.max =
  max_processes``: the kernel refuses tasks past it (threads count), and at the end every task in
  it is killed, also one that left the session. Without cgroups, ``RLIMIT_NPROC`` is set to the
  user's current task count plus ``max_processes`` (it counts per user; the kernel does not
  enforce it for root). Above that, an audit hook refuses ``os.fork``, ``os.system``,
  ``subprocess.Popen``, ``os.exec*``, ``os.posix_spawn`` and ``pty``, and ``_posixsubprocess.fork_exec``
  (which starts processes with no audit event) is removed; the run is its own session, killed
  with it.
- **Network** the process runs under ``unshare -n`` (an empty network namespace) where that works
  on this host (root, or unprivileged user namespaces via ``unshare -rn``); in any case the audit
  hook refuses creating sockets.
- **Files** ``open``/``listdir``/``remove``/``rename``/``chdir`` outside the run directory and the
  Python installation are refused by the audit hook (``/dev/null`` and ``/dev/urandom`` are
  allowed); ``ctypes`` cannot be loaded.

Not guaranteed: audit hooks are not a security boundary (CPython documents this). A determined
program can escape them through C extensions already on the path, and the Python installation is
readable. The kernel-level limits (rlimits, network namespace, killing the session) hold; for
hostile code, run reward workers in a container or a VM as well. The program can read its own
directory, so a result file written there (``code_tests``' call-style cases) could be forged by a
policy that learned to; stdin/stdout cases compare what the process printed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# Runs first in the child: set rlimits, install the audit hook, then run the program as __main__.
_GUARD = r"""
import os, resource, sys
_root = os.path.realpath(sys.argv[1])
_limits = [int(x) for x in sys.argv[2:6]]
_allowed = tuple(os.path.realpath(p) for p in sys.argv[6].split(os.pathsep) if p)
_run_name, _cgroup = sys.argv[7], sys.argv[8]
if _cgroup:  # join the run's pids cgroup: the kernel caps its tasks, and the parent kills them all
    with open(os.path.join(_cgroup, "cgroup.procs"), "w") as _f:
        _f.write(str(os.getpid()))
if _limits[3] > 0 and os.getuid() != 0:  # RLIMIT_NPROC counts all of this user's tasks: allow as many more
    _uid, _tasks = str(os.getuid()), 0
    for _pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{_pid}/status") as _f:
                _st = dict(l.split(":", 1) for l in _f if ":" in l)
            _tasks += int(_st["Threads"]) if _st["Uid"].split()[0] == _uid else 0
        except (OSError, KeyError, ValueError):
            pass
    _limits[3] += _tasks
for _lim, _val in zip(("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_NPROC"), _limits):
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
import runpy, encodings.idna, json  # modules the program may need, loaded before the hook
sys.addaudithook(_hook)
del sys.argv[1:]
sys.argv[0] = "main.py"
runpy.run_path(os.path.join(_root, "main.py"), run_name=_run_name)
"""


@dataclass(frozen=True)
class Limits:
    """What one run may use."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 1024
    max_output_bytes: int = 1 << 20
    max_processes: int = 64  # tasks (processes and threads) the program may add; see the module doc


@dataclass(frozen=True)
class RunResult:
    """One run's outcome. ``status``: ok | error (non-zero exit) | timeout | memory | output_limit."""

    status: str
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    files: dict[str, str] = field(default_factory=dict)


@functools.cache
def network_isolation() -> list[str]:
    """The command prefix that gives a run an empty network namespace here, or ``[]`` if none works."""
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


@functools.cache
def pids_cgroup_root() -> Path | None:
    """This process's cgroup in the ``pids`` controller (v1 hierarchy, or v2 with ``pids`` enabled for
    children) if a run's own cgroup can be made in it, else None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "pids":
            base = Path("/sys/fs/cgroup/pids") / path.lstrip("/")
        elif controllers == "":
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            control = base / "cgroup.subtree_control"
            if not control.is_file() or "pids" not in control.read_text().split():
                continue
        else:
            continue
        probe = base / f"reroll-probe-{os.getpid()}"
        try:
            probe.mkdir()
            probe.rmdir()
            return base
        except OSError:
            continue
    return None


def _make_cgroup(max_tasks: int) -> Path | None:
    base = pids_cgroup_root()
    if base is None:
        return None
    cg = Path(tempfile.mkdtemp(prefix="reroll-sandbox-", dir=base))  # the kernel fills it in
    (cg / "pids.max").write_text(str(max_tasks))
    return cg


def _kill_cgroup(cg: Path) -> None:
    """SIGKILL every task of the run's cgroup (those that left its session too), then remove it."""
    for _ in range(200):
        pids = [int(p) for p in (cg / "cgroup.procs").read_text().split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)
    with contextlib.suppress(OSError):
        cg.rmdir()


def _python_dirs() -> str:
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, *sysconfig.get_paths().values()}
    paths |= {p for p in sys.path if p and os.path.isdir(p) and "site-packages" in p}
    return os.pathsep.join(sorted(p for p in paths if p))


def run_python(
    program: str,
    stdin: str = "",
    *,
    limits: Limits = Limits(),
    files: dict[str, str] | None = None,
    read_back: str | None = None,
    as_main: bool = True,
) -> RunResult:
    """Run ``program`` (as ``main.py``) with ``stdin``, under ``limits``, in a fresh temporary directory.

    ``files`` are written beside it first; the file ``read_back`` (if the program made it) is
    returned in ``RunResult.files``, capped at ``limits.max_output_bytes``. ``as_main=False`` runs
    the program as a module named ``solution`` (its ``if __name__ == "__main__"`` block is skipped).
    """
    root = Path(tempfile.mkdtemp(prefix="reroll-sandbox-"))
    cgroup = _make_cgroup(limits.max_processes) if limits.max_processes > 0 else None
    try:
        (root / "main.py").write_text(program)
        (root / "_guard.py").write_text(_GUARD)
        for name, text in (files or {}).items():
            (root / name).write_text(text)
        out_path, err_path = root / ".stdout", root / ".stderr"
        env = {"PATH": "/usr/bin:/bin", "HOME": str(root), "TMPDIR": str(root), "LANG": "C.UTF-8"}
        rl = [limits.cpu_s, limits.memory_mb << 20, limits.max_output_bytes + 1, limits.max_processes]
        cmd = [
            *network_isolation(),
            sys.executable,
            "-I",
            str(root / "_guard.py"),
            str(root),
            *map(str, rl),
            _python_dirs(),
            "__main__" if as_main else "solution",
            str(cgroup or ""),
        ]
        start = time.monotonic()
        with out_path.open("wb") as out, err_path.open("wb") as err:
            proc = subprocess.Popen(
                cmd, cwd=root, env=env, stdin=subprocess.PIPE, stdout=out, stderr=err, start_new_session=True
            )
            timed_out = False
            try:
                proc.communicate(stdin.encode(), timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_session(proc)
        wall = time.monotonic() - start
        overflow = max(out_path.stat().st_size, err_path.stat().st_size) > limits.max_output_bytes
        stdout, stderr = (_read_capped(p, limits.max_output_bytes) for p in (out_path, err_path))
        status = "output_limit" if overflow else _status(proc.returncode, stderr, timed_out)
        back = root / read_back if read_back else None
        files_back = (
            {read_back: _read_capped(back, limits.max_output_bytes)} if back and back.is_file() else {}
        )
        return RunResult(status, proc.returncode, stdout, stderr, wall, files_back)
    finally:
        if cgroup is not None:
            _kill_cgroup(cgroup)
        shutil.rmtree(root, ignore_errors=True)


def _kill_session(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _read_capped(path: Path, limit: int) -> str:
    with path.open("rb") as f:
        return f.read(limit).decode(errors="replace")


def _status(returncode: int, stderr: str, timed_out: bool) -> str:
    if timed_out or returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout"
    if returncode == -signal.SIGXFSZ:
        return "output_limit"
    if returncode != 0 and "MemoryError" in stderr:
        return "memory"
    return "ok" if returncode == 0 else "error"
