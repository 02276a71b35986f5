"""Kit (d): context parallelism 2 (Ulysses, ``strategy.context_parallel=2``) on two GPUs over NCCL
computes what one rank on one GPU computes on the whole rows: the log-prob pass, an SFT step and an RL
step. The GPU run of ``tests/integration/test_context_parallel.py`` (gloo there): its model (4 attention
heads, 2 key-value heads: one of each per rank), its batch, and its tolerances, which follow from
float32 summation orders (``tests/same_step.py``; log-probs within ``RTOL * max|log-prob|``). Each rank
is a Ray actor given a GPU of its own (``roles.actor_train.num_gpus_per_worker=1``).
"""

from __future__ import annotations

import pytest

import tests.integration.test_context_parallel as cpu_test
from tests.integration.test_context_parallel import ETA, FSDP2
from tests.multigpu.kit import needs_gpus

pytestmark = [pytest.mark.integration, *needs_gpus(2)]

batch, gqa_config = cpu_test.batch, cpu_test.gqa_config  # the CPU test's fixtures: its batch, its model
ON_GPUS = ["runtime.backend=ray", "roles.actor_train.num_gpus_per_worker=1"]


def _steps(config, batch, *overrides: str):
    """Log-probs, an SFT step and an RL step (SGD steps of the same AdamW) through a ``TrainerGroup`` of
    ``config`` with ``overrides``: (log-probs, sft metrics, rl metrics, weights, each rank's attention
    and device)."""
    import torch

    from reroll.config.loader import load_config
    from reroll.config.schema import RunConfig
    from reroll.roles.objectives import NextToken, PolicyGradient
    from reroll.roles.trainer import TrainerGroup
    from tests.same_step import on_every_rank, use_sgd_steps

    def where(w) -> tuple[str, str]:  # in the rank's process (Ray pickles a function of a function by value)
        device = w.strategy.device
        uuid = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else device.type
        return w.strategy.hf_model.config._attn_implementation, uuid

    group = TrainerGroup("actor_train", load_config(config, RunConfig, [*FSDP2, *overrides]), trainable=True)
    try:
        seen = on_every_rank(group, where)
        use_sgd_steps(group, ETA)
        logprobs = group.compute_logprobs(batch)
        sft = group.train(batch, NextToken())
        rl = group.train(batch, PolicyGradient.of(group.cfg))
        return logprobs, sft, rl, group.weight_buckets(1.0).tensors(), seen
    finally:
        group.shutdown()


def test_two_context_parallel_ranks_on_two_gpus_equal_one(gqa_config, batch, kit_record):
    import torch

    from reroll.config.loader import load_config
    from reroll.config.schema import RunConfig
    from reroll.models.loading import load_causal_lm
    from reroll.runtime.actors import start_ray
    from tests.same_step import RTOL, assert_same_steps

    start_ray(None)
    one = _steps(gqa_config, batch, *ON_GPUS)
    two = _steps(gqa_config, batch, *ON_GPUS, "strategy.context_parallel=2", "roles.actor_train.world_size=2")
    assert not one[4][0][0].startswith("reroll_ulysses")
    assert all(attention.startswith("reroll_ulysses") for attention, _ in two[4]), two[4]

    bound = RTOL * float(one[0].abs().max())
    gap = float((two[0] - one[0]).abs().max())
    kit_record("log-prob max diff", gap, "nats")
    kit_record("log-prob diff / bound", gap / bound)
    torch.testing.assert_close(two[0], one[0], rtol=0, atol=bound)
    assert two[1]["sft/loss"] == pytest.approx(one[1]["sft/loss"], rel=1e-5)
    assert two[2]["actor/grad_norm"] == pytest.approx(one[2]["actor/grad_norm"], rel=1e-5)
    initial = load_causal_lm(load_config(gqa_config, RunConfig).model.path).state_dict()
    assert_same_steps(one[3], two[3], initial, steps=2)
    # where it ran (checked last, so that a run on CPUs checks everything else): two GPUs
    assert len({gpu for _, gpu in two[4]}) == 2 and "cpu" not in {gpu for _, gpu in two[4]}, two[4]
