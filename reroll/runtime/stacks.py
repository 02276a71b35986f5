"""Every worker's Python stack, written to the run directory when a call passes its bound.

A hung phase (a deadlock in a collective, an engine that stopped answering, a reward stuck in C code)
is found from where each process stands, not from the error alone. So each Ray worker, when it starts,
registers ``faulthandler`` on SIGUSR1 to write all its threads' stacks to a file of its own in its
node's temp directory (``install``, run in the actor through ``__ray_call__``), and tells the driver
its pid. On a timeout ``gather`` calls ``dump``: the driver signals every worker of every role on its
own node, waits briefly, and copies what they wrote to ``<run_dir>/stacks/<role>-<rank>.txt``, with
its own threads in ``driver.txt``. Workers on other nodes are named in ``remote.txt`` (their stacks
stay on their node: ``py-spy dump --pid`` there).

Only a process that ``configure``d a run directory (the run's driver) dumps; ``gather`` inside a
worker (a reward worker waiting on the judge) raises its timeout without one.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import shutil
import signal
import tempfile
import time
import traceback
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

_run_dir: Path | None = None
_workers: dict[str, Any] = {}  # "<role>-<rank>" -> Ray ref of install()'s (pid, node id, stack file)
_file: IO[str] | None = None  # this worker's stack file, kept open for faulthandler


def configure(run_dir: Path | None) -> None:
    """In the driver: where ``dump`` writes (None: it writes nothing); forgets earlier workers."""
    global _run_dir
    _run_dir = run_dir
    _workers.clear()


def install(_actor: Any, name: str) -> tuple[int, str, str]:
    """In a worker, through ``handle.__ray_call__``: SIGUSR1 writes every thread's stack to a file.
    Returns ``(pid, node id, file)``."""
    import ray

    global _file
    if _file is None:
        _file = tempfile.NamedTemporaryFile(  # noqa: SIM115 (open while the process lives)
            "w", prefix=f"reroll-stacks-{name}-", suffix=".txt", delete=False
        )
        faulthandler.register(signal.SIGUSR1, file=_file, all_threads=True)
    return os.getpid(), ray.get_runtime_context().get_node_id(), _file.name


def track(name: str, handle: Any) -> None:
    """In the driver: have the Ray actor ``handle`` install its handler (queued behind its constructor:
    nothing waits for it here)."""
    if _run_dir is not None:
        _workers[name] = handle.__ray_call__.remote(install, name)


def forget(name: str) -> None:
    """In the driver: the worker ``name`` has stopped; its stack file (on this node) is removed."""
    ref = _workers.pop(name, None)
    if ref is None:
        return
    import ray

    try:
        _pid, node, path = ray.get(ref, timeout=0)
        if node == ray.get_runtime_context().get_node_id():
            os.unlink(path)
    except Exception:  # never installed (the worker died starting), or already gone
        pass


def dump(wait_s: float = 2.0) -> Path | None:
    """Every tracked worker's stack (and the driver's) into ``<run_dir>/stacks``; returns that directory,
    or None where no run directory is configured."""
    if _run_dir is None:
        return None
    out = _run_dir / "stacks"
    out.mkdir(parents=True, exist_ok=True)
    with (out / "driver.txt").open("w") as f:
        # the waiting thread first: faulthandler lists at most 100 threads, newest first, so in a
        # process with many (servers, Ray's) the main thread's wait could fall past its cut
        f.write("Waiting thread (most recent call last):\n" + "".join(traceback.format_stack()) + "\n")
        f.flush()
        faulthandler.dump_traceback(f, all_threads=True)
    if not _workers:
        return out
    import ray

    here = ray.get_runtime_context().get_node_id()
    ready, _ = ray.wait(list(_workers.values()), num_returns=len(_workers), timeout=1.0)
    signalled, remote = {}, []
    for name, ref in _workers.items():
        if ref not in ready:
            continue  # still starting (or its constructor hangs): no handler yet
        try:
            pid, node, path = ray.get(ref, timeout=0)
            if node != here:
                remote.append(f"{name}: pid {pid} on node {node}")
                continue
            os.kill(pid, signal.SIGUSR1)
            signalled[name] = path
        except Exception as e:  # a dead worker, or one whose constructor failed
            log.debug("no stack from %s: %s", name, e)
    time.sleep(wait_s)
    for name, path in signalled.items():
        try:
            shutil.copyfile(path, out / f"{name}.txt")
        except OSError as e:
            log.warning("could not copy %s's stack from %s: %s", name, path, e)
    if remote:
        (out / "remote.txt").write_text("".join(line + "\n" for line in remote))
    return out
