"""What every node of a Ray cluster the run joins must have, asked of the nodes themselves before any role
starts (``check_nodes``, from ``Roles.start``).

The driver's own checks (``reroll.pipelines.preflight``) see the driver's machine. On a cluster the
roles run on other machines, and what differs there fails late and far from its cause: a package
missing on one node fails that node's workers at start; an ``output_dir`` that is a directory of the
driver's disk alone takes checkpoints that no later run can read back (each node writes its shards
to its own disk); a local ``model.path`` missing on a node fails its workers' load. So each node
answers, in a task pinned to it:

- **the run directory**: the driver writes a token into it; the node must read the same token there
  and be able to write (``output_dir`` on a filesystem every node mounts: NFS, a cluster filesystem),
  or, with ``checkpoint.storage`` set, make the run directory on its own disk and reach the storage
  (the checkpoints' parts then move through it: ``reroll.runtime.node_copies``);
- **the model paths** the workers load (``RunConfig.model_paths``) that are directories on the driver:
  the same path on the node;
- **packages**: ``package_problems`` run on the node, for what can land there (``on``): a node of the
  device pool (a bundle of the run's placement group, or with no pool, a node with the device type)
  needs the engines' and strategies' packages; every node, the rewards' and environments';
- **reroll itself**: importable, of the driver's version, and the packages whose versions must agree
  across the processes of a run (``SAME_VERSIONS``: tensors and weights cross between them) of the
  driver's versions where both have them.

Asked where the run joined a cluster (``runtime.ray_address``, ``RAY_ADDRESS``) or the cluster it
holds has several nodes; a cluster ``reroll train`` starts on its own machine has one node, the
driver's. Nodes that join later (an autoscaler's) are not asked."""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import reroll
from reroll.config.loader import ConfigError, ConfigProblem
from reroll.config.schema import RunConfig
from reroll.runtime.node_copies import worker_nodes

log = logging.getLogger(__name__)

# what the roles' processes exchange (pickled tensors, weights in a library's layout, adapters): a node
# with another version of one of these fails far from the cause
SAME_VERSIONS = ("torch", "transformers", "peft", "vllm", "sglang", "deepspeed", "megatron-core")
PROBE = ".reroll-node-check"  # the token file, in the run directory while the nodes are asked
# a node's answer: a worker's start and reroll's import (a few seconds; minutes on a slow disk)
ANSWER_S = 180.0


@dataclass
class NodeAnswer:
    """What one node found: ``problems`` as ``(config path, message)``."""

    version: str
    problems: list[tuple[str, str]] = field(default_factory=list)
    packages: dict[str, str] = field(default_factory=dict)  # SAME_VERSIONS' installed versions


def node_answer(
    cfg: RunConfig, token: str | None, on: Literal["pool", "node"], model_paths: dict[str, str]
) -> NodeAnswer:
    """On a node: what it lacks for ``cfg`` (the module doc). ``token``: what the driver wrote into the
    run directory (None: no run directory to check, as for ``reroll generate``); ``model_paths``: the
    model directories the driver has, by dotted key (checked on pool nodes, whose workers load them)."""
    from reroll.pipelines.preflight_machine import package_problems

    problems = [(p.path, p.message) for p in package_problems(cfg, on=on)]
    if on == "pool":
        if token is not None:
            problems += run_dir_problems(cfg.run_dir, token, cfg.storage_url)
        problems += [
            (
                key,
                f"{path!r} is a directory on the driver's machine and does not exist here: put it on a "
                "filesystem every node mounts, or at the same path on every node",
            )
            for key, path in model_paths.items()
            if not Path(path).is_dir()
        ]
    return NodeAnswer(reroll.__version__, problems, installed_versions())


def installed_versions() -> dict[str, str]:
    """The installed versions of ``SAME_VERSIONS``' packages (those not installed left out)."""
    from importlib import metadata

    found = {}
    for name in SAME_VERSIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def run_dir_problems(run_dir: Path, token: str, storage_url: str | None = None) -> list[tuple[str, str]]:
    """Whether this machine sees the driver's run directory: the token the driver wrote is read back
    from it, and the directory is writable here. With ``storage_url`` (``checkpoint.storage``) a run
    directory of this node's own will do: it is made here, and the storage must be usable from here
    (``reroll.runtime.node_copies`` moves the checkpoints' parts through it)."""
    try:
        seen = (run_dir / PROBE).read_text()
    except OSError:
        seen = None
    if seen != token and storage_url is not None:
        from reroll.runtime.storage import check

        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return [("output_dir", f"the run directory {str(run_dir)!r} cannot be made here ({e.strerror})")]
        problem = check(storage_url, run_dir)
        return [("checkpoint.storage", f"from this node: {problem}")] if problem else []
    if seen != token:
        what = (
            "is missing"
            if not run_dir.is_dir()
            else "is another directory than the driver's (its check file differs)"
        )
        return [
            (
                "output_dir",
                f"the run directory {str(run_dir)!r} {what} here: checkpoints written here would "
                "not reach the driver or a resumed run. Put output_dir on a filesystem every node mounts (NFS, "
                "a cluster filesystem), or set checkpoint.storage (s3://..., gs://...: each node's part of "
                "a checkpoint then goes through it)",
            )
        ]
    if not os.access(run_dir, os.W_OK | os.X_OK):
        return [("output_dir", f"the run directory {str(run_dir)!r} is not writable here: every node "
                 "writes checkpoint shards into it")]  # fmt: skip
    return []


def asks_nodes(cfg: RunConfig, alive: int) -> bool:
    """Whether ``check_nodes`` asks the nodes: a joined cluster, or one of several nodes."""
    joined = bool(cfg.runtime.ray_address or os.environ.get("RAY_ADDRESS"))
    return cfg.runtime.backend == "ray" and (joined or alive > 1)


def check_nodes(cfg: RunConfig, device_type: str, pool_nodes: set[str], *, run_dir: bool = True) -> None:
    """Ask every alive node with CPUs or GPUs what it lacks for ``cfg`` (the module doc), where
    ``asks_nodes``; raise one ``ConfigError`` naming each problem and its nodes. ``pool_nodes``: the
    nodes holding the run's placement group (empty: no pool, so every node with ``device_type``
    devices may hold a device role). ``run_dir``: whether the nodes write into the run directory (not
    for ``reroll generate``, whose driver writes its output alone)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = worker_nodes()
    if not asks_nodes(cfg, len(nodes)):
        return
    token = secrets.token_hex(16) if run_dir and cfg.run_dir.is_dir() else None
    models = {".".join(k): str(Path(p).resolve()) for k, p in cfg.model_paths().items() if Path(p).is_dir()}
    ask = ray.remote(num_cpus=0, max_retries=0)(node_answer)
    probe = cfg.run_dir / PROBE
    if token is not None:
        probe.write_text(token)
    try:
        refs = {}
        for n in nodes:
            on = "pool" if _on_pool(n, device_type, pool_nodes) else "node"
            strategy = NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            refs[n["NodeID"]] = ask.options(scheduling_strategy=strategy).remote(cfg, token, on, models)
        deadline = time.monotonic() + ANSWER_S  # one bound for all: the nodes answer at once
        answers = {node: _answer(ref, deadline) for node, ref in refs.items()}
    finally:
        if token is not None:  # only what this check wrote
            probe.unlink(missing_ok=True)
    problems = node_problems({_name(n): answers[n["NodeID"]] for n in nodes})
    if problems:
        raise ConfigError(problems, f"the Ray cluster ({len(nodes)} nodes)")
    log.info(
        "each of the %d nodes has what the run needs there (packages, the run directory, the model paths)",
        len(nodes),
    )


def node_problems(
    answers: dict[str, NodeAnswer | str], here: dict[str, str] | None = None
) -> list[ConfigProblem]:
    """The nodes' answers (or why a node gave none) as problems, each naming the nodes it was found on.
    ``here``: the driver's ``installed_versions`` (default: read now)."""
    here = installed_versions() if here is None else here
    found: dict[tuple[str, str], list[str]] = {}
    for node, answer in answers.items():
        if isinstance(answer, str):
            found.setdefault(("runtime", answer), []).append(node)
            continue
        versions = {"reroll": (answer.version, reroll.__version__)}
        versions |= {k: (v, here[k]) for k, v in answer.packages.items() if k in here}
        for name, (there, ours) in versions.items():
            if there != ours:
                what = f"{name} {there} is installed, the driver runs {ours}: the same version on every node"
                found.setdefault(("runtime", what), []).append(node)
        for path, message in answer.problems:
            found.setdefault((path, message), []).append(node)
    return [
        ConfigProblem(path, f"on {', '.join(nodes)}: {message}") for (path, message), nodes in found.items()
    ]


def _answer(ref: Any, deadline: float) -> NodeAnswer | str:
    """A node's answer, or why there is none: reroll not importable there, no answer by ``deadline``."""
    import ray

    try:
        return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        return f"no answer within {ANSWER_S:.0f} s to a task pinned to the node (its workers do not start?)"
    except ray.exceptions.RayError as e:
        cause = getattr(e, "cause", None) or e
        return (
            f"reroll could not run there ({type(cause).__name__}: {str(cause).splitlines()[-1][:200]}): install "
            f"reroll {reroll.__version__} and its extras on every node, or start every node from the driver's "
            "environment"
        )


def _on_pool(node: dict[str, Any], device_type: str, pool_nodes: set[str]) -> bool:
    if pool_nodes:
        return node["NodeID"] in pool_nodes
    return device_type != "cuda" or node.get("Resources", {}).get("GPU", 0) > 0


def _name(node: dict[str, Any]) -> str:
    return f"node {node.get('NodeManagerAddress', '?')} ({node['NodeID'][:8]})"
