"""A sandbox run's own cgroups: a ``pids`` cgroup (a kernel cap on its tasks) and a ``memory`` cgroup
(a cap on all its memory, tmpfs pages included), where this process may make them: as root, or in
a delegated subtree; cgroup v1 or v2.

Each run's cgroup is named ``reroll-sandbox-<pid>-<random>`` after the process that made it, so
another process's runs (or another test suite on the same machine) never see or remove it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path


@functools.cache
def cgroup_bases() -> dict[str, Path]:
    """Per controller (``pids``, ``memory``): this process's cgroup, if reroll may make child cgroups
    in it (root, or a delegated subtree), from ``/proc/self/cgroup`` and the cgroup mounts."""
    try:
        own = [line.split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines()]
        mounts = [line.split(" - ", 1) for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    except OSError:
        return {}
    found: dict[str, Path] = {}
    for head, tail in (m for m in mounts if len(m) == 2):
        fstype, _, options = [*tail.split(), "", ""][:3]
        mount_root, point = head.split()[3:5]
        for _, controllers, path in own:
            path = os.path.relpath(path, mount_root)
            if path.startswith(".."):  # this cgroup is not under the mount
                continue
            if fstype == "cgroup2" and controllers == "":
                base = Path(point) / path.lstrip("/")
                with contextlib.suppress(OSError):
                    names = (base / "cgroup.subtree_control").read_text().split()
                    _add_base(found, [c for c in ("pids", "memory") if c in names], base)
            elif (
                fstype == "cgroup" and controllers and set(controllers.split(",")) <= set(options.split(","))
            ):
                names = [c for c in ("pids", "memory") if c in controllers.split(",")]
                _add_base(found, names, Path(point) / path.lstrip("/"))
    return found


def _add_base(found: dict[str, Path], names: list[str], base: Path) -> None:
    names = [n for n in names if n not in found]
    if not names:
        return
    probe = base / f"reroll-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError:
        return
    found.update(dict.fromkeys(names, base))


@dataclass
class RunCgroup:
    """A run's own cgroups (one directory per hierarchy), named after this process so that another
    process's runs and tests never see or remove them."""

    dirs: list[Path]

    @classmethod
    def make(cls, max_tasks: int, memory_mb: int) -> RunCgroup | None:
        """New cgroups capped at ``max_tasks`` tasks and ``memory_mb`` MB, or None where none can be made."""
        bases = cgroup_bases()
        if not bases or max_tasks <= 0:
            return None
        name = f"reroll-sandbox-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        cg = cls([])
        try:
            for d in sorted({base / name for base in bases.values()}):  # v2: one directory for both
                d.mkdir()
                cg.dirs.append(d)
            for controller, base in bases.items():
                d = base / name
                if controller == "pids":
                    (d / "pids.max").write_text(str(max_tasks))
                else:
                    cap = str(memory_mb << 20)
                    v1 = (d / "memory.limit_in_bytes").exists()
                    (d / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(cap)
                    with contextlib.suppress(OSError):  # no swap beyond it, where swap accounting exists
                        swap = d / ("memory.memsw.limit_in_bytes" if v1 else "memory.swap.max")
                        swap.write_text(cap if v1 else "0")
        except OSError:
            cg.remove()
            raise
        return cg

    def join_command(self) -> list[str]:
        """A prefix that moves the command into these cgroups before it starts (it then execs)."""
        script = 'for f do [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; shift; done; shift; exec "$@"'
        return ["/bin/sh", "-c", script, "sh", *(str(d / "cgroup.procs") for d in self.dirs), "--"]

    def oom_killed(self) -> bool:
        for d in self.dirs:
            for name in ("memory.oom_control", "memory.events"):
                with contextlib.suppress(OSError, ValueError):
                    fields = dict(line.split() for line in (d / name).read_text().splitlines())
                    if int(fields.get("oom_kill", 0)) > 0:
                        return True
        return False

    def remove(self) -> None:
        """SIGKILL every task still in the cgroups (the audit_hook sandbox has no pid namespace), then
        remove them."""
        for d in self.dirs:
            for _ in range(200):
                try:
                    pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
                except OSError:
                    break
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.005)
            for _ in range(100):  # a task just killed may still be leaving
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.005)
