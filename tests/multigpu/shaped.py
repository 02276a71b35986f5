"""Random-init models of the examples' shapes, built on the machine that runs the kit (a GPU machine
lent to this project has no internet): ``reroll.config.memory.KNOWN``'s shape of the family, the tiny kit's
character tokenizer and chat template, the embedding padded to the family's vocabulary, bf16."""

from __future__ import annotations

from pathlib import Path


def build_shaped(out_dir: Path, family: str, *, max_position_embeddings: int = 4096) -> Path:
    """A random-init Qwen2 model of ``family``'s shape (``reroll.config.memory.KNOWN``: layers, width, heads,
    key-value heads, MLP width, vocabulary) in ``out_dir``. Embeddings are tied, as the tiny builder
    ties them: Qwen2.5-7B's untied head (0.54B parameters) is left out, 7.1B of its 7.6B."""
    from reroll.config.memory import KNOWN
    from reroll.models.tiny import build_tiny_model

    s = KNOWN[family]
    assert not s.expert_params, f"{family}: a mixture of experts (this builds dense models)"
    return build_tiny_model(
        out_dir,
        alphabet="ascii",
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        num_layers=s.layers,
        num_heads=s.hidden // s.head_dim,
        num_kv_heads=s.kv_heads,
        intermediate_size=s.intermediate,
        max_position_embeddings=max_position_embeddings,
        dtype="bfloat16",
        for_cpu_engine=False,
    )
