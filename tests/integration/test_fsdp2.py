"""FSDP2 (``strategy.name: fsdp2``) takes the same optimizer step as one full copy: across ranks, across
micro-batch splits, and against the torch strategy; offload/reload keeps weights and optimizer state.

The steps compared are SGD steps of the same AdamW (tests/same_step.py says why, and derives the
tolerance): runs that differ in summation order alone agree to float32's bound on any CPU.
"""

from __future__ import annotations

import pytest
import torch

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.data.datasets import load_samples
from reroll.models.loading import load_causal_lm, load_tokenizer
from reroll.pipelines.common import sft_batch
from reroll.roles.objectives import NextToken, PolicyGradient
from reroll.roles.trainer import TrainerGroup
from reroll.runtime.actors import start_ray
from tests.conftest import write_config
from tests.same_step import assert_same_steps, use_sgd_steps

pytestmark = pytest.mark.integration

LR = 1e-2  # AdamW's, where a test trains as configured
ETA = 0.1  # SGD's, where two runs' steps are compared (gradients clipped to norm 1)


@pytest.fixture(scope="module")
def batch(assets):
    samples = load_samples([str(assets["train"])], template="{question}=")[:10]
    b = sft_batch(samples, load_tokenizer(str(assets["model"])), "{answer}")
    g = torch.Generator().manual_seed(0)
    b.advantages = torch.randn(b.response_mask.shape, generator=g) * b.response_mask
    return b


def _step(path, batch, *overrides: str):
    """An SFT step then an RL step on ``batch``, both SGD's: (sft metrics, rl metrics, the weights after)."""
    cfg = load_config(path, RunConfig, list(overrides))
    group = TrainerGroup("actor_train", cfg, trainable=True)
    try:
        use_sgd_steps(group, ETA)
        sft = group.train(batch, NextToken())
        rl = group.train(batch, PolicyGradient.of(group.cfg))
        weights = group.weight_buckets(1.0).tensors()
        return sft, rl, weights
    finally:
        group.shutdown()


def _assert_same_step(a, b, initial):
    """``sft/loss`` is each rank's share summed over its micro-batches and over the ranks: the whole
    batch's loss, whatever the split."""
    (sft_a, rl_a, w_a), (sft_b, rl_b, w_b) = a, b
    assert sft_b["sft/loss"] == pytest.approx(sft_a["sft/loss"], rel=1e-5)
    assert sft_b["sft/grad_norm"] == pytest.approx(sft_a["sft/grad_norm"], rel=1e-5)
    assert rl_b["actor/grad_norm"] == pytest.approx(rl_a["actor/grad_norm"], rel=1e-5)
    assert_same_steps(w_a, w_b, initial, steps=2)


@pytest.fixture(scope="module")
def initial(assets):
    return load_causal_lm(assets["model"]).state_dict()


def test_two_fsdp2_ranks_equal_one(tmp_path, assets, batch, initial):
    path = write_config(tmp_path / "c.yaml", assets, optim={"micro_batch_size": 4})
    start_ray(None)
    one = _step(path, batch, "strategy.name=fsdp2", "runtime.backend=local")  # in this process
    two = _step(path, batch, "strategy.name=fsdp2", "roles.actor_train.world_size=2")  # 5 rows a rank
    _assert_same_step(one, two, initial)
    # the sum over ranks, not FSDP2's default mean: a mean would halve every gradient
    assert two[0]["sft/grad_norm"] > 0.9 * one[0]["sft/grad_norm"]


def test_fsdp2_accumulation_4x1_equals_1x4(tmp_path, assets, batch, initial):
    path = write_config(tmp_path / "c.yaml", assets, runtime={"backend": "local"})
    rows = batch.select(torch.arange(4))
    whole = _step(path, rows, "strategy.name=fsdp2", "optim.micro_batch_size=4")
    split = _step(path, rows, "strategy.name=fsdp2", "optim.micro_batch_size=1")
    _assert_same_step(whole, split, initial)


def test_fsdp2_one_rank_equals_torch(tmp_path, assets, batch, initial):
    path = write_config(
        tmp_path / "c.yaml", assets, optim={"micro_batch_size": 4}, runtime={"backend": "local"}
    )
    torch_step = _step(path, batch, "strategy.name=torch")
    fsdp2_step = _step(path, batch, "strategy.name=fsdp2")
    _assert_same_step(torch_step, fsdp2_step, initial)
    assert fsdp2_step[1]["actor/peak_memory_gb"] > 0


def test_fsdp2_checkpointing_offload_policy_and_bf16_compute(tmp_path, assets, batch, initial):
    """Activation checkpointing and CPUOffloadPolicy change where work happens, not the step; bf16
    compute (``param_dtype``) keeps fp32 master weights and moves the gradient norm by a few percent."""
    path = write_config(
        tmp_path / "c.yaml", assets, optim={"micro_batch_size": 4}, runtime={"backend": "local"}
    )
    plain = _step(path, batch, "strategy.name=fsdp2")
    tricks = ["model.gradient_checkpointing=true", "strategy.fsdp2.cpu_offload=true"]
    _assert_same_step(plain, _step(path, batch, "strategy.name=fsdp2", *tricks), initial)
    bf16 = _step(path, batch, "strategy.name=fsdp2", "strategy.fsdp2.param_dtype=bfloat16")
    # measured: 0.03% apart on the first step, 0.1% on the second (after an SGD step from bf16 gradients)
    assert bf16[0]["sft/grad_norm"] == pytest.approx(plain[0]["sft/grad_norm"], rel=1e-2)
    assert bf16[1]["actor/grad_norm"] == pytest.approx(plain[1]["actor/grad_norm"], rel=5e-2)
    assert all(w.dtype == torch.float32 for w in bf16[2].values())


def test_fsdp2_offload_reload_round_trip(tmp_path, assets, batch):
    """Offload then reload between two steps gives the same weights and the same second step as none."""
    from torch.distributed.tensor import DTensor

    from reroll.strategies.fsdp2 import FSDP2Strategy

    path = write_config(tmp_path / "c.yaml", assets, optim={"lr": LR}, strategy={"name": "fsdp2"})
    cfg = load_config(path, RunConfig)

    def local(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    def two_steps(offload: bool):
        torch.manual_seed(0)
        s = FSDP2Strategy(cfg.model.path, cfg=cfg)
        s.configure_optimizer(lr=LR, betas=(0.9, 0.999), weight_decay=0.0, warmup_steps=0)
        after_step = []
        for i in range(2):
            logits = s.logits(batch.input_ids, batch.attention_mask)
            s.backward(-(logits.log_softmax(-1)[..., 5] * batch.response_mask).sum() / batch.num_tokens)
            s.step(1.0)
            if i == 0 and offload:
                before = {k: local(v) for k, v in s.model.state_dict().items()}
                moments = [local(st["exp_avg_sq"]) for st in s.optimizer.state.values()]
                s.offload()
                s.reload()
                assert all(torch.equal(local(v), before[k]) for k, v in s.model.state_dict().items())
                again = [local(st["exp_avg_sq"]) for st in s.optimizer.state.values()]
                assert len(again) == len(moments) > 0
                assert all(torch.equal(a, b) for a, b in zip(again, moments))
            after_step.append(s.full_state_dict())
        return after_step[-1]

    plain, offloaded = two_steps(False), two_steps(True)
    assert all(torch.equal(plain[k], offloaded[k]) for k in plain)
