"""Kit (a): two FSDP2 ranks on two GPUs (NCCL) take the optimizer steps one rank takes on one GPU.

The CPU test of the same claim (``tests/integration/test_fsdp2.py``, gloo) run on CUDA: its batch, its
two steps (SFT then RL, both SGD steps of the same AdamW) and its comparison, whose tolerance
``tests/same_step.py`` derives from float32 summation orders; it holds on a GPU as long as float32
matmuls stay float32 (torch's default, ``torch.backends.cuda.matmul.allow_tf32`` False, which reroll
never changes; asserted in every rank). Each rank is a Ray actor given one GPU of its own
(``roles.actor_train.num_gpus_per_worker=1``; asserted: the two ranks' device uuids differ).
"""

from __future__ import annotations

import pytest

import tests.integration.test_fsdp2 as cpu_test
from tests.integration.test_fsdp2 import _assert_same_step, _step
from tests.multigpu.kit import needs_gpus
from tests.same_step import F32_EPS, RTOL, on_every_rank, use_sgd_steps

pytestmark = [pytest.mark.integration, *needs_gpus(2)]

batch, initial = cpu_test.batch, cpu_test.initial  # the CPU test's fixtures: its batch, its initial weights
ON_GPUS = ["strategy.name=fsdp2", "runtime.backend=ray", "roles.actor_train.num_gpus_per_worker=1"]


def test_two_fsdp2_ranks_on_two_gpus_equal_one(tmp_path, assets, batch, initial, kit_record, monkeypatch):
    from reroll.runtime.actors import start_ray
    from tests.conftest import write_config

    def where(worker) -> tuple[str, str, bool]:
        """A rank's device, its GPU's uuid, whether its float32 matmuls may use TF32 (run in the rank's
        process: a function of the test, which Ray pickles by value)."""
        import torch

        device = worker.strategy.device
        uuid = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""
        return device.type, uuid, torch.backends.cuda.matmul.allow_tf32

    placed = []  # each run's ranks, read as _step configures their optimizer

    def sgd_steps_noting_devices(group, eta):
        placed.append(on_every_rank(group, where))
        use_sgd_steps(group, eta)

    monkeypatch.setattr(cpu_test, "use_sgd_steps", sgd_steps_noting_devices)
    path = write_config(tmp_path / "c.yaml", assets, optim={"micro_batch_size": 4})
    start_ray(None)
    one = _step(path, batch, *ON_GPUS, "roles.actor_train.world_size=1")
    two = _step(path, batch, *ON_GPUS, "roles.actor_train.world_size=2")  # 5 rows a rank
    (_, _, w_one), (_, _, w_two) = one, two
    used = max(
        float((w_two[k] - w_one[k]).norm())
        / (RTOL * float((w_one[k] - w0).norm()) + 4 * F32_EPS * float(w_one[k].norm()))
        for k, w0 in initial.items()
    )
    rel = abs(two[0]["sft/grad_norm"] - one[0]["sft/grad_norm"]) / one[0]["sft/grad_norm"]
    kit_record("sft grad-norm rel diff", rel)
    kit_record("weights diff / bound", used)
    _assert_same_step(one, two, initial)
    # the sum over ranks, not FSDP2's default mean: a mean would halve every gradient
    assert two[0]["sft/grad_norm"] > 0.9 * one[0]["sft/grad_norm"]
    # where it ran (checked last, so that a run on CPUs checks everything else): one GPU, then two
    [[(kind, _, tf32)], ranks] = placed
    assert kind == "cuda" and not tf32
    assert [r[0] for r in ranks] == ["cuda", "cuda"] and ranks[0][1] != ranks[1][1], ranks
    assert not any(r[2] for r in ranks)
