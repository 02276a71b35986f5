"""actor_infer: workers that hold a generation engine, and their group (prompts split across ranks).

Errors from these workers name the engine (``actor_infer[0] (vllm engine) failed during generate``).
Each worker has a second Ray thread ("control") so ``abort`` reaches an engine in the middle of a call.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from reroll.config.schema import RunConfig
from reroll.data.types import Completion, SamplingParams
from reroll.engines import make_engine
from reroll.errors import RoleError
from reroll.runtime.actors import LocalHandle, WorkerGroup, _Ready
from reroll.runtime.placement import worker_device


class RolloutWorker:
    """One rank of actor_infer."""

    def __init__(self, rank: int, cfg: RunConfig) -> None:
        rc = cfg.roles.actor_infer
        torch.set_num_threads(rc.torch_threads or torch.get_num_threads())
        self.rank = rank
        device = worker_device(cfg, "actor_infer")
        self.engine = make_engine(
            cfg.rollout.engine, cfg.model.path, cfg.rollout, dtype=cfg.model.dtype, device=device
        )

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        return self.engine.generate(prompts, params)

    def update_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.engine.update_weights(weights)

    def load_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        self.engine.load_weights(bucket)

    def finish_weight_update(self) -> None:
        self.engine.finish_weight_update()

    def update_lora(self, adapter: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        self.engine.update_lora(adapter, config)

    def abort(self) -> None:
        self.engine.abort()

    def score(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        return self.engine.score(input_ids, attention_mask, temperature)

    def metrics(self) -> dict[str, float]:
        return self.engine.metrics()

    def offload(self) -> None:
        self.engine.sleep()

    def reload(self) -> None:
        self.engine.wake_up()


class RolloutGroup(WorkerGroup):
    """All actor_infer ranks; prompts are dealt to ranks in contiguous blocks."""

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(
            "actor_infer", RolloutWorker, lambda rank: (rank, cfg), cfg, concurrency_groups={"control": 1}
        )
        self.detail = f"{cfg.rollout.engine} engine"
        self.bucket_mb = cfg.rollout.weight_sync_bucket_mb

    def generate(
        self, prompts: Sequence[str], params: SamplingParams, phase: str = "generate"
    ) -> list[list[Completion]]:
        """``params.n`` completions per prompt, in prompt order."""
        refs = [h.generate.remote(part, params) for h, part in zip(self.handles, self._deal(prompts))]
        return [group for part in self._wait(refs, phase) for group in part]

    def update_weights(self, weights_ref: Any) -> None:
        """Load weights on every rank; ``weights_ref`` is a Ray reference (or a local result)."""
        if isinstance(weights_ref, _Ready):
            if weights_ref.error is not None:
                raise weights_ref.error
            weights_ref = weights_ref.value
        self._wait([h.update_weights.remote(weights_ref) for h in self.handles], "weight_sync")

    def sync_weights(self, trainer: WorkerGroup) -> None:
        """``trainer`` rank 0's weights into every rank, one bucket at a time (see ``load_weight_buckets``)."""
        self.load_weight_buckets(weight_buckets(trainer, self.bucket_mb))

    def load_weight_buckets(self, buckets: WeightBuckets) -> None:
        """Load ``weight_buckets(trainer, ...)`` into every rank, one bucket (``rollout.weight_sync_bucket_mb``,
        whole layers) at a time, so an engine's extra memory is one bucket; then each engine drops its
        prefix cache."""
        for bucket in buckets:
            try:
                self._wait([h.load_weights.remote(bucket) for h in self.handles], "weight_sync")
            except RoleError as e:
                buckets.raise_if_failed(bucket)
                raise e
        self._wait([h.finish_weight_update.remote() for h in self.handles], "weight_sync")

    def update_lora(self, adapter: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
        """A peft adapter (peft's names, ``LoraConfig`` as a dict) merged into every rank's base weights."""
        adapter, config = dict(adapter), dict(config)
        self._wait([h.update_lora.remote(adapter, config) for h in self.handles], "lora_sync")

    def abort(self) -> None:
        """Stop every rank's in-flight ``generate`` (call it from another thread): that call raises a
        ``RoleError`` whose cause is ``EngineAborted``."""
        self._wait([h.abort.options(concurrency_group="control").remote() for h in self.handles], "abort")

    def score(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        """Rank 0's log-probs for given sequences (to check that the engine holds the trainer's weights)."""
        [out] = self._wait([self.handles[0].score.remote(input_ids, attention_mask, temperature)], "score")
        return out

    def offload(self) -> None:
        """Free the engine's device memory (weights and KV cache) while a colocated role runs."""
        self._wait([h.offload.remote() for h in self.handles], "sleep")

    def reload(self) -> None:
        self._wait([h.reload.remote() for h in self.handles], "wake_up")

    def metrics(self) -> dict[str, float]:
        """Each rank's ``engine/*`` metrics summed (throughput, requests), the KV-cache usage averaged."""
        parts = self._wait([h.metrics.remote() for h in self.handles], "metrics")
        return {
            k: sum(p[k] for p in parts) / (len(parts) if k == "engine/kv_cache_usage" else 1)
            for k in parts[0]
        }


class WeightBuckets:
    """A trainer's weights as buckets, started by ``weight_buckets``: iterate to get rank 0's buckets in
    order (Ray references, or the buckets themselves with the local backend)."""

    def __init__(self, trainer: WorkerGroup, bucket_mb: float) -> None:
        self.trainer = trainer
        self.local = isinstance(trainer.handles[0], LocalHandle)
        if self.local:  # run now, as a Ray actor would
            try:
                self.streams = [list(h.weight_buckets.remote(bucket_mb).value) for h in trainer.handles]
            except Exception as e:
                raise RoleError(trainer.role, 0, "weight_sync", f"{type(e).__name__}: {e}") from e
        else:
            self.streams = [
                h.weight_buckets.options(num_returns="streaming").remote(bucket_mb) for h in trainer.handles
            ]

    def __iter__(self) -> Iterator[Any]:
        yield from self.streams[0]
        if self.local:
            return
        for rank, stream in enumerate(self.streams[1:], start=1):  # they yield nothing; wait for the end
            try:
                self.trainer._wait(list(stream), "weight_sync")
            except RoleError as e:
                raise RoleError(self.trainer.role, rank, "weight_sync", e.cause) from e

    def raise_if_failed(self, bucket: Any) -> None:
        """When loading ``bucket`` failed: if the trainer failed to make it, say so (not the engine)."""
        if self.local:
            return
        import ray

        try:
            ray.get(bucket, timeout=self.trainer.timeout_s)
        except Exception as e:
            raise RoleError(self.trainer.role, 0, "weight_sync", f"{type(e).__name__}: {e}") from e


def weight_buckets(trainer: WorkerGroup, bucket_mb: float) -> WeightBuckets:
    """Start every ``trainer`` rank making its weight buckets (a sharded strategy gathers collectively)
    now, while the trainer holds its device; the buckets wait in Ray's object store until an engine
    loads them (``RolloutGroup.load_weight_buckets``), so the trainer may be offloaded in between."""
    return WeightBuckets(trainer, bucket_mb)
