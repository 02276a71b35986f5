"""What the roles that hold a training strategy share: actor_train, reference and critic.

A ``StrategyWorker`` sets up its process (threads, seed), holds a training strategy (``strategy.name``), joins its role's
process group, scores batches in micro-batches, skips optimizer steps whose loss or gradient norm is
not finite (and stops after ``optim.max_nonfinite_steps`` of them in a row), saves and loads. A
``StrategyGroup`` starts the ranks and their process group, and splits batches by rows across them.

A non-finite step is skipped the same way on every rank and by every strategy: a micro-batch whose loss
is NaN/inf is backpropagated as ``loss * nan``, so every gradient it reaches is NaN, the global
gradient norm (reduced over the ranks) is NaN, and the strategy's finite-norm guard drops the update
(``Strategy.step`` reports ``skipped``). Collectives stay matched: every rank still runs its backward
and its step.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from reroll.config.memory import forward_only_limits, model_token_shape
from reroll.config.placement import keeps_state, may_park, scaled_peak
from reroll.config.role_memory import GIB, forward_sized, room_beside_phases, with_checkpointing
from reroll.config.schema import RunConfig
from reroll.config.startable import context_parallel_size
from reroll.config.vision import PACKING_REFUSED
from reroll.data.packing import length_order, micro_batches, pack, unpack
from reroll.data.transfer import scalars_to_host, to_device
from reroll.data.types import TrainBatch
from reroll.errors import UserError
from reroll.models.packed_attention import uses_packed_attention
from reroll.models.vision import is_vision_language
from reroll.roles.checkpointing import auto_checkpointing
from reroll.roles.scored_tokens import scored_token_stats
from reroll.runtime import profiling, quiet
from reroll.runtime.actors import WorkerGroup, free_address
from reroll.runtime.placement import configure_process, worker_device
from reroll.strategies import Head, SavedAtOtherWorldSize, make_strategy
from reroll.strategies.context_parallel import ContextParallel
from reroll.strategies.memory import reserved_peak
from reroll.strategies.micro_batches import MB, Record, RouterLoss

log = logging.getLogger(__name__)


def mean_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Each key's mean over the parts that have it (micro-batches, or ranks)."""
    keys = {k for p in parts for k in p}
    return {k: sum(p[k] for p in parts if k in p) / sum(1 for p in parts if k in p) for k in sorted(keys)}


@contextlib.contextmanager
def per_token_head(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collects the output of ``model``'s ``score`` head (a sequence classifier's, at every position,
    before pooling) during the forward passes inside the block."""
    heads = [m for name, m in model.named_modules() if name.split(".")[-1] == "score"]
    if len(heads) != 1:
        raise RuntimeError(f"expected one 'score' head in {type(model).__name__}, found {len(heads)}")
    out: list[torch.Tensor] = []
    handle = heads[0].register_forward_hook(lambda _m, _i, o: out.append(o))
    try:
        yield out
    finally:
        handle.remove()


def _longest_prompt(batch: TrainBatch) -> int:
    """The most tokens before a row's response in ``batch`` (0 for no rows)."""
    return int((batch.attention_mask.sum(1) - batch.response_mask.sum(1)).max()) if len(batch) else 0


def _refuse_packed_images(mb: TrainBatch) -> None:
    if mb.image_grid_thw is not None:
        raise UserError(PACKING_REFUSED)


class StrategyWorker:
    """One rank of a role that holds a model in a training strategy (``roles.<role>`` places it)."""

    # whether its forward-only passes run the head at every position (not only before response tokens)
    head_everywhere = False

    def __init__(
        self, role: str, rank: int, cfg: RunConfig, *, model_path: str, trainable: bool, head: Head
    ) -> None:
        configure_process(cfg, role)
        torch.manual_seed(cfg.seed + rank)
        self.role, self.rank, self.cfg, self.head = role, rank, cfg, head
        if cfg.strategy.name == "deepspeed":
            quiet.allow_deepspeed_notice()  # what DeepSpeed detects concerns a DeepSpeed run
        self.nonfinite_in_row = 0  # optimizer steps skipped in a row (a finite one resets it)
        # this step's micro-batch losses (device scalars) and what each micro-batch held (``_train_micro_batches``)
        self._losses: list[tuple[torch.Tensor, str]] = []
        self._widest = (0, 0)  # the widest micro-batch seen (tokens a row, longest prompt part)
        self._room = (0, math.inf)  # (prompt tokens, _room_beside_phases's bytes at them)
        self._sized: dict[tuple[int, object], RunConfig] = {}  # _forward_sized's, per width and count
        self._resting = 0  # the most GPU bytes it held when asked to give the device away (its state)
        # (bytes above the state it started from, tokens a row) of the pass that last raised the reserved
        # peak, and (allocated at its start, the reserved peak before it, tokens a row) of the pass running
        self._transient = (0, 0)
        self._pass: tuple[int, int, int] | None = None
        self.strategy = make_strategy(
            cfg,
            model_path=model_path,
            device=worker_device(cfg, role),
            trainable=trainable,
            rank=rank,
            world_size=getattr(cfg.roles, role).world_size,
            head=head,
            context_parallel=context_parallel_size(cfg, role),
        )
        # forward-only passes on a GPU size from the model's shape (forward_only_limits; None: training's)
        self._shape = model_token_shape(model_path) if self.strategy.device.type == "cuda" else None
        # model.gradient_checkpointing 'auto': the count chosen at each pass from the widest rows seen
        self._checkpointing = auto_checkpointing(cfg, role, self.strategy, model_path, trainable=trainable)
        # optim.packing; None: where the model's attention keeps packed rows apart (a causal LM on CUDA)
        packing = cfg.optim.packing
        self.packing = (
            packing
            if packing is not None
            else head == "causal_lm"
            and uses_packed_attention(self.strategy.model)
            and not is_vision_language(self.strategy.model)
        )
        self._park_ahead()  # a frozen role's weights (a trainer's state grows at configure_optimizer)

    def rendezvous_address(self) -> str:
        return free_address()

    def init_distributed(self, address: str) -> None:
        self.strategy.init_distributed(address)
        self._park_ahead()  # strategies that build their model here (DeepSpeed, Megatron)

    def configure_optimizer(self, lr: float, warmup_steps: int) -> None:
        o = self.cfg.optim
        self.strategy.configure_optimizer(
            lr=lr, betas=o.betas, weight_decay=o.weight_decay, warmup_steps=warmup_steps
        )
        self._park_ahead()

    def save(self, directory: str, with_optimizer: bool) -> None:
        self.strategy.save(Path(directory), with_optimizer=with_optimizer)

    def load(self, directory: str) -> None:
        try:
            self.strategy.load(Path(directory))
        except SavedAtOtherWorldSize as e:
            world_size = f"roles.{self.role}.world_size"
            path = "critic.model_path" if self.role == "critic" else "model.path"
            raise UserError(
                f"{e}: resume it with {world_size}={e.saved} (its next checkpoint resumes at any world "
                f"size), or start a new run from its weights ({path}={e.directory / 'model'}, a fresh "
                f"optimizer) with {world_size}={e.current}"
            ) from e

    def profile_start(self, step: int) -> None:
        """Record this rank's work in ``step`` until ``profile_stop`` (``logging.profile_steps``)."""
        profiling.start(f"{self.role}-{self.rank}", step)

    def profile_stop(self, directory: str) -> list[str]:
        """Write what was recorded since ``profile_start``: the paths of the trace and the table."""
        return profiling.stop(Path(directory), f"{self.role}-{self.rank}")

    def offload(self) -> int:
        """Give the device to a colocated role: move the state to host memory, or, where
        ``placement.offload`` is 'auto' and the state fits beside the engine's share of the GPU, keep
        it and free only the allocator's cached blocks (the decision is remade, measured, each time).
        Returns the bytes moved off the GPU (0 where the state stays, and off GPUs)."""
        before = self._allocated()
        self._resting = max(self._resting, before)
        if self._fits_beside_engine():  # which freed the cached blocks before measuring
            return 0
        self.strategy.offload()
        self._offloaded = True
        moved = max(before - self._allocated(), 0)
        if self.strategy.device.type == "cuda":  # the moved state's blocks to the driver: until then the
            torch.cuda.empty_cache()  # allocator keeps them cached and the role taking the GPU gets none
        return moved

    def reload(self) -> int:
        """Bring back what ``offload`` moved; returns the bytes moved onto the GPU."""
        if not getattr(self, "_offloaded", False):
            return 0
        before = self._allocated()
        self.strategy.reload()
        self._offloaded = False
        return max(self._allocated() - before, 0)

    def _allocated(self) -> int:
        """The bytes of tensors this rank holds on its GPU (0 off GPUs, where nothing moves)."""
        device = self.strategy.device
        return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0

    def memory_need(self) -> tuple[int, int, int]:
        """``(most bytes, resting bytes, GPU bytes)``: the most this rank may hold on its GPU in a phase,
        its state now plus what its largest pass took above the state it started from, scaled from that
        pass's micro-batch width to rows of the longest prompt seen plus ``rollout.max_new_tokens``
        (``scaled_peak``); what it keeps between phases (its state: what it holds between calls, or
        held when last asked to offload, should it be in host memory now); its GPU's memory.
        ``(0, 0, 0)`` off GPUs or before its first pass.

        Above the state the pass started from, not the state now: a trainer's first step measures its
        peak before the optimizer's moments exist, and every later step holds them through its pass
        (the 3B row on an H100 80GB, 2026-12-07: the engine kept awake from step 1's peak read against
        the state after it, and step 2's training ran out of memory 4.6 GiB short)."""
        device = self.strategy.device
        self._end_pass()
        transient, width = self._transient
        if device.type != "cuda" or not width:
            return 0, 0, 0
        longest = self._widest[1] + self.cfg.rollout.max_new_tokens
        rest = max(self._resting, torch.cuda.memory_allocated(device))
        need = scaled_peak(rest + transient, rest, width, longest)
        return need, rest, torch.cuda.get_device_properties(device).total_memory

    def _begin_pass(self, width: int) -> None:
        """A pass over micro-batches ``width`` tokens a row starts: the state it starts from and the
        reserved peak before it, for ``_end_pass`` (on a GPU)."""
        device = self.strategy.device
        if device.type != "cuda":
            return
        self._end_pass()
        self._pass = (torch.cuda.memory_allocated(device), reserved_peak(device), width)

    def _end_pass(self) -> None:
        """Close the pass ``_begin_pass`` opened (at the next pass, or when the need is asked): where it
        raised the reserved peak (or none has yet), what it took above its starting state becomes the
        transient ``memory_need`` adds to the state; a pass under an earlier peak says nothing new."""
        if self._pass is None:
            return
        start, before, width = self._pass
        self._pass = None
        peak = reserved_peak(self.strategy.device)
        if peak > before or not self._transient[1]:
            self._transient = (max(peak - start, 0), width)

    def _fits_beside_engine(self) -> bool:
        """'auto' on a GPU with a vLLM engine (``keeps_state``): this role's reserved memory, once the
        allocator's cached blocks are freed, leaves the engines their shares, and the other colocated
        roles the peaks of their phases by the plan's estimate (``_room_beside_phases``). Where it does, that memory
        may have grown nearer the limit than the state predicted: its host buffers are prepared then if
        so (``_park_ahead``), during the phase this rank gives the GPU to."""
        cfg = self.cfg
        if cfg.placement.offload != "auto" or cfg.rollout.engine != "vllm" or not torch.cuda.is_available():
            return False
        if worker_device(cfg, self.role) != "cuda":
            return False
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        reserved = torch.cuda.memory_reserved()
        kept = keeps_state(cfg, self.role, reserved, total) and reserved <= self._room_beside_phases(total)
        if kept:
            self._park_ahead(reserved)
        return kept

    def _park_ahead(self, measured: int = 0) -> None:
        """Have the strategy page-lock its state's host buffers in the background where this rank is
        likely to offload (``may_park``, of its state or of the ``measured`` memory it kept on the GPU
        at an eviction, the larger), so that its first offload only copies. Called once the model is
        built, once the optimizer is (its moments predicted), after each optimizer step (what is new
        since: prepared buffers are kept) and at each eviction the state stayed through (the measured
        memory, which the next eviction's decision reads, may have grown nearer the limit)."""
        device = self.strategy.device
        if device.type != "cuda":
            return
        total = torch.cuda.get_device_properties(device).total_memory
        room = self._room_beside_phases(total)
        self.strategy.prepare_offload(
            lambda state: may_park(self.cfg, self.role, max(state, measured), total, room=room)
        )

    def _room_beside_phases(self, total: int) -> float:
        """Bytes this rank may keep on its GPU through the other colocated roles' phases
        (``room_beside_phases``, at the longest prompt seen); unbounded where the model's shape is
        unknown (off GPUs)."""
        if self._shape is None:
            return math.inf
        prompt = max(self._widest[1], 1)
        if self._room[0] != prompt:
            gib = room_beside_phases(
                self.cfg, self._shape, self.role, prompt_tokens=prompt, gpu_memory_gib=total / GIB
            )
            self._room = (prompt, gib * GIB)
        return self._room[1]

    def micro_batches(
        self, batch: TrainBatch, *, forward_only: bool = False, by_length: bool = True
    ) -> list[TrainBatch]:
        """This rank's micro-batches: up to ``optim.max_tokens_per_micro_batch`` real tokens each when
        set, else ``optim.micro_batch_size`` rows; ``forward_only`` (no backward follows): the
        ``optim.logprob_*`` limits when either is set. The rows are cut in ``_row_order`` (longest first
        with ``optim.group_by_length``), in the batch's order with ``by_length=False``. With several
        ranks, every rank gets as many as the rank with the most (a sharded strategy's forward is a
        collective), as far as its rows allow."""
        if self._checkpointing is not None:  # before the limits: forward-only ones scale from its count
            # rows of the longest prompt seen plus rollout.max_new_tokens, or as wide as the widest seen
            width = max(self._widest[0], batch.input_ids.shape[1]) - self.cfg.rollout.max_new_tokens
            self._checkpointing.fit(max(self._widest[1], _longest_prompt(batch), width))
        if by_length:
            batch = batch.select(self._row_order(batch, forward_only=forward_only))
        limits = self._limits(forward_only, batch.input_ids.shape[1])
        parts = micro_batches(batch, **limits)
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = (
                torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
            )
            most = to_device(torch.tensor([len(parts), -len(batch)]), device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)  # [most micro-batches, -fewest rows] over the ranks
            most_parts, fewest_rows = most.tolist()  # one copy back
            count = min(most_parts, -fewest_rows)
            parts = parts if count == len(parts) else micro_batches(batch, **limits, count=count)
        self._note_width(batch, parts)
        return parts

    def _note_width(self, batch: TrainBatch, parts: list[TrainBatch]) -> None:
        """Keep the widest micro-batch's tokens a row and the longest prompt part of a row seen so far
        (what ``memory_need`` scales the measured peak from)."""
        width = max((p.input_ids.shape[1] for p in parts), default=0)
        self._widest = (max(self._widest[0], width), max(self._widest[1], _longest_prompt(batch)))
        self._begin_pass(width)

    def forward(self, mb: TrainBatch) -> torch.Tensor:
        """The model's output on a micro-batch, ``(b, t, ...)`` right-padded like ``mb.input_ids``; with
        ``optim.packing`` its rows run as one packed sequence (no padding computed) and are unpacked."""
        cp = self.context_parallel
        if not self.packing:
            out = self.strategy.logits(mb.input_ids, mb.attention_mask, images=mb.images())
            return out if cp is None else cp.gather(out, mb.input_ids.shape[1])
        _refuse_packed_images(mb)
        packed = pack(mb)
        if self.head != "reward":
            out = self.strategy.logits(packed.input_ids, None, packed.position_ids)
            out = out if cp is None else cp.gather(out, packed.input_ids.shape[1])
            return unpack(out, packed, mb.input_ids.shape[1])
        # a sequence classifier pools its one packed row to one score: take the head's per-token
        # output instead (inside the forward, where a sharded head is gathered), (b, t, 1) unpacked.
        # The pooled output stays in the graph (times 0): fsdp2 and ZeRO-3 gather the head for its
        # backward by hooks on the model's output, which the per-token output alone would bypass
        with per_token_head(self.strategy.model) as scores:
            pooled = self.strategy.logits(packed.input_ids, None, packed.position_ids)
        per_token = scores[0] + 0.0 * pooled.sum()
        return unpack(per_token, packed, mb.input_ids.shape[1])

    def response_stats(
        self, mb: TrainBatch, temperature: float, *, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(b, t)`` fp32 log-probs of ``mb``'s response tokens at ``temperature`` and their entropy
        (zeros unless ``entropy``), 0 off the response, aligned like ``token_logprobs``.

        The head runs at the positions before the response tokens alone (``head_at``): prompt and
        padding positions cost no (tokens x vocabulary) work, no logits are unpacked or gathered, and
        the backward writes the logits' gradient only where a loss reads it. With context parallelism each
        rank of a group runs its columns and the group's log-probs come back whole to each."""
        t = mb.input_ids.shape[1]
        before = torch.nn.functional.pad(mb.response_mask[:, 1:].bool(), (0, 1), value=False)
        if self.packing:
            _refuse_packed_images(mb)
            packed = pack(mb)
            picked = before[packed.rows, packed.cols].nonzero().squeeze(-1)  # packed positions
            rows, cols = packed.rows[picked], packed.cols[picked]
            args: tuple[Any, ...] = (packed.input_ids, None, packed.position_ids)
        else:
            rows, cols = before.nonzero(as_tuple=True)
            picked = rows * t + cols
            args = (mb.input_ids, mb.attention_mask, None, mb.images())
        cp = self.context_parallel
        return scored_token_stats(
            self.strategy.model,
            lambda: self.strategy.logits(*args),
            picked,
            rows,
            cols,
            mb.input_ids,
            temperature,
            entropy=entropy,
            split=None if cp is None else (cp, args[0].shape[1]),
            fused=self.strategy.fused_head and self.cfg.model.fused_head,
            device=self.strategy.device,
        )

    @property
    def context_parallel(self) -> ContextParallel | None:
        """This rank's context-parallel group, where its strategy splits sequences."""
        return getattr(self.strategy, "context_parallel", None)

    def _limits(self, forward_only: bool, width: int) -> dict[str, int | None]:
        """``micro_batches``' limits for rows ``width`` tokens wide: ``optim.max_tokens_per_micro_batch``
        real tokens when set, else ``optim.micro_batch_size`` rows; for a forward-only pass the
        ``optim.logprob_*`` ones when set, and where unset on a GPU, training's scaled to the same memory
        (``forward_only_limits``), no larger than lets every colocated role stay resident beside the
        engine where training's size does (``forward_sized``)."""
        o = self.cfg.optim
        rows, budget = o.micro_batch_size, o.max_tokens_per_micro_batch
        if forward_only:
            cfg = self.cfg
            if self._checkpointing is not None:  # 'auto': the count training checkpoints now
                cfg = with_checkpointing(cfg, self._checkpointing.count)
            cfg = self._forward_sized(cfg, width)
            rows, budget = forward_only_limits(cfg, self._shape, width, every_position=self.head_everywhere)
        return {"max_rows": None if budget else rows, "max_tokens": budget}

    def _forward_sized(self, cfg: RunConfig, width: int) -> RunConfig:
        """``forward_sized`` of ``cfg`` for rows ``width`` tokens wide on this rank's GPU (unchanged off
        GPUs), kept per width and checkpointed count."""
        if self._shape is None or self.strategy.device.type != "cuda":
            return cfg
        key = (width, cfg.model.gradient_checkpointing)
        if key not in self._sized:
            total = torch.cuda.get_device_properties(self.strategy.device).total_memory
            prompt = max(width - cfg.rollout.max_new_tokens, 1)
            self._sized[key] = forward_sized(
                cfg, self._shape, prompt_tokens=prompt, gpu_memory_gib=total / GIB
            )
        return self._sized[key]

    def _row_order(self, batch: TrainBatch, *, forward_only: bool = False) -> torch.Tensor:
        """The order micro-batches take the rows in: longest first with ``optim.group_by_length`` (rows of
        similar length share a micro-batch, so little padding is computed); as given without it, or where
        the rows fit in one micro-batch (reordering them would change only the float summation order)."""
        limits, order = self._limits(forward_only, batch.input_ids.shape[1]), torch.arange(len(batch))
        rows, budget = limits["max_rows"], limits["max_tokens"]
        one = len(batch) <= rows if budget is None else int(batch.attention_mask.sum()) <= budget
        return order if one or not self.cfg.optim.group_by_length else length_order(batch)

    @torch.no_grad()
    def _score(self, batch: TrainBatch, per_token: Callable[[TrainBatch], torch.Tensor]) -> torch.Tensor:
        """``per_token(micro-batch)`` (b, t) over this rank's micro-batches: (B, T), in the batch's row
        order."""
        mbs, back = self._forward_only_micro_batches(batch)
        parts = self.strategy.score_micro_batches(mbs, per_token)  # kept where computed: one copy, at the end
        return TrainBatch.concat(parts, width=batch.input_ids.shape[1]).cpu()[back]

    def _forward_only_micro_batches(self, batch: TrainBatch) -> tuple[list[TrainBatch], torch.Tensor]:
        """A forward-only pass's micro-batches (rows in ``_row_order``) and the indices that put the rows
        of their concatenated outputs back in the batch's order."""
        order = self._row_order(batch, forward_only=True)
        return self.micro_batches(batch.select(order), forward_only=True, by_length=False), order.argsort()

    def _train_micro_batches(
        self,
        mbs: Sequence[MB],
        loss_of: Callable[[MB], tuple[torch.Tensor, str, Record]],
        router: RouterLoss | None = None,
    ) -> list[Record]:
        """Backpropagate the loss of every micro-batch of a step, ``loss_of(mb) -> (loss, what the
        micro-batch held, record)``, through the strategy (``Strategy.train_micro_batches``: one after
        the other, or scheduled, ``loss_of`` then possibly run on another rank of the model's group);
        each one's record, in order; ``router``: a mixture of experts' term, added to each loss. A
        non-finite loss is backpropagated as ``loss * nan`` so that the
        step is skipped, a finite one as ``loss * 1`` (the same gradients: the factor is exact), the factor
        chosen on the GPU: the host does not wait for the loss's value. The value is kept with what the
        micro-batch held (its rows, response tokens and the statistics of what the loss read) for the
        diagnostic of a skipped step (``_step``)."""

        def scaled(mb: MB) -> tuple[torch.Tensor, tuple[torch.Tensor, str, Record]]:
            loss, inputs, record = loss_of(mb)
            value = loss.detach()
            factor = torch.where(torch.isfinite(value), 1.0, float("nan")).to(value.dtype)
            return loss * factor, (value, inputs, record)

        out = self.strategy.train_micro_batches(mbs, scaled, router)
        self._losses += [(value, inputs) for value, inputs, _ in out]
        return [record for _, _, record in out]

    def _step(self, prefix: str, skipped_key: str) -> dict[str, float]:
        """The optimizer step: its gradient norm and lr as ``<prefix>/grad_norm``, ``<prefix>/lr``, and
        ``skipped_key`` 1 when the loss or gradient norm was not finite and the update was skipped.

        ``optim.max_nonfinite_steps`` skipped in a row raise ``FloatingPointError`` with the last one's
        diagnostic (the role's error then names the phase and step)."""
        out = self.strategy.step(self.cfg.optim.grad_clip)
        self._park_ahead()
        skipped = bool(out.pop("skipped", 0.0))
        losses, self._losses = self._losses, []
        self.nonfinite_in_row = self.nonfinite_in_row + 1 if skipped else 0
        if skipped:  # the losses' values, read only now (a non-finite loss makes the norm NaN)
            values = scalars_to_host([v for v, _ in losses])
            bad = [
                f"loss {v} on a micro-batch of {inputs}"
                for v, (_, inputs) in zip(values, losses)
                if not math.isfinite(v)
            ]
            limit = self.cfg.optim.max_nonfinite_steps
            why = "; ".join(bad) if bad else "every loss finite"
            diagnostic = f"gradient norm {out.get('grad_norm')} ({why})"
            if self.nonfinite_in_row >= limit:
                raise FloatingPointError(
                    f"{self.nonfinite_in_row} optimizer steps in a row had a non-finite loss or gradient "
                    f"norm (optim.max_nonfinite_steps={limit}); the last: {diagnostic}. Lower optim.lr or "
                    f"optim.grad_clip, and check the rewards and advantages the batches carry"
                )
            log.warning(
                "%s[%d]: optimizer step skipped (%d in a row of at most %d): %s",
                self.role, self.rank, self.nonfinite_in_row, limit, diagnostic,
            )  # fmt: skip
        return {f"{prefix}/{k}": v for k, v in out.items()} | {skipped_key: float(skipped)}


class StrategyGroup(WorkerGroup):
    """The ranks of a strategy role, joined in one process group when there are several."""

    def __init__(
        self,
        role: str,
        cls: type,
        make_args: Callable[[int], tuple[Any, ...]],
        cfg: RunConfig,
        *,
        name: str | None = None,
    ) -> None:
        super().__init__(role, cls, make_args, cfg, name=name)
        self._join()

    def restart(self) -> None:
        """Fresh ranks in a fresh process group (a dead rank's peers cannot go on in the old one)."""
        super().restart()
        self._join()

    def _join(self) -> None:
        if self.world_size > 1:
            [address] = self._wait([self._handles[0].rendezvous_address.remote()], "rendezvous")
            self._wait([h.init_distributed.remote(address) for h in self._handles], "init_distributed")

    def configure_optimizer(self, lr: float, warmup_steps: int) -> None:
        self._wait(
            [h.configure_optimizer.remote(lr, warmup_steps) for h in self.handles], "configure_optimizer"
        )

    def save(self, directory: Path, with_optimizer: bool = True) -> None:
        self._wait([h.save.remote(str(directory), with_optimizer) for h in self.handles], "save")

    def load(self, directory: Path) -> None:
        self._wait([h.load.remote(str(directory)) for h in self.handles], "load")

    def profile_start(self, step: int) -> None:
        self._wait([h.profile_start.remote(step) for h in self._handles], "profile_start")

    def profile_stop(self, directory: Path) -> list[str]:
        """Every rank's trace and table of the work recorded since ``profile_start``."""
        written = self._wait([h.profile_stop.remote(str(directory)) for h in self._handles], "profile_stop")
        return [path for paths in written for path in paths]

    def offload(self) -> int:
        """Parameters, gradients and optimizer state off the device (another role needs it); returns the
        bytes moved, summed over the ranks."""
        return sum(self._wait([h.offload.remote() for h in self._handles], "offload"))

    def reload(self) -> int:
        return sum(self._wait([h.reload.remote() for h in self._handles], "reload"))

    def memory_need(self) -> tuple[int, int, int]:
        """The most one rank may hold on its GPU in a phase, the most one keeps between phases, and that
        GPU's bytes (``(0, 0, 0)`` before a pass, or off GPUs)."""
        needs = self._wait([h.memory_need.remote() for h in self._handles], "memory_need")
        return max(n[0] for n in needs), max(n[1] for n in needs), max(n[2] for n in needs)
