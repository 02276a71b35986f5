"""A Ray node dies mid-run on a simulated cluster (``ray.cluster_utils.Cluster``: a head and worker
nodes, CPU only, as processes of this machine; tests/integration/node_loss_run.py runs it in a fresh
interpreter): the pool's bundle it held is placed again on a node left that has room and the run finishes
there; where no node left has room, the run stops with one error that names what no longer fits and the
fix. The decision itself is tested as a pure function, in CI, in tests/unit/test_replacement.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, write_config

pytestmark = pytest.mark.integration

STEPS = 3


def _run(tmp_path, assets, name: str, workers: int) -> tuple[dict, str]:
    """The run ``name`` on a head and ``workers`` worker nodes, the pool's node removed as step 2 begins:
    (what node_loss_run wrote, its stderr). One CPU pool device holds actor_train, actor_infer and
    reference; its bundle asks for the 'worker' resource only the worker nodes have."""
    sections = {
        "name": name,
        "algorithm": {"kl_coef": 0.01},
        "placement": {"devices": 1, "cpus_per_device": 1},
        "roles": {
            "actor_train": {"resources": {"worker": 1}, "torch_threads": 1},
            **{r: {"torch_threads": 1} for r in ("actor_infer", "reference", "reward")},
        },
        "checkpoint": {"every": 1, "keep_last": 1},
        "eval": {"every": 0},
        "runtime": {"max_restarts": 4},
    }
    config = write_config(tmp_path / f"{name}.yaml", assets, total_steps=STEPS, **sections)
    out = tmp_path / f"{name}.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "RAY_AUTH_MODE": "disabled",  # the nodes and the driver alike (a token on this machine or not)
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.node_loss_run", str(config), str(workers), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and out.exists(), done.stderr[-4000:]
    return json.loads(out.read_text()), done.stderr


@pytest.mark.long  # 52 s on 2 cores (120 s shared): a three-node cluster's start and a run that recovers
def test_a_lost_nodes_bundle_is_placed_again_on_the_rest_and_the_run_finishes(tmp_path, assets):
    result, stderr = _run(tmp_path, assets, "fits", workers=2)  # the bundle on one, the other stands by
    assert "error" not in result, result["error"]
    metrics = result["metrics"]
    assert [m["step"] for m in metrics] == list(range(STEPS + 1))  # step 2 redone from step 1's checkpoint
    # the roles the node held restarted at once, as one recovery (the engine's death found it)
    assert metrics[-1]["recovery/restarts"] == 1
    assert "placement: 1 Ray node(s) died at step 2; the run fits the 2 left" in stderr
    assert "a lost node held actor_infer, actor_train, reference: restarting them all" in stderr
    assert result["now"] != result["lost"]  # the bundle, and the roles' new workers, on the node left
    assert (tmp_path / "runs" / "fits" / f"checkpoints/step_{STEPS:06d}/COMPLETE").exists()


@pytest.mark.long  # 41 s on 2 cores (100 s shared), most of it the cluster's start; CI keeps test_replacement
def test_a_lost_node_that_no_other_can_stand_in_for_stops_the_run_naming_the_fix(tmp_path, assets):
    result, _ = _run(tmp_path, assets, "nofit", workers=1)  # the only node that may hold the pool
    message = result["error"]
    assert message.startswith("placement: 1 Ray node died at step 2, and the rest of the cluster no longer")
    assert "  pool device 0 (actor_train[0] actor_infer[0] reference[0]): CPU 1, worker 1\n" in message
    assert "the nodes left have:\n  node 0: CPU 2\n" in message
    checkpoint = tmp_path / "runs" / "nofit" / "checkpoints" / "step_000001"
    assert f"`reroll train CONFIG --resume` continues from {checkpoint}" in message
    assert "lower roles.actor_infer.world_size or roles.actor_train.world_size or" in message
    assert (checkpoint / "COMPLETE").exists()  # what --resume continues from is there
    assert [m["step"] for m in result["metrics"]] == [0, 1]  # it stopped at step 2
