"""``model.compile`` compiles a model's repeated blocks, not the whole model (``compile_model``)."""

from __future__ import annotations

import torch

from reroll.strategies.training import compile_model


def test_the_decoder_layers_are_compiled_and_the_model_around_them_is_not():
    """Each decoder layer (the class transformers names in ``_no_split_modules``) gets its compiled call;
    the model, its embedding and head do not, and the state dict keeps its names. Nothing runs here:
    ``tests/integration/test_packed_training.py`` runs the compiled model against the eager one."""
    from transformers import Qwen2ForCausalLM

    from benchmarks.grpo_step import TINY, qwen2_config

    cfg = qwen2_config(TINY | {"num_layers": 3}, 64)
    model = Qwen2ForCausalLM(cfg)
    names = list(model.state_dict())
    assert compile_model(model) == 3
    compiled = {n for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None}
    assert compiled == {f"model.layers.{i}" for i in range(3)}
    assert list(model.state_dict()) == names
    torch._dynamo.reset()


def test_a_model_without_named_blocks_is_compiled_whole():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    assert compile_model(model) == 0
    assert model._compiled_call_impl is not None
    torch._dynamo.reset()
