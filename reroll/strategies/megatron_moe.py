"""A Megatron-Core mixture of experts: its routers' logits for the trainer's load-balancing loss, and its
experts gathered over the expert-parallel ranks.

``MegatronRouters`` offers what ``reroll.models.moe.Routers`` offers for a transformers model (``top_k``,
``experts``, ``coef``, ``capture``), so the trainer adds the same loss (``reroll.algorithms.router``,
transformers' form: every layer and real token pooled) and logs the same statistics whatever the
strategy. Megatron-Core's ``TopKRouter.gating`` gives a forward's logits ``[s, b, E]``, sequence-major
(Megatron's activations are ``[s, b, h]``), so the strategy hands over the forward's ``attention_mask``
in that order (``start_forward``). Megatron's own auxiliary loss is off (``megatron_convert.moe_config``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from reroll.models import megatron_convert as mc
from reroll.models.moe import Routed


def allow_routers_without_transformer_engine() -> None:
    """Megatron-Core 0.16's router linear (``moe_utils.RouterGatingLinearFunction``) tests
    ``te_general_gemm is not None``, a name bound only where Transformer Engine imports: without it every
    router forward raises NameError. Bind it to None, so the router takes its own ``torch.mm`` branch."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class MegatronRouters:
    """The ``TopKRouter`` modules of a Megatron-Core ``GPTModel`` and the model's routing settings
    (``model_coef``: config.json's ``router_aux_loss_coef`` where ``output_router_logits``, else 0)."""

    def __init__(self, module: torch.nn.Module, shape: mc.GPTShape, hf_config: Any) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.modules = [m for m in module.modules() if isinstance(m, TopKRouter)]
        self.top_k, self.experts = shape.moe_top_k, shape.num_experts
        on = getattr(hf_config, "output_router_logits", False)
        self.model_coef = float(getattr(hf_config, "router_aux_loss_coef", 0.0)) if on else 0.0
        self._routed: Routed | None = None

    def coef(self, setting: float | None) -> float:
        """The load-balancing loss's weight: ``model.router_aux_loss_coef`` where set, else the model's own."""
        return self.model_coef if setting is None else setting

    @contextlib.contextmanager
    def capture(self) -> Iterator[Routed]:
        """Inside the block, every forward records each router's logits (with their graph) into the
        yielded ``Routed``, after ``start_forward`` gave it the forward's real tokens."""
        routed = Routed()

        def recording(original: Any, x: torch.Tensor) -> torch.Tensor:
            logits = original(x)
            if not routed.logits:
                raise RuntimeError("a Megatron router ran before MegatronRouters.start_forward")
            routed.logits[-1].append(logits.reshape(-1, logits.shape[-1]))  # [s, b, E] -> (s*b, E)
            return logits

        for router in self.modules:  # an instance attribute shadows the method until the block ends
            router.gating = lambda x, original=router.gating: recording(original, x)
        self._routed = routed
        try:
            yield routed
        finally:
            self._routed = None
            for router in self.modules:
                del router.gating

    def start_forward(self, attention_mask: torch.Tensor) -> None:
        """A forward of ``(B, T)`` rows with ``attention_mask`` begins (nothing outside ``capture``)."""
        if self._routed is not None:
            self._routed.logits.append([])
            self._routed.real.append(attention_mask.t().reshape(-1).bool())  # [s, b] order


def gather_experts(
    local: dict[str, torch.Tensor], ep: int, group: dist.ProcessGroup
) -> dict[str, torch.Tensor]:
    """Every expert of a state dict whose experts are split over the ``ep`` ranks of ``group`` (each holds
    ``local``, experts numbered from 0), numbered globally and moved to the CPU one at a time; the other
    weights as they are (replicated). Every rank of the group must call it, with the same names."""
    if ep == 1:
        return local
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(ep)]
    for name, w in local.items():
        if mc.is_expert(name):
            parts = [torch.empty_like(w) for _ in range(ep)]
            dist.all_gather(parts, w.contiguous(), group=group)
            for shard, part in zip(shards, parts):
                shard[name] = part.cpu()
        else:
            shards[0][name] = w
    return mc.merge_experts(shards)
