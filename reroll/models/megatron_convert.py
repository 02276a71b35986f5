"""Hugging Face <-> Megatron-Core ``GPTModel`` weights for Qwen2/Qwen2.5, Qwen3, Qwen3-MoE and Llama: pure
functions.

Megatron-Core's layout, per decoder layer ``i`` (``decoder.layers.{i}.``):

- ``self_attention.linear_qkv``: q, k and v fused along dim 0 *per query group*: for each of the
  ``num_kv_heads`` groups, its ``num_heads / num_kv_heads`` query heads, then its key head, then its
  value head (``head_dim`` rows each). Qwen2 carries a ``.bias`` in the same layout.
- ``mlp.linear_fc1``: ``gate_proj`` then ``up_proj`` along dim 0 (SwiGLU).
- ``self_attention.linear_proj`` is ``o_proj``, ``mlp.linear_fc2`` is ``down_proj``; Qwen3's
  ``q_norm``/``k_norm`` are ``self_attention.q_layernorm``/``k_layernorm``.
- Layer norms: the local spec has ``input_layernorm`` and ``pre_mlp_layernorm`` modules; the
  Transformer Engine spec fuses them into the next linear layer as ``linear_qkv.layer_norm_weight``
  and ``linear_fc1.layer_norm_weight`` (``fused_norms=True``).
- Tied embeddings have no ``output_layer.weight``; the vocabulary may be padded to a multiple of the
  tensor-parallel size (padding rows are zero, and are dropped on the way back).

- Qwen3-MoE's layers (``qwen3_moe``, every layer sparse): the router ``mlp.gate`` is ``mlp.router``;
  expert ``e``'s slices of transformers' fused ``mlp.experts.gate_up_proj`` ``(E, 2I, H)`` (gate rows,
  then up) and ``down_proj`` ``(E, H, I)`` are ``mlp.experts.local_experts.{e}.linear_fc1`` and
  ``linear_fc2`` (Megatron-Core's ``SequentialMLP``; the local spec without grouped GEMM).

Tensor parallelism splits column-parallel weights (qkv, fc1, embedding, output layer) along dim 0 and
row-parallel ones (``linear_proj``, ``linear_fc2``) along dim 1; ``linear_fc1`` is split as gate and
up separately, so rank ``r`` holds ``[gate_r; up_r]``. ``shard``/``merge`` do that for rank ``r`` of ``t``
(experts' linear layers split as the dense MLP's; the router is replicated). Expert parallelism gives
rank ``r`` of ``ep`` the experts ``r*E/ep .. (r+1)*E/ep - 1``, numbered from 0 on that rank
(``shard_experts``/``merge_experts``).

Pipeline parallelism gives each stage a run of consecutive decoder layers (evenly where ``pp`` divides
them, else fewer on the first and last stage: ``reroll.config.startable.pipeline_stage_sizes``), numbered
from 0 on that stage as Megatron-Core's ``GPTModel`` built with ``pre_process``/``post_process`` names
them; the embedding lives on the first stage, the final norm and the output layer on the last, and a
tied model's last stage holds a copy of the embedding as ``output_layer.weight`` (Megatron keeps the
two copies equal by summing their gradients). ``shard_stage``/``merge_stages`` do that.

A rank's share straight from the checkpoint (``rank_from_hf``) reads only the Hugging Face tensors that
feed its weights, as ``layer_parts`` lists them per layer (and of a TP-split weight, each source's chunk):
the same state dict as converting the whole model and splitting it, without holding the whole model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from reroll.config.startable import (
    MEGATRON_MODEL_TYPES,
    megatron_model_problems,
    pipeline_split_problem,
    pipeline_stage_sizes,
    virtual_pipeline_problems,
)
from reroll.errors import UserError
from reroll.models.expert_fusion import expert_row

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

SUPPORTED_MODEL_TYPES = MEGATRON_MODEL_TYPES


@dataclass(frozen=True)
class GPTShape:
    """What the conversion and the Megatron-Core config need from a Hugging Face config."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    eps: float
    rope_theta: float
    llama3_rope_factor: float | None
    max_positions: int
    num_experts: int = 0  # 0: a dense model
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = False

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary rounded up to a multiple of ``tp`` (Megatron splits it evenly across TP ranks)."""
        return math.ceil(self.vocab_size / tp) * tp


def gpt_shape(hf_config: Any) -> GPTShape:
    """The ``GPTShape`` of a Qwen2/Qwen2.5, Qwen3 or Llama config; anything else is a ``UserError``."""
    c = hf_config
    problems = megatron_model_problems(c)  # the check `reroll validate` and `reroll plan` make
    if problems:
        raise UserError("; ".join(problems))
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    factor = float(rope["factor"]) if rope_type == "llama3" else None
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return GPTShape(
        model_type=c.model_type,
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        ffn_hidden_size=c.intermediate_size,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads or c.num_attention_heads,
        head_dim=head_dim,
        vocab_size=c.vocab_size,
        tied=bool(c.tie_word_embeddings),
        qkv_bias=c.model_type == "qwen2",
        qk_norm=c.model_type in ("qwen3", "qwen3_moe"),
        eps=float(c.rms_norm_eps),
        rope_theta=float(theta),
        llama3_rope_factor=factor,
        max_positions=c.max_position_embeddings,
        **(
            {
                "num_experts": int(c.num_experts),
                "moe_top_k": int(c.num_experts_per_tok),
                "moe_ffn_hidden_size": int(c.moe_intermediate_size),
                "norm_topk_prob": bool(c.norm_topk_prob),
            }
            if c.model_type == "qwen3_moe"
            else {}
        ),
    )


def _norm_names(i: int, fused_norms: bool) -> tuple[str, str]:
    """Megatron names of layer ``i``'s pre-attention and pre-MLP norms (local spec or TE's fused ones)."""
    p = f"decoder.layers.{i}."
    if fused_norms:
        return p + "self_attention.linear_qkv.layer_norm_weight", p + "mlp.linear_fc1.layer_norm_weight"
    return p + "input_layernorm.weight", p + "pre_mlp_layernorm.weight"


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    return w if w.shape[0] == rows else torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: GPTShape) -> torch.Tensor:
    """q ``(H*d, ...)``, k and v ``(G*d, ...)`` -> ``((H + 2G)*d, ...)`` in per-query-group order."""
    rest = q.shape[1:]
    q = q.reshape(s.num_kv_heads, (s.num_heads // s.num_kv_heads) * s.head_dim, *rest)
    k = k.reshape(s.num_kv_heads, s.head_dim, *rest)
    v = v.reshape(s.num_kv_heads, s.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, s: GPTShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of ``_fuse_qkv`` (any trailing shape: a LoRA B of ``r`` columns too)."""
    rest = qkv.shape[1:]
    per_group = (s.num_heads // s.num_kv_heads) * s.head_dim
    grouped = qkv.reshape(s.num_kv_heads, per_group + 2 * s.head_dim, *rest)
    q, k, v = grouped.split([per_group, s.head_dim, s.head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], s: GPTShape, *, fused_norms: bool = False, padded_vocab: int | None = None
) -> dict[str, torch.Tensor]:
    """A Hugging Face causal-LM state dict -> the unsharded Megatron-Core ``GPTModel`` state dict.

    ``fused_norms`` names the layer norms as the Transformer Engine spec does; ``padded_vocab`` (at
    least ``s.vocab_size``) appends zero rows to the embedding and output layer. ``hf`` may hold an MoE
    layer's experts fused (transformers' state dict) or one tensor each (the checkpoint's files):
    ``layer_from_hf``. Only the tensors the conversion names are read from ``hf``."""
    rows = padded_vocab or s.vocab_size
    out = embedding_from_hf(hf, rows)
    for i in range(s.num_layers):
        out |= layer_from_hf(hf, s, i, fused_norms=fused_norms)
    return out | head_from_hf(hf, s, rows)


def rank_from_hf(
    hf: Mapping[str, torch.Tensor],
    s: GPTShape,
    *,
    stage: int = 0,
    pp: int = 1,
    tp_rank: int = 0,
    tp: int = 1,
    ep_rank: int = 0,
    ep: int = 1,
    fused_norms: bool = False,
    chunk: int = 0,
    vp: int = 1,
) -> dict[str, torch.Tensor]:
    """One Megatron rank's state dict (of its model chunk ``chunk`` of ``vp`` under a virtual pipeline)
    straight from the Hugging Face weights: what ``shard(shard_experts(shard_stage(hf_to_megatron(hf,
    ...), stage, pp, chunk, vp), ep_rank, ep), tp_rank, tp)`` gives, reading from ``hf`` only what the
    rank holds: its stage's (chunk's) layers, the embedding on the first stage's first chunk (and a tied
    model's last), the final norm and head on the last stage's last chunk, of each layer's experts its EP
    rank's only, and of each TP-split weight the rows or columns of its TP rank (``layer_from_hf``; a
    fused expert's whole tensor). With ``hf`` a lazy mapping over the checkpoint's files that can read a
    chunk (``reroll.models.checkpoint_reader.CheckpointReader``) a rank reads its share alone."""
    _check_tp(s, tp)
    layers = virtual_stage_layers(s.num_layers, stage, pp, vp, chunk) if pp > 1 else range(s.num_layers)
    first, last = stage == 0 and chunk == 0, stage == pp - 1 and chunk == vp - 1
    experts = expert_range(s, ep_rank, ep) if s.num_experts else None
    out = {}
    if first or (last and s.tied):
        out["embedding.word_embeddings.weight"] = _vocab_share(
            hf, "model.embed_tokens.weight", s, tp_rank, tp
        )
    for i in layers:
        out |= layer_from_hf(hf, s, i, fused_norms=fused_norms, experts=experts, tp_rank=tp_rank, tp=tp)
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not s.tied:
            out["output_layer.weight"] = _vocab_share(hf, "lm_head.weight", s, tp_rank, tp)
    return shard_experts(shard_stage(out, s, stage, pp, chunk, vp), s, ep_rank, ep)


def _vocab_share(hf: Mapping[str, torch.Tensor], name: str, s: GPTShape, rank: int, tp: int) -> torch.Tensor:
    """TP rank ``rank``'s rows of the embedding or head ``name`` padded to ``s.padded_vocab(tp)`` (the
    padding rows zero, all on the last rank): only those rows read where ``hf`` can (``narrow``)."""
    if tp == 1:
        return hf[name]
    rows = s.padded_vocab(tp) // tp
    start = rank * rows
    stop = max(start, min(start + rows, s.vocab_size))
    part = hf.narrow(name, 0, start, stop - start) if hasattr(hf, "narrow") else hf[name][start:stop].clone()
    return _pad_rows(part, rows)


def embedding_from_hf(hf: Mapping[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """``embedding.word_embeddings.weight``: the embedding padded with zero rows to ``rows``."""
    return {"embedding.word_embeddings.weight": _pad_rows(hf["model.embed_tokens.weight"], rows)}


def head_from_hf(hf: Mapping[str, torch.Tensor], s: GPTShape, rows: int) -> dict[str, torch.Tensor]:
    """The final norm and (untied) ``output_layer.weight`` padded with zero rows to ``rows``."""
    out = {"decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not s.tied:
        out["output_layer.weight"] = _pad_rows(hf["lm_head.weight"], rows)
    return out


def _first(ts: list[torch.Tensor], s: GPTShape) -> torch.Tensor:
    return ts[0]


def _cat(ts: list[torch.Tensor], s: GPTShape) -> torch.Tensor:
    return torch.cat(ts)


def _qkv(ts: list[torch.Tensor], s: GPTShape) -> torch.Tensor:
    return _fuse_qkv(*ts, s)


def _expert_of(e: int, ts: list[torch.Tensor], s: GPTShape) -> torch.Tensor:
    return ts[0][e]


@dataclass(frozen=True)
class Part:
    """A Megatron weight (``name``, its layer numbered globally) and the Hugging Face tensors it is made of
    (``sources``, in order), put together by ``combine`` at a shape. ``sliced``: TP rank r's share of the
    weight is ``combine`` of each source's r-th chunk along the weight's split dim (``tp_split_dim``) at
    the shape of one TP rank's heads: true of every layer weight but a fused expert's."""

    name: str
    sources: tuple[str, ...]
    combine: Callable[[list[torch.Tensor], GPTShape], torch.Tensor] = _first
    sliced: bool = True


def layer_parts(
    s: GPTShape,
    i: int,
    *,
    fused_norms: bool = False,
    experts: range | None = None,
    fused_experts: bool = False,
) -> list[Part]:
    """Decoder layer ``i``'s Megatron weights and the Hugging Face tensors that feed each: the one table
    of names ``layer_from_hf`` and a rank's reads (``rank_from_hf``) follow.

    An MoE layer's experts (``experts``: those of ``range(num_experts)`` wanted, by default all; numbered
    globally) come from transformers' fused ``mlp.experts.gate_up_proj`` ``(E, 2I, H)`` and ``down_proj``
    ``(E, H, I)`` where ``fused_experts``, else from the checkpoint's own per-expert
    ``mlp.experts.{e}.gate_proj``/``up_proj``/``down_proj`` (what ``save_pretrained`` writes and
    transformers fuses on load)."""
    h, m, a = f"model.layers.{i}.", f"decoder.layers.{i}.", f"model.layers.{i}.self_attn."
    attn_norm, mlp_norm = _norm_names(i, fused_norms)
    parts = [
        Part(attn_norm, (h + "input_layernorm.weight",)),
        Part(mlp_norm, (h + "post_attention_layernorm.weight",)),
        Part(m + "self_attention.linear_qkv.weight", tuple(a + f"{x}_proj.weight" for x in "qkv"), _qkv),
    ]
    if s.qkv_bias:
        parts.append(
            Part(m + "self_attention.linear_qkv.bias", tuple(a + f"{x}_proj.bias" for x in "qkv"), _qkv)
        )
    if s.qk_norm:
        parts.append(Part(m + "self_attention.q_layernorm.weight", (a + "q_norm.weight",)))
        parts.append(Part(m + "self_attention.k_layernorm.weight", (a + "k_norm.weight",)))
    parts.append(Part(m + "self_attention.linear_proj.weight", (a + "o_proj.weight",)))
    if not s.num_experts:
        gate_up = (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight")
        return [*parts, Part(m + "mlp.linear_fc1.weight", gate_up, _cat),
                Part(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",))]  # fmt: skip
    parts.append(Part(m + "mlp.router.weight", (h + "mlp.gate.weight",)))
    x = h + "mlp.experts."
    for e in range(s.num_experts) if experts is None else experts:
        fc = m + f"mlp.experts.local_experts.{e}.linear_fc"
        if fused_experts:
            parts.append(Part(fc + "1.weight", (x + "gate_up_proj",), partial(_expert_of, e), sliced=False))
            parts.append(Part(fc + "2.weight", (x + "down_proj",), partial(_expert_of, e), sliced=False))
        else:  # the tensors transformers fuses into expert e's row: the same weight either way
            parts.append(Part(fc + "1.weight", expert_row(s.model_type, x + "gate_up_proj", e), _cat))
            parts.append(Part(fc + "2.weight", expert_row(s.model_type, x + "down_proj", e), _cat))
    return parts


def layer_from_hf(
    hf: Mapping[str, torch.Tensor],
    s: GPTShape,
    i: int,
    *,
    fused_norms: bool = False,
    experts: range | None = None,
    tp_rank: int = 0,
    tp: int = 1,
) -> dict[str, torch.Tensor]:
    """Decoder layer ``i`` in Megatron names (numbered globally) from ``hf``'s ``model.layers.{i}.*``
    (``layer_parts``: fused experts where ``hf`` has them), each Hugging Face tensor read once; at
    ``tp`` > 1 TP rank ``tp_rank``'s share, reading each source's chunk alone where ``hf`` can
    (``narrow``, as ``reroll.models.checkpoint_reader.CheckpointReader``)."""
    fused = f"model.layers.{i}.mlp.experts.gate_up_proj" in hf
    parts = layer_parts(s, i, fused_norms=fused_norms, experts=experts, fused_experts=fused)
    whole: dict[str, torch.Tensor] = {}  # each source read once (a fused expert tensor feeds E weights)
    if tp == 1:
        return {p.name: p.combine([_once(hf, n, whole) for n in p.sources], s) for p in parts}
    local = replace(s, num_heads=s.num_heads // tp, num_kv_heads=s.num_kv_heads // tp)
    out, unsliced = {}, {}
    for p in parts:
        dim = tp_split_dim(p.name)
        if dim is not None and p.sliced:
            out[p.name] = p.combine([_tp_chunk(hf, n, dim, tp_rank, tp) for n in p.sources], local)
        else:  # replicated, or a fused expert: the whole weight, then its share as `shard` cuts it
            unsliced[p.name] = p.combine([_once(hf, n, whole) for n in p.sources], s)
    return out | shard(unsliced, s, tp_rank, tp)


def _once(hf: Mapping[str, torch.Tensor], name: str, read: dict[str, torch.Tensor]) -> torch.Tensor:
    if name not in read:
        read[name] = hf[name]
    return read[name]


def _tp_chunk(hf: Mapping[str, torch.Tensor], name: str, dim: int, rank: int, tp: int) -> torch.Tensor:
    """Chunk ``rank`` of ``tp`` of the Hugging Face tensor ``name`` along ``dim`` (its size a multiple of
    ``tp``: ``_check_tp``): read alone where ``hf`` can (``shape`` and ``narrow``), else cut from the
    whole tensor and copied, as ``shard`` copies."""
    if hasattr(hf, "narrow"):
        size = hf.shape(name)[dim] // tp
        return hf.narrow(name, dim, rank * size, size)
    return hf[name].chunk(tp, dim)[rank].clone()


def megatron_to_hf(
    mc: dict[str, torch.Tensor], s: GPTShape, *, with_tied_head: bool = True
) -> dict[str, torch.Tensor]:
    """An unsharded Megatron-Core ``GPTModel`` state dict (either spec) -> Hugging Face names.

    Vocabulary padding is dropped. A tied model gets ``lm_head.weight`` (the embedding) when
    ``with_tied_head``, as ``PreTrainedModel.state_dict()`` lists it."""
    out = embedding_to_hf(mc, s)
    for i in range(s.num_layers):
        out |= layer_to_hf(mc, s, i)
    return out | head_to_hf(mc, s, embedding=out["model.embed_tokens.weight"] if with_tied_head else None)


def embedding_to_hf(mc: dict[str, torch.Tensor], s: GPTShape) -> dict[str, torch.Tensor]:
    """``model.embed_tokens.weight`` from a state dict holding ``embedding.word_embeddings.weight``."""
    return {"model.embed_tokens.weight": mc["embedding.word_embeddings.weight"][: s.vocab_size]}


def head_to_hf(
    mc: dict[str, torch.Tensor], s: GPTShape, *, embedding: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The final norm and ``lm_head.weight`` (a tied model's: ``embedding``, where given)."""
    out = {"model.norm.weight": mc["decoder.final_layernorm.weight"]}
    if not s.tied:
        out["lm_head.weight"] = mc["output_layer.weight"][: s.vocab_size]
    elif embedding is not None:
        out["lm_head.weight"] = embedding
    return out


def layer_to_hf(mc: dict[str, torch.Tensor], s: GPTShape, i: int) -> dict[str, torch.Tensor]:
    """Decoder layer ``i`` of a state dict holding its ``decoder.layers.{i}.*`` weights (either spec)."""
    h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    attn_norm, mlp_norm = _norm_names(i, m + "self_attention.linear_qkv.layer_norm_weight" in mc)
    out = {h + "input_layernorm.weight": mc[attn_norm], h + "post_attention_layernorm.weight": mc[mlp_norm]}
    a = h + "self_attn."
    q, k, v = split_qkv(mc[m + "self_attention.linear_qkv.weight"], s)
    out |= {a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v}
    if s.qkv_bias:
        q, k, v = split_qkv(mc[m + "self_attention.linear_qkv.bias"], s)
        out |= {a + "q_proj.bias": q, a + "k_proj.bias": k, a + "v_proj.bias": v}
    if s.qk_norm:
        out[a + "q_norm.weight"] = mc[m + "self_attention.q_layernorm.weight"]
        out[a + "k_norm.weight"] = mc[m + "self_attention.k_layernorm.weight"]
    out[a + "o_proj.weight"] = mc[m + "self_attention.linear_proj.weight"]
    if s.num_experts:
        out[h + "mlp.gate.weight"] = mc[m + "mlp.router.weight"]
        e = m + "mlp.experts.local_experts.{}."
        out[h + "mlp.experts.gate_up_proj"] = torch.stack(
            [mc[e.format(x) + "linear_fc1.weight"] for x in range(s.num_experts)]
        )
        out[h + "mlp.experts.down_proj"] = torch.stack(
            [mc[e.format(x) + "linear_fc2.weight"] for x in range(s.num_experts)]
        )
        return out
    gate, up = mc[m + "mlp.linear_fc1.weight"].chunk(2)
    out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
    out[h + "mlp.down_proj.weight"] = mc[m + "mlp.linear_fc2.weight"]
    return out


def tp_split_dim(name: str) -> int | None:
    """The dim a Megatron-Core parameter is split along under tensor parallelism (None: replicated)."""
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "word_embeddings.weight")):
        return 0
    return 0 if name == "output_layer.weight" else None


def _check_tp(s: GPTShape, tp: int) -> None:
    for what, n in (("num_attention_heads", s.num_heads), ("num_key_value_heads", s.num_kv_heads),
                    ("intermediate_size", s.ffn_hidden_size), ("moe_intermediate_size", s.moe_ffn_hidden_size)):  # fmt: skip
        if n % tp:
            raise UserError(
                f"strategy.megatron.tensor_parallel ({tp}) must divide the model's {what} ({n}): "
                "pick a tensor_parallel that does"
            )


def shard(mc: dict[str, torch.Tensor], s: GPTShape, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s share of an unsharded Megatron-Core state dict at tensor-parallel size ``tp`` (split
    weights copied, so the unsharded ones can be freed; at ``tp`` 1 the same tensors, no copy)."""
    _check_tp(s, tp)
    if tp == 1:
        return dict(mc)
    out = {}
    for name, w in mc.items():
        dim = tp_split_dim(name)
        if dim is None:
            out[name] = w
        elif name.endswith("linear_fc1.weight"):
            gate, up = w.chunk(2)
            out[name] = torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
        else:
            if w.shape[dim] % tp:
                raise UserError(f"{name} has {w.shape[dim]} rows along dim {dim}, not divisible by TP {tp}")
            out[name] = w.chunk(tp, dim=dim)[rank].clone()
    return out


def merge(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The inverse of ``shard``: the per-rank state dicts of ranks 0..t-1 -> the unsharded one."""
    out = {}
    for name, first in shards[0].items():
        dim = tp_split_dim(name)
        if dim is None:
            out[name] = first
        elif name.endswith("linear_fc1.weight"):
            halves = [w.chunk(2) for w in (sd[name] for sd in shards)]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            out[name] = torch.cat([sd[name] for sd in shards], dim=dim)
    return out


_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def is_expert(name: str) -> bool:
    """Whether a Megatron-Core parameter belongs to one expert (split by expert parallelism)."""
    return _EXPERT.match(name) is not None


def shard_experts(mc: dict[str, torch.Tensor], s: GPTShape, rank: int, ep: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s share at expert-parallel size ``ep``: every weight but the experts, and experts
    ``rank*E/ep .. (rank+1)*E/ep - 1`` renumbered from 0 (Megatron-Core's local expert numbering)."""
    if ep == 1:
        return dict(mc)
    mine = expert_range(s, rank, ep)
    out = {}
    for name, w in mc.items():
        match = _EXPERT.match(name)
        if match is None:
            out[name] = w
        elif int(match[2]) in mine:
            out[f"{match[1]}{int(match[2]) - mine.start}{match[3]}"] = w
    return out


def expert_range(s: GPTShape, rank: int, ep: int) -> range:
    """The (global) experts of expert-parallel rank ``rank`` of ``ep``: ``rank*E/ep .. (rank+1)*E/ep - 1``."""
    if not s.num_experts or s.num_experts % ep:
        raise UserError(
            f"strategy.megatron.expert_parallel ({ep}) must divide the model's num_experts "
            f"({s.num_experts}): pick an expert_parallel that does"
        )
    per_rank = s.num_experts // ep
    return range(rank * per_rank, (rank + 1) * per_rank)


def merge_experts(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The inverse of ``shard_experts``: ranks 0..ep-1's state dicts -> one with every expert (the
    non-expert weights taken from rank 0)."""
    per_rank = 1 + max((int(m[2]) for m in map(_EXPERT.match, shards[0]) if m), default=-1)
    out = {}
    for rank, sd in enumerate(shards):
        for name, w in sd.items():
            match = _EXPERT.match(name)
            if match is not None:
                out[f"{match[1]}{rank * per_rank + int(match[2])}{match[3]}"] = w
            elif rank == 0:
                out[name] = w
    return out


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def stage_layers(num_layers: int, stage: int, pp: int) -> range:
    """The (global) decoder layers of pipeline stage ``stage`` of ``pp`` (``pipeline_stage_sizes``)."""
    sizes = pipeline_stage_sizes(num_layers, pp)
    if not sizes:
        raise UserError(pipeline_split_problem(num_layers, pp))
    return range(sum(sizes[:stage]), sum(sizes[: stage + 1]))


def virtual_stage_layers(num_layers: int, stage: int, pp: int, vp: int, chunk: int) -> range:
    """The (global) decoder layers of model chunk ``chunk`` of ``vp`` on pipeline stage ``stage`` of
    ``pp`` (interleaved schedule): ``num_layers / (pp vp)`` consecutive layers each, chunk ``c`` of stage
    ``p`` the ``c pp + p``-th such run, as Megatron-Core assigns them with
    ``virtual_pipeline_model_parallel_size`` (``get_transformer_layer_offset``); so a micro-batch
    crosses every stage's chunk 0, then every stage's chunk 1, and so on."""
    if vp == 1:
        return stage_layers(num_layers, stage, pp)
    problems = virtual_pipeline_problems(num_layers, pp, vp)
    if problems:
        raise UserError(problems[0])
    n = num_layers // (pp * vp)
    start = (chunk * pp + stage) * n
    return range(start, start + n)


def layer_owner(num_layers: int, layer: int, pp: int, vp: int = 1) -> tuple[int, int, int]:
    """``(stage, chunk, index there)`` of global decoder layer ``layer``: where ``virtual_stage_layers``
    puts it (``stage_layers`` at ``vp = 1``)."""
    for stage in range(pp):
        for chunk in range(vp):
            held = virtual_stage_layers(num_layers, stage, pp, vp, chunk)
            if layer in held:
                return stage, chunk, layer - held.start
    raise ValueError(f"layer {layer} is not one of the model's {num_layers}")


def pipeline_config(num_layers: int, pp: int, vp: int = 1) -> dict[str, Any]:
    """``TransformerConfig`` fields of a split over ``pp`` stages that is not even (first and last
    stage sizes; Megatron-Core splits the rest evenly, as ``pipeline_stage_sizes``), or of ``vp`` model
    chunks a stage (an even split: ``virtual_stage_layers``)."""
    if vp > 1:
        problems = virtual_pipeline_problems(num_layers, pp, vp)
        if problems:
            raise UserError(problems[0])
        return {"virtual_pipeline_model_parallel_size": vp}
    sizes = pipeline_stage_sizes(num_layers, pp)
    if not sizes:
        raise UserError(pipeline_split_problem(num_layers, pp))
    if len(set(sizes)) == 1:
        return {}
    return {"num_layers_in_first_pipeline_stage": sizes[0], "num_layers_in_last_pipeline_stage": sizes[-1]}


def shard_stage(
    mc: dict[str, torch.Tensor], s: GPTShape, stage: int, pp: int, chunk: int = 0, vp: int = 1
) -> dict[str, torch.Tensor]:
    """Stage ``stage``'s share of a Megatron-Core state dict (unsharded or one TP/EP rank's) at pipeline
    size ``pp`` (under a virtual pipeline, its model chunk ``chunk`` of ``vp``: ``virtual_stage_layers``):
    its layers numbered from 0, the embedding on the first stage('s first chunk), the final norm and
    output layer on the last stage('s last chunk) (a tied model's gets the embedding as
    ``output_layer.weight``)."""
    if pp == 1:
        return dict(mc)
    layers = virtual_stage_layers(s.num_layers, stage, pp, vp, chunk)
    first, last = stage == 0 and chunk == 0, stage == pp - 1 and chunk == vp - 1
    out = {}
    for name, w in mc.items():
        match = _LAYER.match(name)
        if match is not None:
            if int(match[1]) in layers:
                out[f"decoder.layers.{int(match[1]) - layers.start}.{match[2]}"] = w
        elif name == "embedding.word_embeddings.weight":
            if first:
                out[name] = w
            if last and s.tied:
                out["output_layer.weight"] = w
        elif last:  # decoder.final_layernorm.*, output_layer.weight
            out[name] = w
    return out


def merge_stages(stages: list[dict[str, torch.Tensor]], s: GPTShape) -> dict[str, torch.Tensor]:
    """The inverse of ``shard_stage``: stages 0..pp-1's state dicts -> one with every layer numbered
    globally (a tied model's copy of the embedding on the last stage dropped)."""
    pp = len(stages)
    if pp == 1:
        return dict(stages[0])
    out = {}
    for stage, sd in enumerate(stages):
        offset = stage_layers(s.num_layers, stage, pp).start
        for name, w in sd.items():
            match = _LAYER.match(name)
            if match is not None:
                out[f"decoder.layers.{int(match[1]) + offset}.{match[2]}"] = w
            elif not (s.tied and name == "output_layer.weight"):
                out[name] = w
    return out


def transformer_config(s: GPTShape, ep: int = 1, **parallel: Any) -> TransformerConfig:
    """A Megatron-Core ``TransformerConfig`` for ``s``; ``parallel`` adds fields such as
    ``tensor_model_parallel_size``, ``params_dtype``, ``bf16`` or ``use_cpu_initialization``.

    Fusions that need Apex or compiled kernels are off and dropout is 0, so the local spec runs
    anywhere and matches the Hugging Face forward."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=s.num_layers,
        hidden_size=s.hidden_size,
        ffn_hidden_size=s.ffn_hidden_size,
        num_attention_heads=s.num_heads,
        num_query_groups=s.num_kv_heads,
        kv_channels=s.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=s.eps,
        add_bias_linear=False,
        add_qkv_bias=s.qkv_bias,
        qk_layernorm=s.qk_norm,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **((moe_config(s, ep) if s.num_experts else {}) | parallel),
    )


def moe_config(s: GPTShape, ep: int = 1) -> dict[str, Any]:
    """``TransformerConfig`` fields of a Qwen3-MoE shape: every layer sparse, dropless top-k routing
    (``norm_topk_prob``: the top k logits' softmax, which renormalises the chosen probabilities; else the
    softmax over all experts before the top k), ``SequentialMLP`` experts (no grouped GEMM, so no
    Transformer Engine or grouped_gemm package); tokens reach the experts of other EP ranks by
    all-to-all, and by the all-gather dispatcher at ``ep`` 1 (which also runs on CPU). Megatron's own
    load-balancing loss is off: the trainer adds reroll's (``reroll.algorithms.router``), the same term
    the other strategies train with, from the router logits ``MegatronRouters`` records."""
    return {
        "num_moe_experts": s.num_experts,
        "moe_router_topk": s.moe_top_k,
        "moe_ffn_hidden_size": s.moe_ffn_hidden_size,
        "moe_router_pre_softmax": not s.norm_topk_prob,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_grouped_gemm": False,
        "moe_token_dispatcher_type": "alltoall" if ep > 1 else "allgather",
    }


def gpt_model_kwargs(s: GPTShape, tp: int) -> dict[str, Any]:
    """``GPTModel`` keyword arguments besides the config and layer spec: vocabulary, rope, tying."""
    return {
        "vocab_size": s.padded_vocab(tp),
        "max_sequence_length": s.max_positions,
        "position_embedding_type": "rope",
        "rotary_base": s.rope_theta,
        "rope_scaling": s.llama3_rope_factor is not None,
        "rope_scaling_factor": s.llama3_rope_factor or 8.0,
        "share_embeddings_and_output_weights": s.tied,
    }
