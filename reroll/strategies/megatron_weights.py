"""The Megatron strategy's weights in Hugging Face names, streamed one decoder layer at a time: each
gathered over the tensor-parallel ranks (shards merged), the expert-parallel ranks (every expert) and
from the pipeline stage that holds it (broadcast over the pipeline group), then converted
(``reroll.models.megatron_convert``). Weight sync and export hold one layer at a time, not the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reroll.models import megatron_convert as mc
from reroll.strategies.megatron_moe import gather_experts
from reroll.strategies.megatron_pipeline import Pipeline, broadcast_from


@dataclass(frozen=True)
class Groups:
    """This rank's parallel groups: tensor parallel, expert parallel, its pipeline stage (None at 1)."""

    tp: int
    tp_group: dist.ProcessGroup
    ep: int
    ep_group: dist.ProcessGroup | None
    pipe: Pipeline | None
    device: torch.device
    vp: int = 1  # model chunks per stage (virtual pipeline)


def hf_weights(
    local: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
    s: mc.GPTShape,
    g: Groups,
    *,
    on_device: bool,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of the model whose this rank's share is ``local`` (its ``GPTModel``'s state dict, or
    a mapping that makes each tensor when asked: each is asked for once, in its unit; under a virtual
    pipeline one such mapping per model chunk, ``g.vp`` of them) in Hugging Face names: the embedding
    first, the decoder layers in order, the final norm and head last; on ``g.device`` or on CPU. A
    collective: every rank iterates to the end, and gets all."""
    stage, stages = (0, 1) if g.pipe is None else (g.pipe.stage, len(g.pipe.ranks))
    chunks = [local] if isinstance(local, Mapping) else list(local)
    if len(chunks) != g.vp:
        raise ValueError(f"{len(chunks)} model chunks' weights, {g.vp} expected")

    def unit(
        owner: int, prefixes: tuple[str, ...], here: str = "", named: str = "", chunk: int = 0
    ) -> dict[str, torch.Tensor]:
        """The weights of model chunk ``chunk`` whose names start with ``prefixes`` (``here`` renamed
        ``named``), gathered on stage ``owner`` and broadcast from it."""
        part = None
        if owner == stage:
            held = chunks[chunk]
            part = gathered({named + k[len(here) :]: held[k] for k in held if k.startswith(prefixes)}, g)
        return part if g.pipe is None else broadcast_from(part, owner, g.pipe, g.device)

    def put(hf: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, w in hf.items():
            yield name, w.to(g.device) if on_device else w

    embedding = mc.embedding_to_hf(unit(0, ("embedding.",)), s)
    yield from put(embedding)
    for i in range(s.num_layers):
        owner, chunk, index = mc.layer_owner(s.num_layers, i, stages, g.vp)
        here = f"decoder.layers.{index}."
        yield from put(mc.layer_to_hf(unit(owner, (here,), here, f"decoder.layers.{i}.", chunk), s, i))
    head = unit(stages - 1, ("decoder.final_layernorm.", "output_layer."), chunk=g.vp - 1)
    yield from put(mc.head_to_hf(head, s, embedding=embedding["model.embed_tokens.weight"]))


def gathered(part: dict[str, torch.Tensor], g: Groups) -> dict[str, torch.Tensor]:
    """``part`` of this rank's weights gathered over the EP ranks (experts) and the TP ranks, merged, on
    CPU (every rank of this stage's TP and EP groups must call it with the same names)."""
    part = gather_experts(part, g.ep, g.ep_group)  # experts on CPU, then TP-merged as the dense MLP
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(g.tp)]
    for name, w in part.items():
        if g.tp == 1 or mc.tp_split_dim(name) is None:
            for shard in shards:
                shard[name] = w.to("cpu", copy=True)
            continue
        parts = [torch.empty_like(w) for _ in range(g.tp)]
        dist.all_gather(parts, w.contiguous(), group=g.tp_group)
        for shard, p in zip(shards, parts):
            shard[name] = p.cpu()
    return mc.merge(shards)
