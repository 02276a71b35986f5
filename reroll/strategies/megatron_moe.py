"""A Megatron-Core mixture of experts: its routers' logits for the trainer's load-balancing loss, and its
experts gathered over the expert-parallel ranks.

``MegatronRouters`` offers what ``reroll.models.moe.Routers`` offers for a transformers model (``top_k``,
``experts``, ``coef``, ``capture``), so the trainer adds the same loss (``reroll.algorithms.router``,
transformers' form: every layer and real token pooled) and logs the same statistics whatever the
strategy. Megatron-Core's ``TopKRouter.gating`` gives a forward's logits ``[s, b, E]``, sequence-major
(Megatron's activations are ``[s, b, h]``), so the strategy hands over the forward's ``attention_mask``
in that order (``start_forward``). Megatron's own auxiliary loss is off (``megatron_convert.moe_config``).

Under pipeline parallelism a stage's routers see the rows of every rank of its pipeline group, through
its own layers only; under tensor parallelism with sequence parallelism a rank's routers see its slice
of the sequence of its TP group's rows, in a context-parallel group its columns of the group's rows, and
under both its TP slice of its columns (the column ranks: the CP group's with their TP ranks) (``RowSplit``). ``SplitRouted`` then gives each rank what it would backpropagate unsplit: the loss of
each member's rows (a member: a rank of the group whose rows ran together) pools all layers and columns
(``f``, the top-k share, summed over the stages and column ranks; ``P``, the mean probability, a sum of
the ranks' parts), so each rank backpropagates the part ``E * sum_e f_e * P_e`` owes to its layers and
columns (``f`` fixed: it has no gradient), weighted by each member's share of the step; the members'
losses and loads are reported to their own ranks. Where the pipeline schedule runs a step's micro-batches
(``megatron_pipeline.run_schedule``), each stage adds its part itself, attached to its output, the other
stages' counts gathered while the schedule goes on (``ScheduledRouting``); under a virtual pipeline each
model chunk of a stage adds its part, every chunk's counts joined in the model's layer order
(``layer_runs``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from reroll.models import megatron_convert as mc
from reroll.models.moe import Routed
from reroll.strategies.megatron_pipeline import Pipeline


def allow_routers_without_transformer_engine() -> None:
    """Megatron-Core 0.16's router linear (``moe_utils.RouterGatingLinearFunction``) tests
    ``te_general_gemm is not None``, a name bound only where Transformer Engine imports: without it every
    router forward raises NameError. Bind it to None, so the router takes its own ``torch.mm`` branch."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class MegatronRouters:
    """The ``TopKRouter`` modules of a Megatron-Core ``GPTModel`` and the model's routing settings
    (``model_coef``: config.json's ``router_aux_loss_coef`` where ``output_router_logits``, else 0);
    ``split``: how this rank's routers see part of the rows run (None: every token of its own rows)."""

    sees_split_rows = True  # a rank's routers may see a slice of each row's tokens (``RowSplit.columns``)

    def __init__(
        self, module: torch.nn.Module, shape: mc.GPTShape, hf_config: Any, split: RowSplit | None = None
    ) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.modules = [m for m in module.modules() if isinstance(m, TopKRouter)]
        self.split, self.num_layers = split, shape.num_layers
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
        routed = Routed() if self.split is None else SplitRouted(split=self.split, num_layers=self.num_layers)

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

    def start_forward(self, attention_mask: torch.Tensor, spans: list[tuple[int, int]] | None = None) -> None:
        """A forward of ``(B, T)`` rows with ``attention_mask`` begins (nothing outside ``capture``):
        the mask of the columns this rank's routers see (all ``T``, or its slice where ``split.columns``);
        ``spans``: under a ``split``, the ``(first row, rows)`` of each member's rows."""
        if self._routed is not None:
            self._routed.logits.append([])
            self._routed.real.append(attention_mask.t().reshape(-1).bool())  # [s, b] order
            if isinstance(self._routed, SplitRouted):
                assert spans is not None
                self._routed.spans.append((attention_mask.shape[0], spans))


@dataclass(frozen=True)
class RowSplit:
    """How the rows a rank's routers see are split over ranks. ``members``: the group whose ranks' rows
    ran together (a pipeline or model-parallel group, a TP group), each rank's own rows a member's; None
    where every rank of the split ran the same rows (one member: a context-parallel group's). ``own``:
    this rank's member index. ``pipe``: the stages, each holding its layers (None: one stage).
    ``columns``: the group whose ranks each route a slice of every row's tokens (the TP ranks under
    sequence parallelism, a context-parallel group, or its ranks with their TP ranks under both; None:
    each routes every token)."""

    members: dist.ProcessGroup | None
    own: int
    pipe: Pipeline | None = None
    columns: dist.ProcessGroup | None = None


@dataclass
class SplitRouted(Routed):
    """A rank's routed logits of its layers and columns of its members' rows (``spans``: per forward,
    the rows and each member's ``(first row, rows)``); ``num_layers``: the model's, all stages.

    Each member's loss pools its rows' every layer and column: ``f`` (the top-k share, no gradient) from
    the counts summed over the column ranks and joined over the stages, ``P`` a sum of the ranks' parts.
    So each rank backpropagates the part ``E * sum_e f_e * P_e`` owes to its layers and columns, weighted
    by each member's share of the step; summed over the ranks (Megatron sums the router's gradient over
    the TP ranks, DDP over the context-parallel ranks among its data-parallel ones) that is the gradient
    of the members' share-weighted losses. Each rank reports its own member's loss and load."""

    split: RowSplit | None = None
    num_layers: int = 0
    spans: list[tuple[int, list[tuple[int, int]]]] = field(default_factory=list)

    def term(self, top_k: int, share: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(this rank's part of every member's share-weighted loss, the loss of this rank's rows, their
        (L, E) counts over every layer)``; every rank of the split's groups must call it."""
        split = self.split
        assert split is not None and self.spans, "SplitRouted.term before a forward"
        members = range(len(self.spans[0][1]))
        probs, counts, tokens, part_p = _column_sums(self, top_k, split.columns)
        real = tokens.clamp_min(1) * self.num_layers  # (M,) token-layers
        total_p = part_p.clone()
        if split.pipe is not None:  # stages hold consecutive layers
            stages = [torch.empty_like(counts) for _ in split.pipe.ranks]
            dist.all_gather(stages, counts.contiguous(), group=split.pipe.group)
            counts = torch.cat(stages, 1)  # (M, L, E)
            dist.all_reduce(total_p, group=split.pipe.group)
        f = counts.sum(1) / real[:, None]
        shares = torch.tensor([share], device=probs.device, dtype=torch.float32)
        if split.members is not None:
            parts = [torch.zeros_like(shares) for _ in members]
            dist.all_gather(parts, shares, group=split.members)
            shares = torch.cat(parts)
        experts, own = probs.shape[-1], split.own
        weighted = (shares[:, None] * experts * f * probs / real[:, None]).sum()
        aux = experts * (f[own] * total_p[own] / real[own]).sum()
        return weighted, aux, counts[own]


def _column_sums(
    routed: SplitRouted, top_k: int, columns: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every member's sums over ``routed``'s forwards (``_member_sums``): this rank's router
    probabilities ``(M, E)`` (with their gradient), and over every column rank (``columns``; None: this
    rank's columns are the row's) the top-k counts ``(M, L_here, E)``, the real tokens ``(M,)`` and the
    probabilities' sum ``(M, E)`` (no gradient), all summed in one collective."""
    members = range(len(routed.spans[0][1]))
    sums = [_member_sums(routed, m, top_k) for m in members]
    probs = torch.stack([p for p, _, _ in sums])  # (M, E), this rank's layers and columns
    counts = torch.stack([c for _, c, _ in sums])  # (M, L_here, E)
    tokens = torch.stack([r for _, _, r in sums])  # (M,) in this rank's columns
    part_p = probs.detach()
    if columns is not None:  # every column: counts, tokens and P's part at once
        layers, experts = counts.shape[1:]
        totals = torch.cat([counts.reshape(len(members), -1), tokens[:, None], part_p], 1)
        dist.all_reduce(totals, group=columns)
        counts = totals[:, : layers * experts].reshape(counts.shape)
        tokens, part_p = totals[:, layers * experts], totals[:, layers * experts + 1 :]
    return probs, counts, tokens, part_p


def _member_sums(
    routed: SplitRouted, member: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Over ``routed``'s forwards, member ``member``'s real tokens through this rank's layers and columns:
    the router probabilities summed ``(E,)``, the top-k counts ``(L_here, E)`` and the tokens counted."""
    p_sum = counts = tokens = 0
    for layers, real, (rows, spans) in zip(routed.logits, routed.real, routed.spans, strict=True):
        logits = torch.stack(layers).float()  # (L_here, N, E), N = s * rows in [s, b] order
        first, n = spans[member]
        row = torch.arange(logits.shape[1], device=logits.device) % rows
        mask = (real.to(logits.device) & (row >= first) & (row < first + n)).float()
        probs = torch.softmax(logits, dim=-1)
        chosen = torch.topk(probs.detach(), top_k, dim=-1).indices
        c = torch.zeros(logits.shape[0], logits.shape[2], device=logits.device)
        c.scatter_add_(
            1,
            chosen.reshape(logits.shape[0], -1),
            mask.repeat_interleave(top_k).expand(logits.shape[0], -1),
        )
        p_sum = p_sum + (probs * mask[None, :, None]).sum((0, 1))
        counts, tokens = counts + c, tokens + mask.sum()
    return p_sum, counts, tokens


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


def layer_runs(num_layers: int, pp: int, vp: int = 1) -> list[tuple[int, int]]:
    """The ``(stage, model chunk)`` of each run of consecutive decoder layers over ``pp`` stages of ``vp``
    chunks each, in the model's order (where ``mc.virtual_stage_layers`` puts them): at ``vp = 1`` the
    stages in order; under a virtual pipeline every stage's chunk 0, then every stage's chunk 1, ..."""
    held = [(p, c) for p in range(pp) for c in range(vp)]
    return sorted(held, key=lambda pc: mc.virtual_stage_layers(num_layers, pc[0], pp, vp, pc[1]).start)


class ScheduledRouting:
    """The router term of a step whose micro-batches the pipeline schedule runs
    (``megatron_pipeline.run_schedule``): each stage adds its routers' part itself, as ``SplitRouted.term``
    computes it inside a rank's loss without the schedule, with the same arithmetic.

    Each micro-batch's forward through a model chunk of the stage (one but under a virtual pipeline:
    ``chunks``) records its routers' logits (``forward``); the chunk's part of every member's
    share-weighted term, ``sum_m share_m E f_m . P_m / real_m``, is attached to the chunk's output
    (``_RouterGrad``), its gradient given in that micro-batch's backward through the chunk: ``f`` (top-k
    counts over every layer of every chunk of every stage, no gradient) comes from the other stages by an
    all-gather started after each chunk's forward and waited for there (every forward of a micro-batch,
    each chunk's on each stage, precedes any backward of it; every stage runs the forwards in one order,
    so the all-gathers pair). The column ranks (TP under sequence parallelism) sum their parts at once,
    as they run in step. ``finish`` gives the step's ``StepRouting`` this rank's statistics, micro-batch
    by micro-batch, the layers' counts joined in the model's order (``layer_runs``). ``shares``: ``(M,
    m)``, each member's micro-batches' shares of the step (fp32, as ``SplitRouted.term`` gathers them),
    ``own_shares`` this rank's as given; micro-batches past them (the interleaved schedule's
    ``fillers``) run without the term."""

    def __init__(
        self,
        routers: MegatronRouters,
        routing: Any,
        shares: torch.Tensor,
        own_shares: list[float],
        chunks: int = 1,
    ) -> None:
        split = routers.split
        assert split is not None and split.pipe is not None and split.members is not None
        self.routers, self.routing, self.shares, self.own_shares = routers, routing, shares, own_shares
        self.split, self.group = split, split.members  # not the stages' group: its point-to-point is busy
        self.stages = [dist.get_group_rank(split.members, rank) for rank in split.pipe.ranks]
        self.runs = layer_runs(routers.num_layers, len(split.pipe.ranks), chunks)
        self.chunks = chunks
        # by (micro-batch, chunk): the all-gather of the counts and P's parts, its buffers, the counts' shape
        self._pending: dict[tuple[int, int], tuple[Any, list[torch.Tensor], torch.Size]] = {}
        self._real: dict[int, torch.Tensor] = {}  # by micro-batch: each member's token-layers (M,)
        self._done: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def forward(self, i: int, chunk: int, start: Any, run: Any) -> torch.Tensor:
        """``run()``, model chunk ``chunk``'s forward of micro-batch ``i`` (``start()`` tells the routers it
        begins), with the router term's gradient attached to its output; a filler's alone."""
        if i >= len(self.own_shares):
            return run()
        coef, top_k, split = self.routing.coef, self.routers.top_k, self.split
        with self.routers.capture() as routed:
            start()
            out = run()
        assert isinstance(routed, SplitRouted)
        members = range(len(routed.spans[0][1]))
        with contextlib.nullcontext() if coef else torch.no_grad():
            probs, counts, tokens, part_p = _column_sums(routed, top_k, split.columns)
        self._real[i] = tokens.clamp_min(1) * self.routers.num_layers  # (M,) token-layers
        packed = torch.cat([counts.reshape(len(members), -1), part_p], 1).contiguous()
        gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size(self.group))]
        gathering = dist.all_gather(gathered, packed, group=self.group, async_op=True)
        self._pending[i, chunk] = gathering, gathered, counts.shape
        if not coef:
            return out
        return _RouterGrad.apply(out, probs, partial(self._grad, i, probs))

    def _f(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Micro-batch ``i``'s ``(M, L, E)`` counts over every layer (in the model's order), ``f`` ``(M,
        E)`` and ``P`` summed over the stages and chunks (in that order), once gathered."""
        if i not in self._done:
            for chunk in range(self.chunks):
                self._pending[i, chunk][0].wait()
            counts, parts = [], []
            for stage, chunk in self.runs:
                _, gathered, shape = self._pending[i, chunk]
                size = shape[1] * shape[2]
                mine = gathered[self.stages[stage]]
                counts.append(mine[:, :size].reshape(shape))
                parts.append(mine[:, size:])
            every_layer = torch.cat(counts, 1)
            total_p = parts[0].clone()
            for part in parts[1:]:
                total_p += part
            self._done[i] = every_layer, every_layer.sum(1) / self._real[i][:, None], total_p
        return self._done[i]

    def _grad(self, i: int, probs: torch.Tensor) -> torch.Tensor:
        """The gradient of ``coef`` times the chunk's part of micro-batch ``i``'s term, by its probs, in
        the order autograd takes it through ``SplitRouted.term``'s expression."""
        _, f, _ = self._f(i)
        real = self._real[i]
        shares = self.shares[:, i].to(probs.device, torch.float32)
        weights = shares[:, None] * probs.shape[-1] * f
        return torch.full_like(probs, self.routing.coef) / real[:, None] * weights

    def finish(self) -> None:
        """This rank's statistics of every micro-batch into the step's ``StepRouting``, in order."""
        own = self.split.own
        for i in range(len(self.own_shares)):
            every_layer, f, total_p = self._f(i)
            real = self._real[i]
            aux = self.routers.experts * (f[own] * total_p[own] / real[own]).sum()
            self.routing.add(aux, self.own_shares[i], every_layer[own])


class _RouterGrad(torch.autograd.Function):
    """Identity on a stage's output; its backward also gives ``probs`` their gradient (``grad_of()``)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, probs: torch.Tensor, grad_of: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.grad_of = grad_of
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        return grad, ctx.grad_of(), None
