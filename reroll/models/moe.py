"""A mixture-of-experts model's routers, watched during a forward: their logits, the load-balancing loss
and the experts' load, whatever strategy runs the forward.

Transformers (5 on) names the module whose output is a model's router logits in
``_can_record_outputs["router_logits"]`` (Qwen3-MoE: ``Qwen3MoeTopKRouter``, output 0 of
``(logits, scores, indices)``). ``Routers`` hooks every such module (FSDP2 renames a sharded module's class,
not its hooks), and the model itself for its ``attention_mask`` (padding is not counted; a packed row has
no padding), so the trainer reads the logits of the forward it just ran without asking the strategy for
another output. A dense model has no routers: ``Routers.of`` gives None.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from reroll.algorithms.router import expert_load_stats, load_balance_loss
from reroll.data.transfer import scalars_to_host


@dataclass
class Routed:
    """What the forwards inside ``Routers.capture`` gave their routers: per forward, each MoE layer's
    ``(N, E)`` logits (the forward's tokens flattened) in the order they ran, and that forward's real
    tokens ``bool[N]`` (from its ``attention_mask``; all of them for a packed row)."""

    logits: list[list[torch.Tensor]] = field(default_factory=list)
    real: list[torch.Tensor | None] = field(default_factory=list)

    def loss(self, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The load-balancing loss over every forward's tokens and layers pooled, and the ``(L, E)``
        top-k counts (``load_balance_loss``)."""
        if not any(self.logits):
            raise RuntimeError("no router ran inside Routers.capture: the forward did not reach the experts")
        logits = [torch.stack(layers) for layers in self.logits]  # (L, N_i, E) each
        masks = [
            torch.ones(t.shape[1], dtype=torch.bool, device=t.device) if m is None else m.to(t.device)
            for t, m in zip(logits, self.real)
        ]
        return load_balance_loss(torch.cat(logits, 1), torch.cat(masks), top_k=top_k)

    def term(self, top_k: int, share: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(share * loss, loss, counts)``: what this rank backpropagates of the micro-batch's
        load-balancing loss (its ``share`` of the step), the loss of its rows, and their ``(L, E)`` counts
        (``loss``). A strategy whose ranks hold different layers overrides it
        (``reroll.strategies.megatron_moe``)."""
        aux, counts = self.loss(top_k)
        return share * aux, aux, counts


class Routers:
    """The router modules of ``model`` (any wrapper around a Hugging Face MoE model) and its routing
    settings: ``top_k`` (``num_experts_per_tok``), ``experts`` and the coefficient the model trains its
    load-balancing loss with (config.json's ``router_aux_loss_coef`` where ``output_router_logits`` is
    true, else 0)."""

    def __init__(
        self, model: torch.nn.Module, modules: list[torch.nn.Module], index: int, config: Any
    ) -> None:
        self.model, self.modules, self.index = model, modules, index
        self.top_k = int(config.num_experts_per_tok)
        self.experts = int(getattr(config, "num_experts", None) or config.num_local_experts)
        self.model_coef = float(config.router_aux_loss_coef) if config.output_router_logits else 0.0

    @classmethod
    def of(cls, model: torch.nn.Module) -> Routers | None:
        """``model``'s routers, or None where it has none (a dense model)."""
        for inner in model.modules():
            spec = (getattr(inner, "_can_record_outputs", None) or {}).get("router_logits")
            if spec is None:
                continue
            target = getattr(spec, "target_class", spec)
            index = getattr(spec, "index", 0)
            modules = [m for m in model.modules() if isinstance(m, target)]
            return cls(model, modules, index, inner.config) if modules else None
        return None

    def coef(self, setting: float | None) -> float:
        """The load-balancing loss's weight: ``model.router_aux_loss_coef`` where set, else the model's own."""
        return self.model_coef if setting is None else setting

    @contextlib.contextmanager
    def capture(self) -> Iterator[Routed]:
        """Inside the block, every forward of ``model`` records its routers' logits (with their graph: a
        loss on them reaches the routers' weights) and its attention mask into the yielded ``Routed``."""
        routed = Routed()

        def start_forward(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
            routed.logits.append([])
            routed.real.append(None if mask is None else mask.reshape(-1).bool())

        def keep_logits(_module: Any, _args: Any, output: Any) -> None:
            routed.logits[-1].append(output[self.index] if isinstance(output, tuple | list) else output)

        handles = [self.model.register_forward_pre_hook(start_forward, with_kwargs=True)]
        handles += [m.register_forward_hook(keep_logits) for m in self.modules]
        try:
            yield routed
        finally:
            for h in handles:
                h.remove()


class StepRouting:
    """One rank's router term over a training step: each micro-batch's load-balancing loss, times
    ``coef`` and the micro-batch's share of the step, joins that micro-batch's loss (so micro-batches
    and ranks add up, as the losses they join); the experts' load is counted over the step."""

    def __init__(self, routers: Routers, coef: float) -> None:
        self.routers, self.coef = routers, coef
        self._aux: list[tuple[torch.Tensor, float]] = []  # each micro-batch's loss (a device scalar), share
        self._shares = 0.0
        self._counts: torch.Tensor | None = None

    def term(self, routed: Routed, share: float) -> torch.Tensor | None:
        """What joins the micro-batch's loss (None where ``coef`` is 0: the statistics only)."""
        with contextlib.nullcontext() if self.coef else torch.no_grad():
            weighted, aux, counts = routed.term(self.routers.top_k, share)
        self.add(aux, share, counts)
        return self.coef * weighted if self.coef else None

    def add(self, aux: torch.Tensor, share: float, counts: torch.Tensor) -> None:
        """A micro-batch's statistics: its load-balancing loss ``aux``, its ``share`` of the step and its
        experts' ``(L, E)`` top-k counts (``term``; or the strategy's, where it adds the term itself)."""
        self._aux.append((aux.detach(), share))  # read in metrics: the host does not wait here
        self._shares += share
        self._counts = counts if self._counts is None else self._counts + counts

    def metrics(self, prefix: str) -> dict[str, float]:
        """``<prefix>/router_aux_loss`` (the micro-batches' mean, weighted by their shares; ``top_k`` for
        an even load), ``<prefix>/router_aux_coef`` and the experts' load (``expert_load_stats``)."""
        if self._counts is None:
            return {}
        stats = expert_load_stats(self._counts, top_k=self.routers.top_k)
        values = scalars_to_host([a for a, _ in self._aux] + list(stats.values()))  # one copy
        total = 0.0
        for value, (_, share) in zip(values, self._aux):  # the share-weighted sum, in their order
            total += value * share
        out = {f"{prefix}/router_aux_loss": total / max(self._shares, 1e-12)}
        out[f"{prefix}/router_aux_coef"] = self.coef
        return out | {f"{prefix}/{k}": v for k, v in zip(stats, values[len(self._aux) :], strict=True)}
