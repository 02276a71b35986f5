"""The Megatron strategy's layer spec: Transformer Engine's where it is used, else Megatron-Core's local
spec with ``SequenceParallelRMSNorm`` for its norms, so sequence parallelism runs without Transformer
Engine or Apex.

Megatron-Core's local spec builds its norms as ``WrappedTorchNorm`` (``torch.nn.RMSNorm`` without Apex),
which asserts ``not config.sequence_parallel``. Yet an RMSNorm acts on each token alone, so it gives the
same output on a rank's slice of the sequence as on the whole; what sequence parallelism needs besides is
that the weight, replicated over the TP ranks, gets the gradient of every rank's tokens: Megatron's
``finalize_model_grads`` sums over the TP group the gradient of each parameter marked
``sequence_parallel`` (``_allreduce_non_tensor_model_parallel_grads``), as Apex's and Transformer
Engine's norms mark theirs. Qwen3's q/k norms (per head, after the QKV projection has gathered the
sequence: each rank holds every token of its heads) are summed there by name already; marked too, as
Transformer Engine's are, they are still summed once. The final norm is the block's, not the layer's,
so the spec is a whole ``TransformerBlockSubmodules``.
"""

from __future__ import annotations

from typing import Any

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built as Megatron-Core builds a norm (``config``, ``hidden_size``, ``eps``),
    its weight marked ``sequence_parallel`` where the config is (its gradient then summed over the TP
    ranks by ``finalize_model_grads``)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelRMSNorm is an RMSNorm, not a {config.normalization}")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def local_block_spec(config: Any, *, num_experts: int, qk_norm: bool) -> Any:
    """Megatron-Core's local spec for this rank's stage of decoder layers (``config``: its
    ``TransformerConfig``), every norm a ``SequenceParallelRMSNorm``: a ``TransformerBlockSubmodules``
    (the layer's spec is ``layer_specs[0]``, shared by every layer)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = get_gpt_layer_local_spec(
        num_experts=num_experts or None, moe_grouped_gemm=False, qk_layernorm=qk_norm, normalization="RMSNorm"
    )
    sub = layer.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = SequenceParallelRMSNorm
    if qk_norm:
        attention = sub.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = SequenceParallelRMSNorm
    layers = get_num_layers_to_build(config)  # this pipeline stage's (parallel_state's rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=SequenceParallelRMSNorm)
