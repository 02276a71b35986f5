"""After a Ray node died: the run's bundles and off-pool workers packed onto the nodes left (a made-up
cluster), and the error that names what no longer fits and the fix."""

from __future__ import annotations

from pathlib import Path

from reroll.config.placement import device_map, run_roles
from reroll.config.replacement import Demand, lost_node_message, run_demands, unplaced
from reroll.config.schema import RunConfig
from tests.conftest import small_config


def _cfg(tmp_path: Path, *overrides: str) -> RunConfig:
    return small_config(tmp_path, *overrides)


def _demands(cfg: RunConfig) -> list[Demand]:
    return run_demands(cfg, run_roles(cfg, "cpu"), device_map(cfg, "cpu") if cfg.placement.devices else None)


def _pooled(tmp_path: Path) -> RunConfig:
    """Two CPU pool devices of 1 CPU: actor_train's two ranks, the engine beside rank 0, the reference on
    device 1; every pool role asks for one 'worker' resource (the nodes that may hold the pool)."""
    return _cfg(
        tmp_path,
        "placement.devices=2",
        "placement.cpus_per_device=1",
        "roles.actor_train.world_size=2",
        "roles.actor_infer.devices=[0]",
        "roles.reference.devices=[1]",
        "roles.actor_train.resources={worker: 1}",
    )


def test_the_run_demands_a_bundle_per_pool_device_and_a_slot_per_worker_off_it(tmp_path):
    demands = _demands(_pooled(tmp_path))
    # the pool's two bundles, then reward's one worker (0.25 CPU by default)
    assert [d.name for d in demands] == [
        "pool device 0 (actor_train[0] actor_infer[0])",
        "pool device 1 (actor_train[1] reference[0])",
        "reward[0]",
    ]
    assert demands[0].resources == {"CPU": 1.0, "worker": 1.0}
    assert demands[0].roles == ("actor_train", "actor_infer")
    assert demands[2].resources == {"CPU": 0.25, "GPU": 0.0}


def test_a_lost_node_that_the_others_can_stand_in_for_leaves_nothing_unplaced(tmp_path):
    demands = _demands(_pooled(tmp_path))
    head = {"CPU": 1.0}  # the driver's node: room for reward, not for a bundle (no 'worker')
    # three worker nodes of 1 CPU each at the start; the one holding device 1's bundle died
    left = [head, {"CPU": 1.0, "worker": 1.0}, {"CPU": 1.0, "worker": 1.0}]
    assert unplaced(demands, left) == []
    # one worker node of 2 CPUs holds both bundles (a bundle needs one node, not one per node)
    assert unplaced(demands, [head, {"CPU": 2.0, "worker": 2.0}]) == []


def test_a_bundle_must_fit_whole_on_one_node(tmp_path):
    """Two nodes with half a bundle's CPUs each hold as many CPUs as the bundle, but not the bundle."""
    cfg = _cfg(tmp_path, "placement.devices=1", "placement.cpus_per_device=2")
    demands = _demands(cfg)
    assert [d.name for d in unplaced(demands, [{"CPU": 1.0}, {"CPU": 1.25}])] == [
        "pool device 0 (actor_train[0] actor_infer[0] reference[0])"
    ]
    assert unplaced(demands, [{"CPU": 1.0}, {"CPU": 2.25}]) == []


def test_what_no_longer_fits_is_named_with_the_fix(tmp_path):
    demands = _demands(_pooled(tmp_path))
    left = [{"CPU": 1.0}, {"CPU": 1.0, "worker": 1.0, "node:10.0.0.2": 1.0, "memory": 1e9}]
    missing = unplaced(demands, left)
    assert [d.name for d in missing] == ["pool device 1 (actor_train[1] reference[0])"]
    ckpt = tmp_path / "run" / "checkpoints" / "step_000004"
    message = lost_node_message(missing, left, lost=1, step=5, checkpoint=ckpt)
    assert message.startswith("placement: 1 Ray node died at step 5, and the rest of the cluster no longer")
    assert "  pool device 1 (actor_train[1] reference[0]): CPU 1, worker 1\n" in message
    assert "  node 0: CPU 1\n  node 1: CPU 1, worker 1\n" in message  # Ray's own node keys left out
    assert f"`reroll train CONFIG --resume` continues from {ckpt}" in message
    assert "lower roles.actor_train.world_size or roles.reference.world_size and placement.devices" in message
    fresh = lost_node_message(missing, left, lost=2, step=1, checkpoint=None)
    assert "2 Ray nodes died at step 1" in fresh and "no checkpoint was written yet" in fresh


def test_workers_off_the_pool_are_packed_too(tmp_path):
    """No pool: each of reward's 3 workers asks for 1 CPU; two 1-CPU nodes hold two of them."""
    cfg = _cfg(tmp_path, "roles.reward.world_size=3", "roles.reward.num_cpus_per_worker=1")
    demands = [d for d in _demands(cfg) if d.name.startswith("reward")]
    assert [d.name for d in unplaced(demands, [{"CPU": 1.0}, {"CPU": 1.5}])] == ["reward[2]"]
