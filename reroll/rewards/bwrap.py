"""The bubblewrap command line of one sandboxed run, and whether it works here.

What the command line isolates, and why, is in docs/sandbox.md; ``reroll.rewards.sandbox`` runs it.
``bubblewrap_problem`` and ``seccomp_problem`` start one sandbox (cached per process) and say what
fails, naming the fix.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from reroll.rewards.seccomp import filter_problem, filter_program

NOBODY = 65534
_OWN_MOUNTS = ("/proc", "/dev", "/tmp")  # the sandbox's own; binds under them go on top
_FIX = (
    "install it with `apt-get install bubblewrap` (Debian/Ubuntu; `make install` does it as root), "
    "or set `sandbox: audit_hook` (reward args / PythonTool) to accept a weaker in-process guard"
)


def bubblewrap_problem() -> str | None:
    """Why the bubblewrap sandbox cannot run here (bwrap missing or too old, its namespaces refused, the
    interpreter not startable inside), with the fix; else None."""
    return _probe()[0]


def seccomp_problem() -> str | None:
    """Why sandboxed programs run without the seccomp filter here (no table for this architecture, no
    seccomp in the kernel, bwrap refused to load it), else None."""
    return _probe()[1]


@functools.cache
def _probe() -> tuple[str | None, str | None]:
    missing = [tool for tool in ("bwrap", "setpriv") if shutil.which(tool) is None]
    if "bwrap" in missing or (missing and os.geteuid() == 0):
        return f"the code sandbox needs bubblewrap's `bwrap` (and util-linux's setpriv as root): {_FIX}", None
    try:
        version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, timeout=30).stdout
        if tuple(int(x) for x in version.split()[-1].split(".")[:2]) < (0, 8):
            return (
                f"the code sandbox needs bubblewrap 0.8 or newer (--size, --disable-userns); this is "
                f"{version.strip()!r}: {_FIX}"
            ), None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        return f"`bwrap --version` failed ({e}): {_FIX}", None
    hidden = [d for d in python_dirs() if any(_under(mount, d) for mount in ("/tmp", "/proc", "/dev"))]
    if hidden:
        return (
            f"the interpreter's directories {hidden} hold /tmp, /proc or /dev: binding them into the "
            f"sandbox would show it the host's. Run reroll from a Python installed under its own "
            f"prefix (a virtual environment, /usr, pyenv), not one whose files sit directly in {hidden[0]}"
        ), None
    no_filter = filter_problem()
    with tempfile.TemporaryDirectory(prefix=f"reroll-sandbox-{os.getpid()}-") as src:
        os.chmod(src, 0o755)
        run = _start(Path(src), seccomp=no_filter is None)
        if run.returncode != 0 and no_filter is None and _start(Path(src), seccomp=False).returncode == 0:
            return None, f"bwrap could not load the seccomp filter ({run.stderr.strip()[-300:]})"
    if run.returncode != 0:
        return _failure(run), None
    return None, no_filter


def _start(src: Path, *, seccomp: bool) -> subprocess.CompletedProcess:
    """Start this interpreter in a sandbox (with the seccomp filter or without) and let it exit."""
    fd = _filter_fd() if seccomp else -1
    cmd = [*bwrap_command(src, 64, {}, -1, fd), sys.executable, "-I", "-S", "-c", "pass"]
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=60, env={}, pass_fds=[fd] if fd >= 0 else []
        )
    except (OSError, subprocess.SubprocessError) as e:
        return subprocess.CompletedProcess(cmd, -1, "", f"bwrap could not be run: {e}")
    finally:
        if fd >= 0:
            os.close(fd)


def _failure(run: subprocess.CompletedProcess) -> str:
    err = run.stderr.strip()[-300:]
    if "execvp" in err:  # the sandbox was made: what failed is the program's start
        return (
            f"bwrap made the sandbox but could not start the interpreter {sys.executable} in it ({err}). "
            f"The sandbox binds these directories read-only: {list(python_dirs())}; the interpreter or "
            f"a library it loads lies elsewhere. Run reroll from a Python whose files are all under "
            f"its prefix, or set `sandbox: audit_hook` to accept a weaker in-process guard"
        )
    return (
        f"bwrap is installed but failed to make the sandbox ({err}); it needs unprivileged user "
        "namespaces (sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0), or, in "
        f"a container, its seccomp/AppArmor to allow them: {_FIX}"
    )


def seccomp_fd() -> int:
    """A pipe's read end holding the seccomp filter for one run (bwrap reads it to its end), or -1
    where none is installed here (``seccomp_problem`` says why). The caller passes it to bwrap and
    closes it."""
    return -1 if seccomp_problem() is not None else _filter_fd()


def _filter_fd() -> int:
    r, w = os.pipe()  # a few hundred bytes: far below a pipe's buffer, so the write cannot block
    with open(w, "wb", buffering=0) as out:
        out.write(filter_program())
    return r


def bwrap_command(src: Path, tmp_mb: int, env: dict[str, str], info_fd: int, seccomp_fd: int) -> list[str]:
    """The argv prefix that runs a command in the sandbox of docs/sandbox.md: ``src`` read-only at
    /sandbox, a ``tmp_mb`` MB /tmp, only ``env``; bwrap writes its child's pid to ``info_fd`` and
    loads the seccomp filter from ``seccomp_fd`` (each skipped if -1)."""
    bwrap, setpriv = shutil.which("bwrap") or "bwrap", shutil.which("setpriv") or "setpriv"
    tools = [bwrap, setpriv] if os.geteuid() == 0 else []
    common = [
        "--die-with-parent", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
        "--unshare-cgroup-try", "--hostname", "sandbox", *_filesystem(src, tmp_mb, tools),
        "--chdir", "/tmp", "--clearenv",
    ]  # fmt: skip
    for key, value in env.items():
        common += ["--setenv", key, value]
    info = ["--info-fd", str(info_fd)] if info_fd >= 0 else []
    user = ["--unshare-user", "--disable-userns", "--uid", str(NOBODY), "--gid", str(NOBODY)]
    user += ["--seccomp", str(seccomp_fd)] if seccomp_fd >= 0 else []  # loaded last, before the exec
    if os.geteuid() != 0:
        return [bwrap, "--new-session", *info, *common, *user, "--"]
    return [  # the filter goes on the inner bwrap: the outer one and setpriv need mount and unshare
        bwrap, "--new-session", *info, *common,
        "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP",
        "--", setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
        "--bounding-set=-all", "--no-new-privs",
        "--", bwrap, "--die-with-parent", *user, "--bind", "/", "/", "--",
    ]  # fmt: skip


def _filesystem(src: Path, tmp_mb: int, tools: list[str]) -> list[str]:
    """bwrap mount options: the sandbox's own /proc, /dev and bounded /tmp first, then read-only the
    system libraries, Python and ``tools`` (files), so that an interpreter under /tmp is bound on top
    of the new /tmp instead of hidden by it; the sources at /sandbox."""
    args = [
        "--proc", "/proc", "--dev", "/dev", "--size", str(tmp_mb << 20), "--perms", "1777", "--tmpfs", "/tmp",
    ]  # fmt: skip
    made, dirs = set(_OWN_MOUNTS), list(python_dirs())
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
    return [*args, "--ro-bind", str(src), "/sandbox"]


def _under(path: str, base: str) -> bool:
    return path == base or path.startswith(base.rstrip("/") + "/")


def _covering(paths) -> list[str]:
    """The paths not inside another one of them."""
    real = sorted({os.path.normpath(p) for p in paths if p and os.path.isdir(p)})
    return [p for p in real if not any(q != p and _under(p, q) for q in real)]


@functools.cache
def python_dirs() -> tuple[str, ...]:
    """This interpreter's installation: its prefixes, standard library, site-packages and executable's
    directories (a virtual environment's and its base's), none inside another."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, *sysconfig.get_paths().values()}
    paths |= {p for p in sys.path if p and os.path.isdir(p) and "site-packages" in p}
    paths |= {os.path.dirname(sys.executable), os.path.dirname(os.path.realpath(sys.executable))}
    return tuple(_covering(paths))
