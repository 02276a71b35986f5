"""Directories that ranks on several nodes write or read, on a Ray cluster whose nodes each hold the run
directory on a disk of their own: moved through the run's storage (``checkpoint.storage``;
``reroll.pipelines.preflight_nodes`` lets such a node in only when it is set).

- ``gather``: after ranks on several nodes wrote their parts of a directory (a checkpoint, the
  reference's snapshot), every node but the driver's copies its part to the storage (and drops it
  where asked: a checkpoint's part, which the storage and the driver then hold), and the driver
  downloads what its own copy lacks. The driver's copy is then whole, as on a shared filesystem.
- ``scatter``: before ranks on several nodes read a directory the driver holds whole (a checkpoint to
  resume from, the reference's snapshot), the driver puts what the storage lacks and every other node
  downloads what its copy lacks (a checkpoint whole, and no other kept there).

A node that sees the driver's disk finds the token the driver wrote into the directory for the call (the
node check's test, ``preflight_nodes.run_dir_problems``) and does nothing. So each call goes to every
alive node, nodes that joined after the start included; on one node, or without a storage, no call is
made (``spread``).
"""

from __future__ import annotations

import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from reroll.errors import UserError
from reroll.runtime import checkpoint
from reroll.runtime.storage import Storage

COPY_S = 3600.0  # one node's share of a gather or scatter (a large checkpoint over a slow link)


def spread(url: str | None) -> bool:
    """Whether directories move through the storage ``url``: it is set, and this process drives a Ray
    cluster of several nodes."""
    ray = sys.modules.get("ray")
    return url is not None and ray is not None and ray.is_initialized() and len(worker_nodes()) > 1


def gather(url: str, directory: Path, remote: str, *, drop: bool) -> None:
    """Make the driver's ``directory`` whole from every node's part (the module doc), through the
    storage's ``remote`` (relative to its root); ``drop``: the other nodes remove their parts."""
    with _token(directory) as token:
        _on_nodes(_send, url, str(directory), remote, token, drop)
    Storage(url).get_tree(remote, directory)


def scatter(url: str, directory: Path, remote: str, *, alone: bool = False) -> None:
    """Give every node the driver's whole ``directory`` (the module doc), through the storage's
    ``remote``; ``alone`` (a checkpoint): a node downloads it whole and keeps no other."""
    Storage(url).put_tree(directory, remote)
    with _token(directory) as token:
        _on_nodes(_fetch, url, str(directory), remote, token, alone)


def share_reference(url: str | None, run_dir: Path) -> None:
    """Before the reference's ranks load its snapshot: where ``spread``, every node gets the driver's
    whole copy."""
    if spread(url):
        scatter(url, run_dir / checkpoint.REFERENCE, checkpoint.REFERENCE)


def _send(url: str, directory: str, remote: str, token: str, drop: bool) -> int:
    """On a node: its part of ``directory`` copied to the storage, unless it is the driver's disk."""
    local = Path(directory)
    if not local.is_dir() or (local / token).exists():
        return 0
    copied = Storage(url).put_tree(local, remote)
    if drop:
        shutil.rmtree(local)
    return copied


def _fetch(url: str, directory: str, remote: str, token: str, alone: bool) -> int:
    """On a node: what its copy of ``directory`` lacks, from the storage, unless it is the driver's disk."""
    local = Path(directory)
    if (local / token).exists():
        return 0
    if alone and local.parent.is_dir():  # a checkpoint: downloaded whole (a copy here may be older)
        for other in local.parent.iterdir():
            if other.is_dir():
                shutil.rmtree(other, ignore_errors=True)
    return Storage(url).get_tree(remote, local)


@contextmanager
def _token(directory: Path) -> Iterator[str]:
    """A file only the driver's disk holds in ``directory`` while the nodes are asked."""
    name = f".reroll-driver-{secrets.token_hex(8)}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text("")
    try:
        yield name
    finally:
        (directory / name).unlink(missing_ok=True)


def worker_nodes() -> list[dict[str, Any]]:
    """Ray's alive nodes that can host a worker (CPUs or GPUs): where a node check or a copy is asked."""
    import ray

    return [n for n in ray.nodes() if n.get("Alive") and _hosts_workers(n.get("Resources", {}))]


def _hosts_workers(resources: dict[str, float]) -> bool:
    return resources.get("CPU", 0) > 0 or resources.get("GPU", 0) > 0


def _on_nodes(fn: Callable[..., int], *args: Any) -> None:
    """``fn(*args)`` once on every alive node, all at once; a node's error or one past ``COPY_S`` is
    raised as one ``UserError`` naming the node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    refs = {  # by the node's id: nodes of one machine share an address
        f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})": task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(*args)
        for n in worker_nodes()
    }
    deadline = time.monotonic() + COPY_S
    for node, ref in refs.items():
        try:
            ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError as e:
            raise UserError(
                f"checkpoint.storage: node {node} did not copy {args[1]} within {COPY_S:.0f} s: check its "
                "link to the storage"
            ) from e
        except ray.exceptions.RayError as e:
            cause = getattr(e, "cause", None) or e
            raise UserError(
                f"checkpoint.storage: node {node} could not copy {args[1]} ({type(cause).__name__}: {cause}): "
                "check its credentials and link to the storage"
            ) from e
