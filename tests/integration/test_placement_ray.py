"""Placement through the real CLI and Ray: colocated and separate actor_train/actor_infer both train,
give the same numbers, and a pool the cluster cannot hold is refused with the device map."""

from __future__ import annotations

import pytest

from reroll.pipelines.preflight_machine import Machine
from reroll.runtime.metrics import read_metrics
from tests.conftest import reroll_cli, write_config

pytestmark = pytest.mark.integration


def _train(path, *overrides):
    return reroll_cli("train", path, *overrides)


@pytest.mark.long  # 57 s in CI; test_phases keeps colocation there
def test_colocated_and_separate_placement_train_the_same(tmp_path, assets):
    path = write_config(tmp_path / "run.yaml", assets, total_steps=3, algorithm={"kl_coef": 0.0})
    colocated = _train(
        path,
        "name=colocated",
        "placement.devices=1",
        "placement.cpus_per_device=1",
        "placement.offload=always",
    )
    assert colocated.returncode == 0, colocated.stderr[-3000:]
    separate = _train(
        path,
        "name=separate",
        "placement.devices=2",
        "placement.cpus_per_device=0.5",
        "roles.actor_infer.devices=[1]",
    )
    assert separate.returncode == 0, separate.stderr[-3000:]

    co, sep = read_metrics(tmp_path / "runs" / "colocated"), read_metrics(tmp_path / "runs" / "separate")
    # The offload/reload path ran every step (engine sleep, trainer offload) and its time is reported.
    assert all("timing/offload" in r and "timing/reload" in r for r in co[1:])
    assert all(r["offload/bytes"] == 0.0 == r["reload/bytes"] for r in co[1:])  # CPU: nothing moves
    assert all("timing/offload" not in r for r in sep)
    # Where roles sit changes no number: same seed, same rollouts and losses.
    for a, b in zip(co[1:], sep[1:]):
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-5)


def test_a_pool_bigger_than_the_cluster_is_refused_with_the_map(tmp_path, assets):
    # train would start its own Ray cluster on this machine: the check sees this machine before Ray starts
    cpus = int(Machine.here().cpus)
    n = cpus + 6
    path = write_config(tmp_path / "run.yaml", assets, algorithm={"kl_coef": 0.0})
    out = _train(
        path, f"placement.devices={n}", "placement.cpus_per_device=1", f"roles.actor_infer.devices=[{n - 1}]"
    )
    assert out.returncode == 2
    assert f"placement: on this machine ({cpus} CPUs, " in out.stderr
    assert f"the pool needs {n} CPU ({n} devices) but the Ray cluster has {cpus}" in out.stderr
    assert (
        "cpu device 0: actor_train[0]" in out.stderr and f"cpu device {n - 1}: actor_infer[0]" in out.stderr
    )
    assert "Traceback" not in out.stderr
