"""What the sandbox attack tests share: a prologue that switches the audit hook off and proves the
program runs inside the sandbox, and a runner that checks that proof before anything else.

A check that never reaches its subject passes: an attack whose program fails before the sandbox
starts "contains" it. So every attack program prints ``IN_SANDBOX`` (the sandbox's hostname and
uid, read by the program itself) and ``attack`` asserts it before the test looks at the effect.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from reroll.rewards.bwrap import NOBODY
from reroll.rewards.sandbox import Limits, SandboxResult, run_python

IN_SANDBOX = f"in sandbox: host sandbox uid {NOBODY}"  # bwrap --hostname sandbox, --uid 65534
HOOK_OFF = """\
import sys
_f = sys._getframe()
while _f is not None and "_hook" not in _f.f_globals:
    _f = _f.f_back
_f.f_globals["_hook"].__code__ = (lambda event, args: None).__code__
import ctypes, os, signal, socket
print("audit hook off", file=sys.stderr)
print(f"in sandbox: host {socket.gethostname()} uid {os.getuid()}", file=sys.stderr, flush=True)
def attempt(name, fn, *args):
    try:
        print(name, "->", repr(fn(*args)), file=sys.stderr)
    except BaseException as e:
        print(name, "->", type(e).__name__, e, file=sys.stderr)
"""
ADD = "a, b = map(int, input().split())\nprint(a + b)"
LIMITS = Limits(cpu_s=2, wall_s=10.0, memory_mb=256)


def assert_ran_inside(r: SandboxResult) -> None:
    """The program ran, with its audit hook off, in the bubblewrap sandbox: only the kernel stands."""
    assert "audit hook off" in r.stderr and IN_SANDBOX in r.stderr, r.stderr[-2000:]


def attack(code: str, limits: Limits = LIMITS) -> SandboxResult:
    """Run ``code`` with the audit hook off, then solve 3 + 4: stdout is "7" if the run was not broken."""
    program = f"{HOOK_OFF}\n{textwrap.dedent(code)}\nsys.stderr.flush()\n{ADD}\n"
    r = run_python(program, "3 4\n", limits=limits)
    assert_ran_inside(r)
    return r


def host_pids_with(marker: str) -> list[int]:
    """Host processes whose command line holds ``marker``."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker.encode() in (d / "cmdline").read_bytes():
                    found.append(int(d.name))
            except OSError:
                pass
    return found
