"""Reward calls in child processes, so a call that hangs can be killed.

Python cannot stop a thread, so a reward that loops forever on a thread burns a core for the rest of
the run. ``ProcessPool`` keeps a few child processes, each a fresh interpreter (``python -c``, not
multiprocessing: spawn and forkserver re-run the parent's main module in every child, which in a
Ray actor is Ray's worker script; and a fork would copy the worker's threads' locks). A child
imports the isolated rewards' modules before it takes calls. A call sends ``(fn, args, prompt, response, row)``
to an idle child, which resolves the reward by name (as ``resolve_reward`` does) and returns its
``RewardResult``, or the error (where in the user's code it was raised, and its traceback). A call still running at its deadline has its child's whole process group killed
(``SIGKILL``) and raises ``RewardTimeout``; ``refill`` starts its replacement. A
reward that raises in the child raises ``RewardCallError`` here; a child that dies (``os._exit``,
a segfault) is replaced and raises ``RewardCallError`` too.

Arguments, rows and results cross a socket, so they must pickle; the function is imported by name in
the child (its module must be importable there: the child gets this process's ``sys.path``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from reroll.rewards.base import RewardResult, as_result

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0  # a child imports the isolated rewards' modules before it takes calls


class RewardTimeout(Exception):
    """A reward call passed its deadline; its process was killed."""


class RewardCallError(Exception):
    """A reward call raised in its child process (``traceback_text``: the child's traceback), or the
    child died."""

    def __init__(self, message: str, traceback_text: str = "") -> None:
        super().__init__(message)
        self.traceback_text = traceback_text


def serve(fd: int) -> None:
    """The child's loop on the socket ``fd``: first ``(sys.path, preload)``, then calls, each answered
    ``("ok", result)`` or ``("error", "Type: message")``. The ``preload`` rewards are imported before
    ``"ready"`` is sent, so no call pays for imports."""
    conn = Connection(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which kills us
    sys_path, preload = conn.recv()
    sys.path[:] = sys_path
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    from reroll.rewards import resolve_reward
    from reroll.rewards.calling import describe_error

    fns: dict[tuple[str, str], Any] = {}
    for name, args in preload:
        fns[(name, repr(sorted(args.items())))] = resolve_reward(name, args)
    conn.send(("ready", None))
    while True:
        try:
            name, args, prompt, response, row = conn.recv()
        except EOFError:  # the parent is gone
            return
        try:
            key = (name, repr(sorted(args.items())))
            if key not in fns:
                fns[key] = resolve_reward(name, args)
            result = as_result(fns[key](prompt, response, row))  # a plain number is a score
            reply: tuple[str, Any] = ("ok", result)
        except BaseException as e:  # every failure of the reward goes back as a message and traceback
            reply = ("error", (describe_error(e), traceback.format_exc()))
        try:
            conn.send(reply)
        except Exception as e:  # a result that does not pickle
            conn.send(("error", (f"its result cannot be sent back: {type(e).__name__}: {e}", "")))


def _exit_with_parent(parent: int) -> None:
    """End this child (even mid-call) once its parent is gone, e.g. the reward worker was SIGKILLed."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


@dataclass
class _Child:
    process: subprocess.Popen
    conn: Connection


class ProcessPool:
    """``size`` child processes running reward calls, each call bounded by a deadline."""

    def __init__(self, size: int, *, preload: Sequence[tuple[str, Mapping[str, Any]]] = ()) -> None:
        self._preload = [(name, dict(args)) for name, args in preload]
        self._idle: queue.Queue[_Child] = queue.Queue()
        self._closed, self._missing, self._lock = False, 0, threading.Lock()
        for child in [self._launch() for _ in range(size)]:  # the children start side by side
            self._idle.put(self._wait_ready(child))

    def _start(self) -> _Child:
        return self._wait_ready(self._launch())

    def _launch(self) -> _Child:
        ours, theirs = socket.socketpair()
        with ours, theirs:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    f"from reroll.rewards.isolation import serve; serve({theirs.fileno()})",
                ],
                pass_fds=[theirs.fileno()],
                start_new_session=True,  # its own process group: a kill reaches what the reward started
            )
            child = _Child(process, Connection(os.dup(ours.fileno())))
        child.conn.send((list(sys.path), self._preload))
        return child

    def _wait_ready(self, child: _Child) -> _Child:
        try:
            ready = child.conn.poll(_START_TIMEOUT_S) and child.conn.recv()[0] == "ready"
        except (EOFError, OSError):  # it died importing the rewards (its traceback is on stderr)
            ready = False
        if not ready:
            _kill(child)
            raise RewardCallError(
                f"a reward process did not start within {_START_TIMEOUT_S:.0f} s "
                f"(importing {[n for n, _ in self._preload]}; see its error above)"
            )
        return child

    def call(
        self, name: str, args: Mapping[str, Any], prompt: str, response: str, row: Mapping[str, Any],
        *, deadline: float,
    ) -> RewardResult:  # fmt: skip
        """``name(prompt, response, row, **args)`` in a child; killed at ``deadline`` (``time.monotonic``)."""
        try:
            child = self._idle.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise RewardTimeout("no reward process came free before the deadline") from None
        try:
            child.conn.send((name, dict(args), prompt, response, dict(row)))
            if not child.conn.poll(max(0.0, deadline - time.monotonic())):
                self._replace(child)
                raise RewardTimeout(
                    f"reward {name!r} passed its deadline; process {child.process.pid} killed"
                )
            status, value = child.conn.recv()
        except (EOFError, OSError) as e:  # the child died mid-call
            self._replace(child)
            code = child.process.returncode
            raise RewardCallError(f"reward {name!r}: its process died (exit code {code})") from e
        self._idle.put(child)
        if status == "error":
            message, text = value
            raise RewardCallError(f"reward {name!r} raised {message}", text)
        return value

    def _replace(self, child: _Child) -> None:
        """Kill ``child`` and its process group now; ``refill`` starts its replacement."""
        _kill(child)
        with self._lock:
            self._missing += 1

    def refill(self) -> None:
        """Start a replacement for each killed child. The reward worker calls this on the thread whose
        call timed out, after reporting it and before taking the next item, so no item's deadline
        runs while a child starts."""
        while not self._closed:
            with self._lock:
                if not self._missing:
                    return
                self._missing -= 1
            try:
                self._idle.put(self._start())
            except Exception as e:  # the pool is one child short; calls wait for the others
                log.error("could not replace a reward process: %r", e)

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                _kill(self._idle.get_nowait())
            except queue.Empty:
                return


def _kill(child: _Child) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.process.pid, signal.SIGKILL)  # the child leads its own session and group
    child.process.wait()  # reaped: the pid is gone, not a zombie
    child.conn.close()
