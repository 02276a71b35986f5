"""``reroll plan``'s activations under Megatron's tensor parallelism (``reroll.config.memory.token_bytes``):
the TP ranks split attention's and the MLP's activations; sequence parallelism splits the rest (the norms',
the residual stream, a checkpointed layer's input) over them too, which are otherwise replicated."""

from __future__ import annotations

import pytest

from reroll.config.memory import Shape, token_bytes
from tests.conftest import small_config

# 2 layers, hidden 10, MLP width 30, vocab 100: in bf16 (2 bytes) a token leaves in one layer
# inside the TP regions 2 * (4 * 10 + 4 * 30) = 320 bytes, outside 2 * 5 * 10 = 100 (fused norms)
SHAPE = Shape(0.0, 2, 10, 2, 5, 100, intermediate=30)


def _bytes(tmp_path, *overrides: str):
    base = ["model.dtype=bfloat16", "model.fused_norm=true", "rollout.max_new_tokens=8"]
    cfg = small_config(tmp_path, *base, *overrides)
    return token_bytes(cfg, SHAPE, 16, context_parallel=cfg.strategy.megatron.context_parallel)


@pytest.mark.parametrize(
    ("overrides", "layer", "kept_checkpointed", "shards"),
    [
        # one rank: 320 + 100 = 420; every layer checkpointed keeps 1 input (2 * 10 = 20) + 1 layer: 440
        ([], 420.0, 440.0, 1),
        # TP=2 without SP: 320 / 2 + 100 = 260, the input replicated: 20 + 260 = 280
        (
            ["strategy.megatron.tensor_parallel=2", "strategy.megatron.sequence_parallel=false"],
            260.0,
            280.0,
            2,
        ),
        # TP=2 with SP: 320 / 2 + 100 / 2 = 210, the input split too: 10 + 210 = 220
        (
            ["strategy.megatron.tensor_parallel=2", "strategy.megatron.sequence_parallel=true"],
            210.0,
            220.0,
            2,
        ),
        # SP at TP=1 splits nothing
        (["strategy.megatron.sequence_parallel=true"], 420.0, 440.0, 1),
        # CP=2 x TP=2 without SP: every activation halved again: 130, 10 + 130 = 140
        (
            ["strategy.megatron.tensor_parallel=2", "strategy.megatron.context_parallel=2"],
            130.0,
            140.0,
            4,
        ),
    ],
)
def test_sequence_parallel_splits_the_activations_outside_the_tp_regions(
    tmp_path, overrides, layer, kept_checkpointed, shards
):
    megatron = ["strategy.name=megatron", *overrides]
    none = _bytes(tmp_path, *megatron, "model.gradient_checkpointing=false")
    every = _bytes(tmp_path, *megatron, "model.gradient_checkpointing=true")
    assert none.layer == layer
    assert none.kept == 2 * layer  # 2 layers, each keeping all of its activations
    assert every.kept == kept_checkpointed
    # the head: 100 logits of 2 bytes, split over the TP ranks' vocabulary shards and the CP ranks' tokens
    # (``shards``) whatever SP; at the 8 of 16 positions before response tokens, and their gradient
    assert none.all_logits == 200 / shards
    assert none.train_logits == 2 * 200 / shards * 8 / 16


def test_an_interleaved_pipeline_holds_more_micro_batches_on_its_first_stage(tmp_path):
    """1F1B's first stage holds ``pp`` micro-batches' activations; the interleaved schedule's warm-up
    runs ``2 (pp - 1) + (vp - 1) pp`` chunk forwards (Megatron-Core's ``get_pp_rank_microbatches`` with
    groups of pp) and one more, each 1/vp of the stage: at PP=2 x VPP=2 (2 + 2 + 1) / 2 = 2.5, at
    PP=4 x VPP=2 (6 + 4 + 1) / 2 = 5.5. ``reroll plan`` scales the kept activations by it (the SHAPE's 2
    layers: 2 x 420 bytes a token without checkpointing)."""
    from reroll.config.memory import pipeline_in_flight

    assert (pipeline_in_flight(2, 1), pipeline_in_flight(2, 2), pipeline_in_flight(4, 2)) == (2.0, 2.5, 5.5)
    staged = ["strategy.name=megatron", "strategy.megatron.pipeline_parallel=2"]
    plain = _bytes(tmp_path, *staged, "model.gradient_checkpointing=false")
    interleaved = _bytes(
        tmp_path, *staged, "strategy.megatron.virtual_pipeline=2", "model.gradient_checkpointing=false"
    )
    assert (plain.kept, interleaved.kept) == (2 * 2 * 420.0, 2.5 * 2 * 420.0)
