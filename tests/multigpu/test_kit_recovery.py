"""Kit (f): one of two actor_train ranks (fsdp2, NCCL) killed mid-run on GPUs: the run restarts the
role, loads the latest checkpoint, redoes the steps since and finishes. The GPU run of
``tests/integration/test_recovery.py``'s claim (CPU, gloo, every rank of a role killed there), on the
path users run: two GPUs, actor_train and two vLLM engines colocated, weights over CUDA IPC.

Asserted: every step 0-4 logged once, one restart counted (``recovery/restarts``), the run's exit
normal, actor_train restarted and then the engines synced (the checkpoint's weights), the redone step
trained. Measured: the redone step's seconds (its second attempt, after the restart and the
checkpoint load) against a plain step's.
"""

from __future__ import annotations

import pytest

from reroll.engines import engine_available
from tests.multigpu.kit import needs_gpus

pytestmark = [
    pytest.mark.gpu,
    *needs_gpus(2),
    pytest.mark.skipif(not engine_available("vllm"), reason="needs vllm"),
]

KILLED_AT = 3  # the step whose start finds actor_train rank 1 dead (a checkpoint at step 2 to go back to)

ON_GPUS = [
    "placement.devices=2",
    "placement.device_type=cuda",
    "strategy.name=fsdp2",
    "roles.actor_train.world_size=2",
    "roles.actor_infer.world_size=2",
    "rollout.engine=vllm",
    "rollout.vllm.gpu_memory_utilization=0.3",
    "rollout.vllm.max_model_len=64",
    "model.dtype=bfloat16",
    "total_steps=4",
    "checkpoint.every=2",
    "eval.every=0",
    "runtime.max_restarts=1",
]


def test_a_killed_trainer_rank_is_restarted_and_the_run_finishes(tmp_path, assets, monkeypatch, kit_record):
    import ray

    from reroll.config.loader import load_config
    from reroll.config.schema import RunConfig
    from reroll.pipelines import run as run_module
    from reroll.pipelines.rlvr import RLVR
    from reroll.pipelines.roles import Roles
    from reroll.runtime.metrics import read_metrics
    from tests.conftest import write_config

    # a reward the untrained tiny model scores 0 and 1 on: every step has advantages to train on
    reward = {"fn": "tests.integration.test_weight_sync_collective:starts_with_digit"}
    cfg = load_config(write_config(tmp_path / "c.yaml", assets, reward=reward), RunConfig, ON_GPUS)
    real_step, real_restart, real_sync = RLVR.step, Roles.restart, Roles.sync_weights
    killed, events = [], []  # what the run did after the kill: restarts and syncs, in order

    def step(self, roles, n):
        if n == KILLED_AT and not killed:
            killed.append(roles.actor_train._handles[1])
            ray.kill(killed[0], no_restart=True)
        return real_step(self, roles, n)

    def restart(self, role):
        events.append(f"restart {role}")
        return real_restart(self, role)

    def sync_weights(self):
        if killed:
            events.append("sync")
        return real_sync(self)

    monkeypatch.setattr(RLVR, "step", step)
    monkeypatch.setattr(Roles, "restart", restart)
    monkeypatch.setattr(Roles, "sync_weights", sync_weights)
    run_module.run(RLVR, cfg)
    assert killed  # the kill happened
    rows = read_metrics(cfg.run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # the redone step logged once
    assert rows[-1]["recovery/restarts"] == 1
    assert events[:2] == ["restart actor_train", "sync"], events  # the engines got the checkpoint's weights
    redone = rows[KILLED_AT]
    assert redone["actor/grad_norm"] > 0  # the redone step trained
    plain = [r["timing/step"] for r in rows[1:] if r["step"] not in (1, KILLED_AT)]
    kit_record("redone step", redone["timing/step"], "s")
    kit_record("plain step", sum(plain) / len(plain), "s")
