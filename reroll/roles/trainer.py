"""actor_train and reference: a worker that holds a training strategy, and its group of ranks.

The same worker serves both roles (the reference is built with ``trainable=False`` and never steps).
The loss comes from ``reroll.algorithms``; the strategy only runs forward, backward and step.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from reroll.config.schema import RunConfig
from reroll.config.startable import context_parallel_size, context_parallel_stride
from reroll.data.preferences import PairBatch
from reroll.data.transfer import metrics_to_host
from reroll.data.types import TrainBatch
from reroll.errors import RoleError, UserError
from reroll.models.loading import DTYPES
from reroll.models.moe import Routers, StepRouting
from reroll.roles.objectives import Objective
from reroll.roles.preference import PairWorkerMixin
from reroll.roles.strategy_worker import StrategyGroup, StrategyWorker
from reroll.runtime.actors import LocalHandle
from reroll.runtime.shared_buckets import BucketSharer, SharedBucket
from reroll.runtime.weight_sync import (
    BroadcastGroup,
    BucketLayout,
    WeightBucket,
    pack_bucket,
    split_into_buckets,
)
from reroll.strategies.context_parallel import data_shards, group_leaders
from reroll.strategies.lora import AdapterUpdate, payload_bytes
from reroll.strategies.micro_batches import RouterLoss

if TYPE_CHECKING:
    from reroll.strategies.megatron_moe import MegatronRouters


class TrainerWorker(PairWorkerMixin, StrategyWorker):
    """One rank of actor_train or reference (pipeline reward_model: actor_train is the reward model)."""

    def __init__(self, role: str, rank: int, cfg: RunConfig, trainable: bool) -> None:
        head = cfg.policy_head
        super().__init__(role, rank, cfg, model_path=cfg.model.path, trainable=trainable, head=head)
        self.temperature = cfg.rollout.temperature or 1.0
        self._sync_bytes = 0
        self._sharer: BucketSharer | None = None  # transport 'ipc': this rank's shared buffers
        self._sharing: Iterator[WeightBucket] | None = None  # transport 'ipc': the buckets still to make
        self._weight_group: BroadcastGroup | None = None  # rank 0, transport 'collective'
        self._collective_bytes = 0  # bytes the last sync broadcast through that group
        self._frozen_sent = not trainable
        self._trainable = trainable

    # DeepSpeed and Megatron build their model in init_distributed: what is read from it, at first use
    @functools.cached_property
    def _frozen(self) -> set[str]:
        """Weights that never change (a frozen vision tower): sent at the first sync only (which also
        covers a checkpoint whose tower was trained), skipped at the others."""
        return {n for n, p in self.strategy.model.named_parameters() if not p.requires_grad}

    @functools.cached_property
    def routers(self) -> Routers | MegatronRouters | None:
        """A mixture of experts' routers (None for a dense model, or a rank that does not train): the
        strategy's own where its model is not a transformers one (``moe_routers``: Megatron-Core)."""
        if not self._trainable:
            return None
        own = getattr(self.strategy, "moe_routers", None)
        return own if own is not None else Routers.of(self.strategy.model)

    def compute_logprobs(self, batch: TrainBatch, base_model: bool = False) -> torch.Tensor:
        """``(B, T)`` log-probs of ``batch.input_ids`` at the sampling temperature on the response tokens
        (0 elsewhere: only those enter a loss); ``base_model``: with the LoRA adapters disabled (the
        reference policy of a LoRA run)."""
        with self.strategy.adapters_disabled() if base_model else contextlib.nullcontext():
            return self._score(batch, lambda mb: self.response_stats(mb, self.temperature, entropy=False)[0])

    def train(self, batch: TrainBatch | PairBatch, objective: Objective) -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch, minimising ``objective``
        (``reroll.roles.objectives``). ``train/tokens_per_s``: real (non-padding) tokens of the share
        over the seconds of forward, backward and step."""
        start = time.perf_counter()
        routing = self._routing()

        def loss_of(mb: Any) -> tuple[torch.Tensor, str, dict[str, Any]]:
            """The micro-batch's loss, what it held and its metrics (``_train_micro_batches``)."""
            loss = objective.loss(self, mb, batch)
            return loss.value, loss.inputs, loss.metrics

        mbs = list(objective.micro_batches(self, batch))
        # a mixture of experts: its load-balancing loss joins each micro-batch's, its statistics kept
        router = None if routing is None else RouterLoss(routing, [objective.share(mb, batch) for mb in mbs])
        parts = self._train_micro_batches(mbs, loss_of, router)
        step = self._step(objective.prefix, objective.skipped)  # waits for the gradient norm
        out = objective.reduce(metrics_to_host(parts), batch) | step  # every micro-batch's in one copy
        out |= routing.metrics(objective.prefix) if routing is not None else {}
        rows = [batch] if isinstance(batch, TrainBatch) else [batch.chosen, batch.rejected]
        tokens = float(sum(r.attention_mask.sum() for r in rows))
        return out | {"train/tokens_per_s": tokens / (time.perf_counter() - start)}

    def _routing(self) -> StepRouting | None:
        """A mixture of experts' router term for a step (``model.router_aux_loss_coef``, else the model's
        own); None for a dense model."""
        if self.routers is None:
            return None
        cp = self.context_parallel
        split_ok = getattr(self.routers, "sees_split_rows", False)  # Megatron's pool a row over its ranks
        if cp is not None and cp.size > 1 and not split_ok:  # each rank's routers see 1/n of a row's tokens
            raise UserError(
                f"strategy.context_parallel={cp.size} with a mixture-of-experts model: its router's "
                "load-balancing loss and statistics are built for whole rows (not yet for rows split "
                "over ranks); set strategy.context_parallel=1"
            )
        return StepRouting(self.routers, self.routers.coef(self.cfg.model.router_aux_loss_coef))

    def adapter_update(self) -> AdapterUpdate | None:
        """Rank 0: the LoRA adapters and their config (``strategy.lora.sync: adapters``). Every rank must
        call it (a sharded strategy gathers collectively); the others return None."""
        update = self.strategy.adapter_update()
        self._sync_bytes = update.num_bytes
        return update if self.rank == 0 else None

    def join_weight_group(self, address: str, world_size: int, backend: str) -> None:
        """Rank 0: host and join the weight-sync group (``collective`` transport) as its rank 0, the
        source; the engines join it at the same time (``reroll.roles.actor_infer.form_weight_group``)."""
        if self._weight_group is not None:
            self._weight_group.close()
            self._weight_group = None
        self._weight_group = BroadcastGroup(address, 0, world_size, backend, self.cfg.runtime.call_timeout_s)

    def stream_weights(
        self, bucket_mb: float, transport: str = "object_store"
    ) -> Iterator[WeightBucket | BucketLayout]:
        """Rank 0: the full weights (Hugging Face names) in buckets of whole layers, about ``bucket_mb``
        MiB each (a Ray streaming generator: the engines load one bucket while the next is sent). Every
        rank must call it, like ``adapter_update``; the others yield nothing.

        ``transport`` 'object_store': CPU tensors; 'collective': each bucket is copied into one buffer
        in the engine's dtype (on the GPU with nccl), its ``BucketLayout`` yielded, and the buffer
        broadcast through the weight-sync group while the engines receive it
        (``EngineWorker.load_weights``). ('ipc' goes bucket by bucket through ``share_next``.)"""
        group = self._weight_group
        if transport == "collective" and self.rank == 0 and group is None:
            raise RuntimeError("transport 'collective' before join_weight_group formed the weight-sync group")
        on_device = transport == "collective" and group is not None and group.backend == "nccl"
        dtype = DTYPES[self.cfg.model.dtype]
        self._sync_bytes = self._collective_bytes = 0
        for bucket in split_into_buckets(self._full_weights(on_device), int(bucket_mb * 2**20)):
            if transport == "object_store":
                self._sync_bytes += payload_bytes(dict(bucket))
                if self.rank == 0:
                    yield bucket
                continue
            self._sync_bytes += sum(t.numel() for _, t in bucket) * dtype.itemsize
            if self.rank != 0:
                continue
            assert group is not None
            layout, flat = pack_bucket(bucket, dtype, group.device)
            del bucket
            yield layout  # the driver hands it to the engines, which then receive the buffer
            sent = group.bytes
            group.broadcast(flat)
            self._collective_bytes += group.bytes - sent

    def _full_weights(self, on_device: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights one at a time where the strategy can (``named_weights``, every rank gets
        them; LoRA merged into the base a layer at a time), so the full state dict never sits in memory;
        else (the strategies that gather all at once) its ``full_state_dict``. Weights that never change
        (a frozen vision tower) only at the first call (``_frozen``)."""
        named_weights = getattr(self.strategy, "named_weights", None)
        if named_weights is not None:
            named = named_weights(on_device=on_device)
            skip, self._frozen_sent = self._frozen if self._frozen_sent else set(), True
            return ((k, v) for k, v in named if k not in skip) if skip else named
        named = iter(self.strategy.full_state_dict().items())
        return ((k, v.to(self.strategy.device)) for k, v in named) if on_device else named

    def begin_share(self, bucket_mb: float, device: int | None) -> None:
        """Start an 'ipc' sync: every rank walks its full weights in buckets of whole layers of about
        ``bucket_mb`` MiB (``share_next``; a sharded strategy gathers collectively, so every rank takes
        part); a rank given its pool ``device`` (engine workers sit there) shares each bucket."""
        self.release_shared()
        self._sharer = None if device is None else BucketSharer(device, torch.device(self.strategy.device))
        self._sharing = split_into_buckets(self._full_weights(True), int(bucket_mb * 2**20))
        self._sync_bytes = 0

    def share_next(self) -> tuple[bool, SharedBucket | None]:
        """The next bucket of an 'ipc' sync: ``(True, its handle)`` (None on a rank that shares
        nothing), ``(False, None)`` once every bucket was made. First frees every buffer but the last
        one shared: the driver asks for the next bucket only once the loads before that one are done."""
        if self._sharing is None:
            raise RuntimeError("share_next before begin_share started an 'ipc' weight sync")
        if self._sharer is not None:
            self._sharer.release(keep=1)
        bucket = next(self._sharing, None)
        if bucket is None:
            self._sharing = None
            if self._sharer is not None and self._sharer.bytes == 0:
                raise RuntimeError(
                    f"{self.role} rank {self.rank} has no weights to share with the engine worker on its "
                    "device (its strategy gathers them on rank 0 only: LoRA merged on fsdp2): set "
                    "rollout.weight_sync_transport=object_store"
                )
            return False, None
        dtype = DTYPES[self.cfg.model.dtype]
        self._sync_bytes += sum(t.numel() for _, t in bucket) * dtype.itemsize
        return True, None if self._sharer is None else self._sharer.share(bucket, dtype)

    def release_shared(self) -> None:
        """Free this rank's shared buffers of the 'ipc' sync (the engines have loaded them, or it failed)."""
        if self._sharer is not None:
            self._sharer.release()
        self._sharing = None

    def sync_bytes(self) -> int:
        """Bytes of the last ``stream_weights`` or ``adapter_update`` payload (``sync/bytes``)."""
        return self._sync_bytes

    def collective_bytes(self) -> int:
        """Bytes the last ``stream_weights`` broadcast through the weight-sync group (``sync/bytes_collective``)."""
        return self._collective_bytes


class TrainerGroup(StrategyGroup):
    """The ranks of actor_train or reference; batches are split by rows across the data-parallel ranks:
    each rank, or with ``strategy.context_parallel`` each group of ranks that splits the sequences
    (its ranks get the same rows and return the same results; the first one's are kept)."""

    def __init__(self, role: str, cfg: RunConfig, *, trainable: bool) -> None:
        super().__init__(role, TrainerWorker, lambda rank: (role, rank, cfg, trainable), cfg)
        self.weights_version = 0  # counts optimizer steps and loads: an engine holding another is stale
        self.context_parallel = context_parallel_size(cfg, role)  # ranks a group, each the same rows
        self.stride = context_parallel_stride(cfg, role)  # how far apart a group's ranks are

    def _shards(self, batch: TrainBatch | PairBatch) -> list[Any]:
        """Each rank's share of ``batch``: a data-parallel rank's part, the same for a group's ranks."""
        n = self.context_parallel
        return data_shards(batch.split(self.world_size // n), n, self.stride)

    def _run(self, calls: list[Any], phase: str) -> list[Any]:
        """Every rank's result of ``calls`` (one per rank), one per data-parallel rank."""
        return group_leaders(self._wait(calls, phase), self.context_parallel, self.stride)

    def compute_logprobs(self, batch: TrainBatch, *, base_model: bool = False) -> torch.Tensor:
        """``(B, T)`` log-probs; ``base_model``: with the LoRA adapters disabled (the reference)."""
        shards = self._shards(batch)
        parts = self._run(
            [h.compute_logprobs.remote(s, base_model) for h, s in zip(self.handles, shards)],
            "compute_logprobs",
        )
        return TrainBatch.concat(parts, width=batch.input_ids.shape[1])

    def train(
        self, batch: TrainBatch | PairBatch, objective: Objective, phase: str = "train"
    ) -> dict[str, float]:
        """One optimizer step minimising ``objective`` on ``batch``, split over the ranks (pairs whole);
        ``train/tokens_per_s`` is the data-parallel ranks' sum (they train at the same time)."""
        shards = self._shards(batch)
        parts = self._run([h.train.remote(s, objective) for h, s in zip(self.handles, shards)], phase)
        self.weights_version += 1
        speed = sum(p.pop("train/tokens_per_s") for p in parts)
        return objective.combine(parts) | {"train/tokens_per_s": speed}

    def score_pairs(
        self, batch: PairBatch, *, average: bool = False, base_model: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(P,)`` scores of the chosen and the rejected responses: rewards (a reward model) or response
        log-probs (summed; ``average``: per token); ``base_model``: LoRA adapters disabled."""
        shards = self._shards(batch)
        parts = self._run(
            [h.score_pairs.remote(s, average, base_model) for h, s in zip(self.handles, shards)],
            "score_pairs",
        )
        return torch.cat([c for c, _ in parts]), torch.cat([r for _, r in parts])

    def load(self, directory: Path) -> None:
        super().load(directory)
        self.weights_version += 1

    def adapter_update(self) -> AdapterUpdate:
        """The LoRA adapters and their config, from rank 0 (every rank takes part in the gather)."""
        return self._wait([h.adapter_update.remote() for h in self.handles], "weight_sync")[0]

    def weight_buckets(self, bucket_mb: float, transport: str = "object_store") -> WeightBuckets:
        """Start every rank making its weight buckets (a sharded strategy gathers collectively) now,
        while the trainer holds its device; the buckets (or, with ``transport`` 'collective', their
        layouts) wait in Ray's object store until an engine loads them
        (``EngineGroup.load_weight_buckets``)."""
        return WeightBuckets(self, bucket_mb, transport)

    def begin_share(self, bucket_mb: float, senders: dict[int, int]) -> None:
        """Start an 'ipc' sync on every rank; ``senders``: the ranks that share, with their pool device
        (``reroll.config.placement.ipc_senders``)."""
        calls = [h.begin_share.remote(bucket_mb, senders.get(r)) for r, h in enumerate(self.handles)]
        self._wait(calls, "weight_sync")

    def share_next(self) -> dict[int, SharedBucket] | None:
        """The next bucket of an 'ipc' sync as ``{pool device: handle}``, or None after the last. Each
        rank first frees its buffers but the last: call it once the loads before that one are done."""
        parts = self._wait([h.share_next.remote() for h in self.handles], "weight_sync")
        if not parts[0][0]:
            return None
        return {shared.device: shared for _, shared in parts if shared is not None}

    def release_shared(self) -> None:
        """Free every rank's 'ipc' buffers. Like ``offload``, allowed whatever the residency."""
        self._wait([h.release_shared.remote() for h in self._handles], "weight_sync")

    def sync_bytes(self) -> int:
        """Bytes of rank 0's last weight-sync payload (full weights or adapters): ``sync/bytes``."""
        return self._wait([self.handles[0].sync_bytes.remote()], "weight_sync")[0]

    def collective_bytes(self) -> int:
        """Bytes rank 0's last sync broadcast through the weight-sync group: ``sync/bytes_collective``."""
        return self._wait([self.handles[0].collective_bytes.remote()], "weight_sync")[0]


class WeightBuckets:
    """A trainer's weights as buckets (``TrainerGroup.weight_buckets``): iterate to get rank 0's buckets
    in order (Ray references, or the buckets themselves with the local backend)."""

    def __init__(self, trainer: TrainerGroup, bucket_mb: float, transport: str = "object_store") -> None:
        self.trainer = trainer
        handles = trainer.handles
        self.local = isinstance(handles[0], LocalHandle)
        if self.local:  # run now, as a Ray actor would
            try:
                self.streams = [list(h.stream_weights.remote(bucket_mb, transport).value) for h in handles]
            except Exception as e:
                raise RoleError(trainer.role, 0, "weight_sync", f"{type(e).__name__}: {e}") from e
        else:
            self.streams = [
                h.stream_weights.options(num_returns="streaming").remote(bucket_mb, transport)
                for h in handles
            ]

    def __iter__(self) -> Iterator[Any]:
        if self.local:
            yield from self.streams[0]
            return
        yield from self._bounded(self.streams[0])
        for rank, stream in enumerate(self.streams[1:], start=1):  # they yield nothing; wait for the end
            try:
                self.trainer._wait(list(stream), "weight_sync")
            except RoleError as e:
                raise RoleError(self.trainer.role, rank, "weight_sync", e.cause) from e

    def _bounded(self, stream: Any) -> Iterator[Any]:
        """Rank 0's bucket references as they come, each within ``runtime.call_timeout_s`` (a trainer
        stuck making one raises ``RoleError``, as any call past its bound)."""
        import ray

        while True:
            ready, _ = ray.wait([stream], timeout=self.trainer.timeout_s)
            if not ready:
                cause = f"no weight bucket within {self.trainer.timeout_s:.0f} s (runtime.call_timeout_s)"
                raise RoleError(self.trainer.role, 0, "weight_sync", cause)
            try:
                ref = next(stream)
            except StopIteration:
                return
            yield ref

    def raise_if_failed(self, bucket: Any) -> None:
        """When loading ``bucket`` failed: if the trainer failed to make it, say so (not the engine)."""
        if self.local:
            return
        import ray
        from ray.exceptions import RayActorError

        try:
            ray.get(bucket, timeout=self.trainer.timeout_s)
        except Exception as e:
            died = isinstance(e, RayActorError)  # the trainer died making it: restart the trainer
            cause = f"{type(e).__name__}: {e}"
            raise RoleError(self.trainer.role, 0, "weight_sync", cause, died=died) from e

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every bucket loaded here, as one state dict (for checks; the engines take the buckets)."""
        if self.local:
            return dict(item for bucket in self for item in bucket)
        import ray

        return dict(item for ref in self for item in ray.get(ref, timeout=self.trainer.timeout_s))
