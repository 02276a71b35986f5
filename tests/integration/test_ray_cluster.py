"""A real Ray cluster of two nodes on this machine (``ray start --head`` plus ``ray start --address``, each
with its own custom resource and temp dir), joined by ``reroll train`` through ``RAY_ADDRESS`` as
``ray job submit`` gives it to its driver: actor_train is pinned to one node and actor_infer to the other
(``roles.<role>.resources``), so every weight sync and every batch crosses nodes; the run directory and
checkpoints land below the driver's working directory, not the nodes' (``ray start`` ran elsewhere).
Where Ray's dashboard can run (``pip install "ray[default]"``), the same cluster also takes the run as
``ray job submit -- python -m reroll.cli train CONFIG``."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml

from reroll.runtime.metrics import read_metrics
from tests.conftest import QUICKSTART, ROOT

pytestmark = pytest.mark.integration
RAY = [sys.executable, "-m", "ray.scripts.scripts"]  # the `ray` command of this interpreter


def _dashboard_available() -> bool:
    """Whether Ray's dashboard (which `ray job submit` talks to) can start: ray[default] is installed."""
    from ray._private.utils import get_dashboard_dependency_error

    return get_dashboard_dependency_error() is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _token_exists() -> bool:
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or os.path.isfile(path)


def _start_node(
    args: list[str], log: Path, cwd: Path, env: dict[str, str], hidden: Sequence[Path] = ()
) -> subprocess.Popen:
    """``ray start ARGS --block`` in its own process group (stopped by ``_stop``); waits until it is up.
    ``hidden``: directories the node sees as empty (a mount namespace of its own with a tmpfs over each,
    ``unshare --mount``, as root): a node whose disk is its own at those paths."""
    command = [*RAY, "start", *args, "--block", "--disable-usage-stats"]
    if hidden:
        mounts = " && ".join(f"mount -t tmpfs tmpfs {shlex.quote(str(h))}" for h in hidden)
        command = [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f"{mounts} && exec {shlex.join(command)}",
        ]
    out = log.open("w")
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 180
    while "Ray runtime started" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            raise RuntimeError(f"ray start {args} did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    """Stop one node: every process of its group (raylet, GCS, workers), politely first."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        time.sleep(1)  # the group's other processes exit after the leader


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, request):
    """``(address, cluster cwd, dashboard url or None)`` of a head node with resource ``node_a`` and a
    second node with ``node_b``, 3 CPUs each (Ray allows more than the machine's cores), stopped after
    this module's tests. The dashboard starts only where it can and the `ray job submit` test runs (it is
    marked long: CI's run leaves it out and saves the dashboard's start)."""
    jobs = any(item.name == test_ray_job_submit_runs_reroll_train.__name__ for item in request.session.items)
    tmp_path = tmp_path_factory.mktemp("cluster")
    cwd = tmp_path / "cluster-cwd"
    cwd.mkdir()
    env = _node_env()
    temp = [tempfile.mkdtemp(prefix="rr-", dir="/tmp") for _ in range(2)]  # short: socket paths are bounded
    nodes: list[subprocess.Popen] = []
    try:
        # once more on fresh ports if Ray itself does not come up (a port taken between the pick and the
        # bind by another suite on the machine); the first attempt's log is kept beside the second's
        for attempt in (1, 2):
            try:
                address, dashboard = _start_cluster(
                    nodes, temp, tmp_path / f"attempt{attempt}", cwd, env, jobs
                )
                break
            except RuntimeError as e:
                print(f"attempt {attempt} to start the cluster failed: {e}", file=sys.stderr)
                for proc in reversed(nodes):
                    _stop(proc)
                nodes.clear()
                if attempt == 2:
                    raise
        yield address, cwd, dashboard
    finally:
        for proc in reversed(nodes):
            _stop(proc)
        for path in temp:
            shutil.rmtree(path, ignore_errors=True)


def _node_env() -> dict[str, str]:
    """The nodes' environment: this checkout importable, token authentication where a token exists."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    if _token_exists() and "RAY_AUTH_MODE" not in env:  # as Ray's docs say for a node joining a token cluster
        env["RAY_AUTH_MODE"] = "token"
    return env


def _start_cluster(
    nodes: list[subprocess.Popen],
    temp: list[str],
    logs: Path,
    cwd: Path,
    env: dict[str, str],
    jobs: bool,
    hidden: Sequence[Path] = (),
) -> tuple[str, str | None]:
    """Start the head and the second node (appended to ``nodes``; ``hidden``: what the second one sees
    empty, ``_start_node``): the GCS address and, with ``jobs`` where Ray's dashboard can run, its URL."""
    logs.mkdir()
    port, dashboard = _free_port(), _free_port() if jobs and _dashboard_available() else None
    head = ["--head", f"--port={port}", f"--ray-client-server-port={_free_port()}"]
    if dashboard is None:
        head.append("--include-dashboard=false")
    else:
        head += ["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}"]
    head += ["--num-cpus=3", '--resources={"node_a": 4}', f"--temp-dir={temp[0]}"]
    nodes.append(_start_node(head, logs / "head.log", cwd, env))
    second = [
        f"--address=127.0.0.1:{port}",
        "--num-cpus=3",
        '--resources={"node_b": 4}',
        f"--temp-dir={temp[1]}",
    ]
    nodes.append(_start_node(second, logs / "node_b.log", cwd, env, hidden))
    return f"127.0.0.1:{port}", (f"http://127.0.0.1:{dashboard}" if dashboard else None)


def _config(driver: Path, name: str, *, absolute: bool = False) -> Path:
    """A 2-step quickstart in ``driver``: actor_train on node_a, actor_infer on node_b. Its paths stay
    relative (resolved against the driver's directory) unless ``absolute``."""
    cfg = yaml.safe_load(QUICKSTART.read_text())
    cfg.update(name=name, total_steps=2)
    if absolute:
        cfg["output_dir"] = str(driver / "runs" / "{name}")
        cfg["model"]["path"] = str(driver / cfg["model"]["path"])
        for key in ("train_files", "eval_files"):
            cfg["data"][key] = [str(driver / f) for f in cfg["data"][key]]
    cfg["sft"]["steps"] = 30
    cfg["data"].update(eval_limit=32)
    cfg["data"]["synthetic"].update(n_train=600, n_test=32)
    cfg["rollout"]["batch_size"] = cfg["optim"]["micro_batch_size"] = 64
    cfg["rollout"]["logprobs"] = True  # for mismatch/*: the weights that crossed nodes
    cfg["eval"]["every"], cfg["checkpoint"]["every"] = 2, 1
    cfg["logging"] = {"tensorboard": False, "sample_every": 0}
    cfg["roles"] = {
        "actor_train": {"resources": {"node_a": 1}, "torch_threads": 1},
        "actor_infer": {"resources": {"node_b": 1}, "torch_threads": 1},
        "reward": {"torch_threads": 1},
    }
    path = driver / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _check_run(run_dir: Path) -> None:
    """Checkpoints of both steps in ``run_dir``, and weights that crossed nodes: after each sync from
    node_a the engine on node_b scores its samples as the trainer does (the warm start moved the
    weights far from model.path's, so a missed sync shows here)."""
    assert (run_dir / "checkpoints/step_000001/COMPLETE").exists()
    assert (run_dir / "checkpoints/step_000002/model/config.json").exists()
    metrics = {r["step"]: r for r in read_metrics(run_dir)}
    # the warm start's weights are synced before step 0 (``_begin``), unlogged; step 1's update, at step 2
    assert "sync/bytes" not in metrics[1] and metrics[2]["sync/bytes"] > 0
    for step in (1, 2):
        assert metrics[step]["mismatch/logprob_abs_max"] < 1e-4
        assert metrics[step]["rollout/response_length"] > 0  # batches came back from node_b
    assert "eval/accuracy" in metrics[0] and "eval/accuracy" in metrics[2]


def _train_joining(
    driver: Path, config: str, address: str, **extra: str
) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """``reroll train CONFIG`` run in ``driver`` joining the cluster at ``address`` through RAY_ADDRESS,
    and the environment it ran in (``extra`` added to this one's)."""
    env = {**os.environ, "RAY_ADDRESS": address, **extra}
    env.pop("RAY_AUTH_MODE", None)  # the driver turns token authentication on itself where a token exists
    command = [sys.executable, "-m", "reroll.cli", "train", config]
    return subprocess.run(command, cwd=driver, env=env, capture_output=True, text=True, timeout=600), env


ACTOR_NODES = """
import json, ray
from ray._private.state import actors
ray.init(logging_level="ERROR")
custom = {n["NodeID"]: sorted(k for k in n["Resources"] if k.startswith("node_")) for n in ray.nodes()}
print(json.dumps({a["Name"]: custom.get(a["Address"]["NodeID"]) for a in actors().values() if a.get("Name")}))
"""


@pytest.mark.long  # 60 s in CI with the two nodes' start
def test_train_joins_a_two_node_cluster_with_roles_on_different_nodes(tmp_path, two_nodes):
    address, cluster_cwd, _ = two_nodes
    driver = tmp_path / "driver"
    driver.mkdir()
    _config(driver, "cluster")
    # what `ray job submit --runtime-env-json '{"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}'` hands its
    # driver: reroll's own runtime env must not conflict with the job's
    job = {"runtime_env": {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}}
    out, env = _train_joining(driver, "cluster.yaml", address, RAY_JOB_CONFIG_JSON_ENV_VAR=json.dumps(job))
    assert out.returncode == 0, out.stderr[-4000:]
    assert "joined the Ray cluster" in out.stderr and "2 nodes" in out.stderr
    # each node was asked what it lacks (tests/integration/test_cluster_node_check.py: one that lacks the files)
    assert "each of the 2 nodes has what the run needs there" in out.stderr

    # where the driver says: its summary's paths, below its own working directory, and nowhere else
    ckpt = Path("runs/cluster/checkpoints/step_000002")
    assert f"model:      {ckpt / 'model'}  (from_pretrained loads it" in out.stdout
    assert f"checkpoint: {ckpt}  (model, optimizer, data position: --resume)" in out.stdout
    _check_run(driver / "runs" / "cluster")
    assert not (cluster_cwd / "runs").exists()

    # the roles ran on the nodes their resources name
    query_env = {**env, **({"RAY_AUTH_MODE": "token"} if _token_exists() else {})}
    placed = subprocess.run(
        [sys.executable, "-c", ACTOR_NODES],
        env=query_env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=driver,
    )
    assert placed.returncode == 0, placed.stderr[-2000:]
    nodes = json.loads(placed.stdout.strip().splitlines()[-1])
    assert nodes["actor_train-0"] == ["node_a"] and nodes["actor_infer-0"] == ["node_b"]


@pytest.mark.long
def test_ray_job_submit_runs_reroll_train(tmp_path, two_nodes):
    """`ray job submit -- python -m reroll.cli train CONFIG`: the job's driver joins the cluster through the
    RAY_ADDRESS the job gives it, under a job runtime env that sets one of reroll's own variables."""
    _, _, dashboard = two_nodes
    if dashboard is None:
        pytest.skip('`ray job submit` needs Ray\'s dashboard: pip install "ray[default]"')
    driver = tmp_path / "driver"
    driver.mkdir()
    config = _config(driver, "job", absolute=True)  # the job's driver runs in the head node's directory
    env = {**os.environ, **({"RAY_AUTH_MODE": "token"} if _token_exists() else {})}
    runtime_env = json.dumps({"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    train = [sys.executable, "-m", "reroll.cli", "train", str(config)]
    out = subprocess.run(
        [*RAY, "job", "submit", "--address", dashboard, "--runtime-env-json", runtime_env, "--", *train],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    logs = out.stdout + out.stderr
    assert out.returncode == 0 and "succeeded" in logs, logs[-4000:]
    assert (
        "joined the Ray cluster" in logs and f"checkpoint: {driver}/runs/job/checkpoints/step_000002" in logs
    )
    _check_run(driver / "runs" / "job")
