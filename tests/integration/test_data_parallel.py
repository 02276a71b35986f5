"""Two actor_train ranks (Ray actors, gloo) take the same optimizer step as one rank on the whole batch,
with full copies (torch, what strategy.name auto picks on CPUs) and sharded (fsdp2, its pick on GPUs).

The steps are compared as SGD steps (tests/same_step.py says why and derives the tolerance)."""

from __future__ import annotations

import pytest
import torch

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.data.datasets import load_samples
from reroll.models.loading import load_tokenizer
from reroll.pipelines.common import sft_batch
from reroll.roles.objectives import NextToken, PolicyGradient
from reroll.roles.trainer import TrainerGroup
from reroll.runtime.actors import start_ray
from tests.conftest import write_config
from tests.same_step import assert_same_steps, use_sgd_steps

pytestmark = pytest.mark.integration

ETA = 0.1  # SGD's learning rate (gradients clipped to norm 1: a step of at most 0.1 in norm)


def _step(cfg_path, world_size: int, batch, strategy: str):
    overrides = [f"roles.actor_train.world_size={world_size}", f"strategy.name={strategy}"]
    cfg = load_config(cfg_path, RunConfig, overrides)
    group = TrainerGroup("actor_train", cfg, trainable=True)
    try:
        use_sgd_steps(group, ETA)
        sft = group.train(batch, NextToken())
        rl = group.train(batch, PolicyGradient.of(group.cfg))
        weights = group.weight_buckets(1.0).tensors()
        return sft, rl, weights
    finally:
        group.shutdown()


def _initial(path):
    from transformers import AutoModelForCausalLM

    cfg = load_config(path, RunConfig)
    return AutoModelForCausalLM.from_pretrained(cfg.model.path).state_dict()


@pytest.mark.parametrize("strategy", ["torch", "fsdp2"])
def test_two_ranks_equal_one(tmp_path, assets, strategy):
    path = write_config(tmp_path / "c.yaml", assets, optim={"micro_batch_size": 4})
    start_ray(None)
    samples = load_samples([str(assets["train"])], template="{question}=")[:10]
    batch = sft_batch(samples, load_tokenizer(str(assets["model"])), "{answer}")
    g = torch.Generator().manual_seed(0)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask

    sft1, rl1, w1 = _step(path, 1, batch, strategy)
    sft2, rl2, w2 = _step(path, 2, batch, strategy)  # 5 rows per rank, micro-batches of 4 and 1
    assert sft2["sft/grad_norm"] == pytest.approx(sft1["sft/grad_norm"], rel=1e-5)
    assert rl2["actor/grad_norm"] == pytest.approx(rl1["actor/grad_norm"], rel=1e-5)
    assert_same_steps(w1, w2, _initial(path), steps=2)
