"""``model.gradient_checkpointing`` as a count of first decoder layers or 'auto': the estimate it gives
(``kept_activations``), the count 'auto' picks from ``reroll plan``'s estimate, the strategies' gradients
with some layers checkpointed, and the errors a wrong value gets."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from reroll.config.memory import DTYPE_BYTES, KNOWN, checkpointed_layers, kept_activations, token_bytes
from reroll.config.role_memory import (
    auto_checkpointed_layers,
    estimate,
    phase_peak,
    planned,
    with_checkpointing,
)
from reroll.errors import UserError
from reroll.plan import plan
from tests.conftest import small_config

SHAPE = KNOWN["qwen2.5-3b"]  # 36 layers


def _cfg(tmp_path, **overrides):
    base = {"model.dtype": "bfloat16", "optim.micro_batch_size": 8, "rollout.max_new_tokens": 1024}
    return small_config(tmp_path, *(f"{k}={v}" for k, v in (base | overrides).items()))


def test_kept_activations_by_hand():
    # 4 layers of 10 bytes a token, inputs of 1: none checkpointed keeps every layer's 4 * 10 = 40; the
    # first 2 keep their inputs 2 * 1 and the other 2 layers all of theirs 2 * 10 = 22; 3 of 4 (and all 4:
    # the last layer's recompute runs first in backward, its input the stored one) 3 * 1 + 10 = 13
    kept = [kept_activations(4, n, layer=10.0, layer_input=1.0) for n in range(5)]
    assert kept == [40.0, 31.0, 22.0, 13.0, 13.0]


def test_the_estimate_falls_with_each_layer_checkpointed_and_keeps_true_and_false(tmp_path):
    """``token_bytes`` per count: non-increasing in the count, strictly down to ``layers - 1``; false is
    count 0 (every layer's activations, as before counts existed); true is every layer, which keeps each
    layer's input and one layer's activations being recomputed, that layer's input counted once."""
    seq = 1536
    kept = [
        token_bytes(_cfg(tmp_path, **{"model.gradient_checkpointing": n}), SHAPE, seq).kept for n in range(37)
    ]
    assert all(a > b for a, b in itertools.pairwise(kept[:36])) and kept[36] == kept[35]
    layer = token_bytes(_cfg(tmp_path), SHAPE, seq).layer
    layer_input = SHAPE.hidden * DTYPE_BYTES["bfloat16"]
    assert token_bytes(_cfg(tmp_path, **{"model.gradient_checkpointing": False}), SHAPE, seq).kept == kept[0]
    assert kept[0] == SHAPE.layers * layer
    assert token_bytes(_cfg(tmp_path, **{"model.gradient_checkpointing": True}), SHAPE, seq).kept == kept[36]
    assert kept[36] == (SHAPE.layers - 1) * layer_input + layer


def test_checkpointed_layers_of_each_setting():
    assert [checkpointed_layers(s, 36) for s in (False, True, 0, 5, 36, 99, "auto")] == [
        0,
        36,
        0,
        5,
        36,
        36,
        36,
    ]


def _train_peak(cfg, n: int, prompt_tokens: int) -> float:
    plans = {p.role: p for p in estimate(with_checkpointing(cfg, n), SHAPE, prompt_tokens=prompt_tokens)}
    return phase_peak(cfg, plans, "actor_train")


@pytest.mark.parametrize("offload", ["auto", "never"])
def test_auto_picks_the_fewest_layers_whose_train_phase_fits(tmp_path, offload):
    """For a GPU whose usable 90% lies between the estimate's train-phase peak at n - 1 and at n
    checkpointed layers, 'auto' picks n; with room for no checkpointing, 0; with room for none, the
    least the estimate holds (layers - 1). Where colocated roles stay resident, the phase holds the
    engine and the reference too, so the same GPU needs more layers checkpointed."""
    cfg = planned(_cfg(tmp_path, **{"placement.offload": offload}), 1)
    peaks = [_train_peak(cfg, n, 512) for n in range(SHAPE.layers)]
    for n in (1, 7, 20):
        gpu = (peaks[n - 1] + peaks[n]) / 2 / 0.9  # GiB of which 90% lie between the two
        assert auto_checkpointed_layers(cfg, SHAPE, "actor_train", prompt_tokens=512, gpu_memory_gib=gpu) == n
    assert auto_checkpointed_layers(cfg, SHAPE, "actor_train", prompt_tokens=512, gpu_memory_gib=1e4) == 0
    assert auto_checkpointed_layers(cfg, SHAPE, "actor_train", prompt_tokens=512, gpu_memory_gib=1) == 35
    longer = auto_checkpointed_layers(
        cfg, SHAPE, "actor_train", prompt_tokens=2048, gpu_memory_gib=(peaks[6] + peaks[7]) / 2 / 0.9
    )
    assert longer > 7  # longer rows need more of them


def test_resident_roles_need_more_layers_checkpointed(tmp_path):
    resident = planned(_cfg(tmp_path, **{"placement.offload": "never"}), 1)
    alone = planned(_cfg(tmp_path, **{"placement.offload": "always"}), 1)
    gpu = (_train_peak(alone, 10, 512) + _train_peak(alone, 11, 512)) / 2 / 0.9
    assert auto_checkpointed_layers(alone, SHAPE, "actor_train", prompt_tokens=512, gpu_memory_gib=gpu) == 11
    assert (
        auto_checkpointed_layers(resident, SHAPE, "actor_train", prompt_tokens=512, gpu_memory_gib=gpu) > 11
    )


def test_plan_prints_each_training_roles_count_and_sizes_it(tmp_path):
    cfg = _cfg(tmp_path, **{"model.path": "Qwen/Qwen2.5-3B", "model.gradient_checkpointing": "auto"})
    text, _ = plan(cfg, gpus=1, gpu_memory_gib=80)
    line = next(x for x in text.splitlines() if x.startswith("activation checkpointing"))
    n = int(line.split("actor_train ")[1].split(" of ")[0])
    assert 0 < n < 36 and line.endswith(f"actor_train {n} of 36")
    train = next(x for x in text.splitlines() if "train, old log-probs" in x)
    assert float(train.split()[3]) <= 0.9 * 80  # the train phase fits, as 'auto' chose
    fixed, _ = plan(
        _cfg(tmp_path, **{"model.path": "Qwen/Qwen2.5-3B", "model.gradient_checkpointing": n}),
        gpus=1,
        gpu_memory_gib=80,
    )

    def others(out: str) -> list[str]:
        return [x for x in out.splitlines() if not x.startswith("activation checkpointing")]

    assert others(fixed) == others(text)  # the chosen count, set by hand, plans the same
    fewer, fits = plan(
        _cfg(tmp_path, **{"model.path": "Qwen/Qwen2.5-3B", "model.gradient_checkpointing": n - 1}),
        gpus=1,
        gpu_memory_gib=80,
    )
    assert f"actor_train {n - 1} of 36" in fewer and not fits
    off, _ = plan(_cfg(tmp_path, **{"model.path": "Qwen/Qwen2.5-3B"}), gpus=1, gpu_memory_gib=80)
    assert "activation checkpointing" not in off


def test_a_wrong_value_names_the_field_and_the_settings(tmp_path):
    for bad in ("half", "-1", "2.5"):
        with pytest.raises(UserError) as e:
            _cfg(tmp_path, **{"model.gradient_checkpointing": bad})
        assert "model.gradient_checkpointing" in str(e.value)
        assert "true (every decoder layer), false (none), a count of layers" in str(e.value)


@pytest.mark.parametrize("setting", [4, "auto"])
def test_deepspeed_refuses_a_count(tmp_path, setting):
    from reroll.config.startable import start_problems

    cfg = _cfg(tmp_path, **{"strategy.name": "deepspeed", "model.gradient_checkpointing": setting})
    problems = dict(start_problems(cfg, "cuda"))
    assert (
        "strategy.name=deepspeed checkpoints every layer or none" in problems["model.gradient_checkpointing"]
    )
    ok = _cfg(tmp_path, **{"strategy.name": "deepspeed", "model.gradient_checkpointing": True})
    assert "model.gradient_checkpointing" not in dict(start_problems(ok, "cuda"))


def test_megatron_takes_a_count_of_a_dense_models_layers_at_one_pipeline_stage(tmp_path):
    """Megatron's block recompute checkpoints the first N layers of each pipeline stage: a count is taken
    at pipeline_parallel 1 for a dense model; 'auto' (chosen after the model is built) never."""
    from types import SimpleNamespace

    from reroll.config.startable import megatron_moe_checkpointing_problem, megatron_option_problems

    def problems(setting, *more):
        more = dict(more)
        cfg = _cfg(tmp_path, **{"strategy.name": "megatron", "model.gradient_checkpointing": setting, **more})
        return dict(megatron_option_problems(cfg)).get("model.gradient_checkpointing", "")

    assert problems(4) == "" and problems(True) == ""
    assert "Megatron builds its recompute into the model: set a count" in problems("auto")
    assert "counts recomputed layers per pipeline stage" in problems(
        4, ("strategy.megatron.pipeline_parallel", 2)
    )
    moe, dense = SimpleNamespace(model_type="qwen3_moe"), SimpleNamespace(model_type="qwen2")
    assert "recomputes a mixture of experts' attention only" in megatron_moe_checkpointing_problem(moe, 4)
    assert megatron_moe_checkpointing_problem(moe, True) is None
    assert megatron_moe_checkpointing_problem(dense, 4) is None


# ---- the strategies: gradients with the first N of L layers checkpointed ----


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    from reroll.data.arithmetic import ARITHMETIC_ALPHABET
    from reroll.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("ckpt")
    return build_tiny_model(
        root / "model", alphabet=ARITHMETIC_ALPHABET, hidden_size=64, num_layers=4, num_heads=2
    )


def _gradients(
    tmp_path, model_path, strategy: str, setting, later: int | None = None
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The strategy's gradients of a summed log-softmax on fixed rows, and how many times each decoder layer
    ran (twice: recomputed in backward). ``later``: a count set after the strategy started (and fsdp2
    sharded), as 'auto' sets it on a GPU."""
    from reroll.strategies.fsdp2 import FSDP2Strategy
    from reroll.strategies.torch_strategy import TorchStrategy
    from reroll.strategies.training import text_decoder_layers

    cfg = small_config(
        tmp_path,
        f"model.gradient_checkpointing={setting}",
        f"strategy.name={strategy}",
        model=str(model_path),
    )
    s = {"torch": TorchStrategy, "fsdp2": FSDP2Strategy}[strategy](cfg.model.path, cfg=cfg)
    if later is not None:
        s.checkpoint_layers(later)
    layers = text_decoder_layers(s.hf_model)
    runs = [0] * len(layers)
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    ids = torch.randint(1, 12, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0  # a padded row
    logits = s.logits(ids, mask)
    logits.float().log_softmax(-1)[..., 3].sum().backward()
    grads = {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for n, p in s.model.named_parameters()
    }
    return grads, runs


@pytest.mark.parametrize("strategy", ["torch", "fsdp2"])
def test_gradients_with_the_first_layers_checkpointed_equal_none(tmp_path, four_layers, strategy):
    """Checkpointing replays each layer's forward on the same inputs with the same kernels (no dropout in
    the tiny model), so in fp32 the recomputed activations, and every gradient, are bit-identical:
    equality, not a tolerance."""
    plain, runs = _gradients(tmp_path, four_layers, strategy, False)
    assert runs == [1, 1, 1, 1]
    some, runs = _gradients(tmp_path, four_layers, strategy, 2)
    assert runs == [2, 2, 1, 1]  # the first two recomputed in backward, the others not
    every, runs = _gradients(tmp_path, four_layers, strategy, True)
    assert runs == [2, 2, 2, 2]
    raised, runs = _gradients(tmp_path, four_layers, strategy, "auto", later=3)  # auto: none on CPU, then 3
    assert runs == [2, 2, 2, 1]
    assert plain.keys() == some.keys() == every.keys() == raised.keys() and len(plain) > 0
    for name in plain:
        assert torch.equal(plain[name], some[name]), name
        assert torch.equal(plain[name], every[name]), name
        assert torch.equal(plain[name], raised[name]), name


def test_a_count_above_the_models_layers_is_refused_at_start(tmp_path, four_layers):
    from reroll.strategies.torch_strategy import TorchStrategy

    cfg = small_config(tmp_path, "model.gradient_checkpointing=5", model=str(four_layers))
    with pytest.raises(UserError, match="model has 4 decoder layers: set at most 4"):
        TorchStrategy(cfg.model.path, cfg=cfg)


def test_auto_raises_the_count_with_longer_prompts_and_never_lowers_it(tmp_path):
    from reroll.roles.checkpointing import AutoCheckpointing

    cfg = planned(_cfg(tmp_path, **{"model.gradient_checkpointing": "auto"}), 1)
    gpu = (_train_peak(cfg, 9, 512) + _train_peak(cfg, 10, 512)) / 2 / 0.9
    applied = []
    auto = AutoCheckpointing(cfg, "actor_train", SHAPE, gpu, applied.append)
    assert auto.fit(64) < 10 and auto.fit(512) == 10
    assert auto.fit(2048) > 10
    assert auto.fit(64) == applied[-1] > 10  # kept
    assert applied == sorted(set(applied))  # applied once per raise
    follower = AutoCheckpointing(cfg, "actor_train", SHAPE, gpu, None)  # a reference's: sizing only
    assert follower.fit(512) == 10 and follower.fit(2048) == applied[-1]
    assert dataclasses.asdict(SHAPE) == dataclasses.asdict(KNOWN["qwen2.5-3b"])


def test_a_rank_estimates_with_the_shape_the_plan_reads(four_layers):
    """'auto' on a rank sizes from the loaded model's parameters and its config's token shape; the plan
    from config.json and a model built on the meta device: the same Shape, so the same count."""
    from reroll.config.memory import model_token_shape
    from reroll.models.loading import load_causal_lm, parameter_counts
    from reroll.models.shape import model_shape

    params, experts = parameter_counts(load_causal_lm(four_layers))
    on_rank = dataclasses.replace(model_token_shape(str(four_layers)), params=params, expert_params=experts)
    assert on_rank == model_shape(str(four_layers))
