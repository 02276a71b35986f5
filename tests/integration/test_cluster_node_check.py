"""A Ray cluster whose second node does not see the driver's files: ``reroll train`` joining it stops before
any role starts, with one error naming the run directory and the model path that node lacks, and the node.

The second node runs in a mount namespace of its own (``unshare --mount``) with an empty tmpfs over the
test's directory, where the driver's run directory, data and tiny model are: what a node whose disk is its
own looks like at those paths (as root, as on CI's machines; skipped where ``unshare`` cannot mount)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

import pytest

from tests.conftest import ROOT
from tests.integration.test_ray_cluster import _config, _node_env, _start_cluster, _stop, _train_joining

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
