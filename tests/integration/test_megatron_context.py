"""Context parallelism in the Megatron strategy (``strategy.megatron.context_parallel``: Ulysses in the
core attention, ``reroll.strategies.megatron_context``) on CPU ranks over gloo, CUDA calls pointed at the
CPU (``tests/integration/megatron_cpu.py``): the attention and the rotary embedding of two ranks equal
the unsplit ones (seconds), and two ranks splitting every row train as one rank does (``-m long``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from reroll.algorithms.logprobs import token_logprobs
from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from tests.conftest import write_config
from tests.integration.megatron_cpu import patch_cuda_for_cpu, run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install 'reroll[megatron]')",
)

SEQ, BATCH, HEADS, GROUPS, DIM = 12, 2, 4, 2, 8  # 4 query heads over 2 key-value heads (GQA)


def _attention_rank(rank: int, world_size: int, address: str, out_dir: str) -> None:
    """Megatron's local attention on the whole sequence, and the Ulysses one on this rank's half of it
    (its own group of the two ranks), forward and backward on the same random inputs; and the rotary
    embedding of the whole sequence and of this rank's half. Saves both sides' outputs and gradients."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from reroll.strategies.context_parallel import ContextParallel
    from reroll.strategies.megatron_context import UlyssesDotProductAttention, causal_mask, chunk_rotary

    torch.set_num_threads(1)
    patch_cuda_for_cpu()
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=world_size)
    ps.initialize_model_parallel()  # TP 1: the attention's tensor-parallel group, the memory buffer
    cp = ContextParallel(dist.new_group([0, 1]), rank, world_size)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        attention_softmax_in_fp32=True,
        use_cpu_initialization=True,
    )
    kwargs = {"config": config, "layer_number": 1, "attn_mask_type": AttnMaskType.causal}
    whole_attention = DotProductAttention(attention_type="self", **kwargs)
    split_attention = UlyssesDotProductAttention(attention_type="self", cp=cp, **kwargs)
    g = torch.Generator().manual_seed(0)  # the same inputs on both ranks
    q = torch.randn(SEQ, BATCH, HEADS, DIM, generator=g)
    k, v = (torch.randn(SEQ, BATCH, GROUPS, DIM, generator=g) for _ in range(2))
    weights = torch.randn(SEQ, BATCH, HEADS * DIM, generator=g)  # the loss: a weighted sum of the output
    mask = causal_mask(SEQ, q.device)
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    out = whole_attention(*whole, mask)
    (out * weights).sum().backward()
    half = slice(rank * SEQ // 2, (rank + 1) * SEQ // 2)
    mine = [x[half].clone().requires_grad_() for x in (q, k, v)]
    split = split_attention(*mine, mask)
    (split * weights[half]).sum().backward()

    rope = RotaryEmbedding(kv_channels=DIM, rotary_percent=1.0, use_cpu_initialization=True)
    rope_whole = rope(SEQ)
    chunk_rotary(torch.nn.ModuleDict({"rotary_pos_emb": rope}), cp)  # a model holding it
    torch.save(
        {
            "whole": (out.detach(), *(x.grad for x in whole)),
            "split": (split.detach(), *(x.grad for x in mine)),
            "rope": (rope_whole, rope(SEQ // 2)),
            "half": half,
        },
        f"{out_dir}/rank{rank}.pt",
    )


def test_ulysses_attention_on_two_ranks_equals_the_unsplit_attention(tmp_path):
    """Each rank's half of the output, and of the gradients of a weighted sum of the whole output with
    respect to queries, keys and values, equal the unsplit attention's: every head attends over the same
    12 keys under the same mask, only batched with fewer heads, so the two differ by float32 rounding of
    sums of at most 12 (softmax) and 8 (head dim) terms of size ~1: within 1e-6 (bit-equal here). The
    rotary embedding a rank is given is the whole sequence's at its own positions, exactly."""
    ranks = run_ranks(_attention_rank, 2, tmp_path)
    for r in ranks:
        half = r["half"]
        for whole, split in zip(r["whole"], r["split"], strict=True):
            assert split.abs().sum() > 0  # the split side ran and reached every input
            torch.testing.assert_close(split, whole[half], atol=1e-6, rtol=0)
        whole_rope, mine = r["rope"]
        assert torch.equal(mine, whole_rope[half])
    assert not torch.equal(ranks[0]["rope"][1], ranks[1]["rope"][1])  # each rank its own positions
