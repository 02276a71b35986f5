"""A Ray cluster whose second node does not see the driver's files: ``reroll train`` joining it stops before
any role starts, with one error naming the run directory and the model path that node lacks, and the node.

The second node runs in a mount namespace of its own (``unshare --mount``) with an empty tmpfs over the
test's directory, where the driver's run directory, data and tiny model are: what a node whose disk is its
own looks like at those paths (as root, as on CI's machines; skipped where ``unshare`` cannot mount)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import yaml

from reroll.runtime.metrics import read_metrics
from tests.conftest import ROOT
from tests.integration.test_ray_cluster import (
    _check_run,
    _config,
    _node_env,
    _start_cluster,
    _stop,
    _train_joining,
)

pytestmark = pytest.mark.integration


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = tempfile.mkdtemp(prefix="rr-unshare-")
    try:
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs", "tmpfs", probe],
            capture_output=True,
            timeout=30,
        )
        return done.returncode == 0
    finally:
        os.rmdir(probe)


@pytest.mark.long  # about 40 s each on 2 cores: two nodes' start, then the driver stops in seconds
@pytest.mark.skipif(not _can_unshare(), reason="needs `unshare --mount` (root) to give a node its own files")
@pytest.mark.parametrize("without", ["files", "reroll"])
def test_a_node_without_the_drivers_files_stops_the_run_before_any_role_starts(tmp_path, without):
    """``files``: the node lacks the run directory and the tiny model; ``reroll``: it lacks reroll too
    (its source tree hidden as well), so the check's own task cannot run there."""
    shared_by_none = tmp_path / "shared-by-none"
    driver = shared_by_none / "driver"
    driver.mkdir(parents=True)
    _config(driver, "unshared")
    hidden = [shared_by_none] + ([ROOT] if without == "reroll" else [])
    temp = [tempfile.mkdtemp(prefix="rr-", dir="/tmp") for _ in range(2)]
    nodes: list[subprocess.Popen] = []
    try:
        address, _ = _start_cluster(nodes, temp, tmp_path / "logs", tmp_path, _node_env(), False, hidden)
        began = time.monotonic()
        out, _ = _train_joining(driver, "unshared.yaml", address)
        seconds = time.monotonic() - began
    finally:
        for proc in reversed(nodes):
            _stop(proc)
        for path in temp:
            shutil.rmtree(path, ignore_errors=True)

    assert out.returncode != 0
    assert "joined the Ray cluster" in out.stderr  # the driver reached the cluster before it stopped
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    run_dir = driver / "runs" / "unshared"
    lines = [line.strip() for line in out.stderr.splitlines()]
    print(f"stopped {seconds:.1f} s after `reroll train` began")
    assert not (run_dir / "checkpoints").exists() and not (run_dir / ".reroll-node-check").exists()
    if without == "reroll":
        assert "error: the Ray cluster (2 nodes) has 1 problem:" in lines, out.stderr[-3000:]
        [line] = [line for line in lines if line.startswith("runtime: on node ")]
        assert "reroll could not run there (" in line and "install reroll" in line
        return
    assert "error: the Ray cluster (2 nodes) has 2 problems:" in lines, out.stderr[-3000:]
    [run_line] = [line for line in lines if line.startswith("output_dir: on node ")]
    assert f"the run directory {str(run_dir)!r} is missing here" in run_line
    [model_line] = [line for line in lines if line.startswith("model.path: on node ")]
    assert "does not exist here" in model_line
    # the same node in both, and only one: the head node shares the driver's files
    assert run_line.split(": ")[1] == model_line.split(": ")[1] and "," not in run_line.split(": ")[1]
    assert not list(run_dir.glob("metrics*"))  # nothing started: no step was logged


@pytest.mark.long  # about 3 minutes on 2 cores: two nodes' start, a run of two steps and its resume
@pytest.mark.skipif(not _can_unshare(), reason="needs `unshare --mount` (root) to give a node its own files")
def test_nodes_with_disks_of_their_own_checkpoint_through_the_storage(tmp_path):
    """``checkpoint.storage`` set: the second node's run directory is its own (a tmpfs over it), and the
    run goes on. actor_train's rank sits there, so every checkpoint's weights and optimizer state, and
    the reference's snapshot, are written on that node alone: they reach the driver's run directory
    (and the reference's rank, on the head node) through the storage, and the resumed run's rank gets
    the checkpoint back the same way (``reroll.runtime.node_copies``)."""
    driver = tmp_path / "driver"
    driver.mkdir()
    own = tmp_path / "own"  # the run directory's parent: the second node sees an empty tmpfs there
    own.mkdir()
    config = _config(driver, "owndisk", absolute=True)
    cfg = yaml.safe_load(config.read_text())
    cfg["output_dir"] = str(own / "runs" / "{name}")
    cfg["checkpoint"].update(storage=f"file://{tmp_path / 'bucket'}/{{name}}", keep_last=3)
    cfg["roles"]["actor_train"]["resources"] = {"node_b": 1}  # on the node whose disk is its own
    cfg["roles"]["actor_infer"]["resources"] = {"node_a": 1}
    cfg["roles"]["reference"] = {"resources": {"node_a": 1}, "torch_threads": 1}
    cfg["algorithm"]["kl_coef"] = 0.04  # a reference, which loads the snapshot actor_train wrote on node_b
    config.write_text(yaml.safe_dump(cfg))
    run_dir = own / "runs" / "owndisk"
    temp = [tempfile.mkdtemp(prefix="rr-", dir="/tmp") for _ in range(2)]
    nodes: list[subprocess.Popen] = []
    try:
        address, _ = _start_cluster(nodes, temp, tmp_path / "logs", tmp_path, _node_env(), False, [own])
        first, _ = _train_joining(driver, str(config), address)
        assert first.returncode == 0, first.stderr[-4000:]
        assert "each of the 2 nodes has what the run needs there" in first.stderr
        # the driver's run directory holds every checkpoint whole, though actor_train wrote none of it here
        for step in (1, 2):
            ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
            assert (ckpt / "COMPLETE").exists() and list((ckpt / "model").glob("*.safetensors"))
            assert list((ckpt / "state").glob("*.distcp")), sorted(p.name for p in ckpt.rglob("*"))
        assert list((run_dir / "reference" / "model").glob("*.safetensors"))  # the snapshot, from node_b
        _check_run(run_dir)  # the engine on node_a scored its samples as the trainer on node_b did

        cfg["total_steps"] = 3
        config.write_text(yaml.safe_dump(cfg))
        resumed = subprocess.run(
            [sys.executable, "-m", "reroll.cli", "train", str(config), "--resume"],
            cwd=driver,
            env={**os.environ, "RAY_ADDRESS": address},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert resumed.returncode == 0, resumed.stderr[-4000:]
    finally:
        for proc in reversed(nodes):
            _stop(proc)
        for path in temp:
            shutil.rmtree(path, ignore_errors=True)
    steps = [m["step"] for m in read_metrics(run_dir)]
    assert steps == [0, 1, 2, 3]  # resumed after step 2 on node_b's downloaded copy: no step redone
    assert (run_dir / "checkpoints" / "step_000003" / "COMPLETE").exists()
    assert (tmp_path / "bucket" / "owndisk" / "checkpoints" / "step_000003" / "COMPLETE").exists()
