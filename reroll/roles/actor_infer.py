"""actor_infer: workers that hold a generation engine, and their group (prompts split across ranks).

Every generation checks that the engine holds the policy actor_train holds (``EngineGroup.policy_version``,
set by the run): a call on stale weights is refused naming both versions, unless its caller (the
rollout source of an async run, which bounds staleness itself) passes ``stale_ok``.

Errors from these workers name the engine (``actor_infer[0] (vllm engine) failed during generate``).
Each worker has a second Ray thread ("control") so ``abort`` and ``interrupt`` reach an engine in the
middle of a call. ``EngineGroup.stream`` yields each prompt's group as it finishes (over-sampling);
``submit_resume`` continues, after a weight update, the responses an ``interrupt`` cut (partial rollouts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from reroll.config.engines import engine_spec
from reroll.config.placement import device_map, offload_between_phases, shares_device
from reroll.config.schema import RunConfig
from reroll.data.types import Completion, SamplingParams, TokenDelta
from reroll.engines import make_engine
from reroll.errors import RoleError
from reroll.roles.trainer import TrainerGroup, WeightBuckets
from reroll.runtime.actors import WorkerGroup, stream_items
from reroll.runtime.placement import configure_process, worker_device
from reroll.runtime.shared_buckets import SharedBucket, open_shared
from reroll.runtime.weight_sync import BroadcastGroup, BucketLayout, WeightBucket, unpack_bucket


class StaleWeights(RuntimeError):
    """A generation asked of an engine whose weights are older than actor_train's."""


class EngineWorker:
    """One rank of actor_infer."""

    def __init__(self, rank: int, cfg: RunConfig) -> None:
        configure_process(cfg, "actor_infer")
        self.rank, self.cfg = rank, cfg
        device = worker_device(cfg, "actor_infer")
        spec = engine_spec(cfg.rollout.engine)
        self.sleep_level = spec.sleep_level(cfg.rollout)
        # an engine whose sleep mode is CUDA's (vLLM) has none on CPU, where no device memory needs freeing
        self.sleeps = device != "cpu" or not spec.sleep_needs_cuda
        self.timeout_s = cfg.runtime.call_timeout_s
        self._weight_group: BroadcastGroup | None = None  # transport 'collective'
        # bytes of weights loaded by each transport: tensors through the object store, 'ipc', 'collective'
        self.loaded = {"object_store": 0, "ipc": 0, "collective": 0}
        self._devices: list[int] | None = None  # the pool devices of its workers (``_pool_devices``)
        # where another role takes this GPU in turn, the engine must be built able to sleep
        shared = device == "cuda" and shares_device(cfg, "actor_infer")
        self.engine = make_engine(
            cfg.model.path,
            cfg.rollout,
            dtype=cfg.model.dtype,
            device=device,
            shared_device=shared and offload_between_phases(cfg, cfg.placement.device_type),
            lora_targets=adapters.target_modules if (adapters := cfg.strategy.synced_adapters) else (),
        )

    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        return self.engine.generate(prompts, params)

    def stream(
        self, prompts: list[str] | list[list[int]], params: SamplingParams
    ) -> Iterator[tuple[int, list[Completion]]]:
        yield from self.engine.stream(prompts, params)

    def stream_tokens(
        self, prompts: list[str] | list[list[int]], params: SamplingParams
    ) -> Iterator[TokenDelta]:
        yield from self.engine.stream_tokens(prompts, params)

    def generate_first(
        self, prompts: list[str] | list[list[int]], params: SamplingParams, keep: int
    ) -> tuple[list[int], list[list[Completion]]]:
        """Over-sampling's round on the engine itself: every prompt's group in prompt order, and the
        indices of the first ``keep`` groups to finish whole, in the order they finished. Once those are
        in, the rest are interrupted and come back as they stand (cut responses marked ``abort``). Run
        here, a generation submitted ahead (``rollout.async_steps``) needs no driver to stop it. ``keep``
        0: nothing generated, an empty group per prompt."""
        if keep == 0:
            return [], [[] for _ in prompts]
        groups: list[list[Completion]] = [[] for _ in prompts]
        kept: list[int] = []
        for i, group in self.engine.stream(prompts, params):
            groups[i] = group
            if len(kept) < keep and all(c.finish_reason != "abort" for c in group):
                kept.append(i)
                if len(kept) == keep and keep < len(prompts):
                    self.engine.interrupt()
        return kept, groups

    def resume(self, groups: list[list[Completion]], params: SamplingParams) -> list[list[Completion]]:
        """``groups`` with every response an interrupt cut (``finish_reason == "abort"``) continued
        from its tokens with the engine's current weights, up to ``params.max_new_tokens`` in all."""
        cut = [
            (g, i)
            for g, group in enumerate(groups)
            for i, c in enumerate(group)
            if c.finish_reason == "abort"
        ]
        if not cut:
            return groups
        firsts = [groups[g][i] for g, i in cut]
        rows = [c.prompt_ids + c.response_ids for c in firsts]
        budgets = [params.max_new_tokens - len(c.response_ids) for c in firsts]
        more = self.engine.stream(rows, replace(params, n=1), budgets)
        out = [list(group) for group in groups]
        for k, extra in more:
            g, i = cut[k]
            out[g][i] = firsts[k].continued(extra[0])
        return out

    def join_weight_group(self, address: str, rank: int, world_size: int, backend: str) -> None:
        """Join the weight-sync group that actor_train rank 0 hosts at ``address`` (``collective``)."""
        if self._weight_group is not None:
            self._weight_group.close()
            self._weight_group = None
        self._weight_group = BroadcastGroup(address, rank, world_size, backend, self.timeout_s)

    def collective_bytes(self) -> int:
        """Bytes received through the weight-sync group since it was formed."""
        return 0 if self._weight_group is None else self._weight_group.bytes

    def load_weights(self, bucket: WeightBucket | BucketLayout) -> None:
        """One bucket: tensors (through the object store), or the ``BucketLayout`` of a buffer
        actor_train rank 0 broadcasts now through the weight-sync group (``collective``): received
        into a buffer of that size on the group's device, then loaded."""
        if isinstance(bucket, BucketLayout):
            if self._weight_group is None:
                raise RuntimeError("a 'collective' weight bucket before join_weight_group formed the group")
            flat = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self._weight_group.device)
            self._weight_group.broadcast(flat)
            self.engine.load_weights(unpack_bucket(flat, bucket.entries))
            self.loaded["collective"] += bucket.nbytes
            return
        self.engine.load_weights(bucket)
        self.loaded["object_store"] += sum(t.numel() * t.element_size() for _, t in bucket)

    def load_shared(self, shared: dict[int, SharedBucket]) -> None:
        """One bucket of an 'ipc' sync, ``{pool device: handle}`` from the trainer ranks: each of this
        engine's workers opens the one of its own device (``load_shared`` of an engine spanning several
        devices, e.g. vLLM's tensor-parallel workers; else opened here and given to ``load_weights``)."""
        devices = self._pool_devices()
        missing = [d for d in devices if d not in shared]
        if missing:
            raise RuntimeError(
                f"weight sync over ipc: no actor_train rank shared a bucket on pool device(s) {missing}, where "
                f"this engine's workers sit (shared: {sorted(shared)}); set rollout.weight_sync_transport="
                "object_store"
            )
        buckets = [shared[d] for d in devices]
        if hasattr(self.engine, "load_shared"):
            self.engine.load_shared(buckets)
        elif len(devices) == 1:
            with open_shared(buckets[0]) as weights:
                self.engine.load_weights(weights)
        else:
            raise RuntimeError(
                f"the {self.cfg.rollout.engine} engine spans {len(devices)} devices but has no load_shared(buckets) "
                "to hand each of its workers its own device's bucket: set rollout.weight_sync_transport="
                "object_store"
            )
        self.loaded["ipc"] += sum(b.layout.nbytes for b in buckets)

    def _pool_devices(self) -> list[int]:
        """The pool devices this engine's workers sit on, worker ``i`` on the ``i``-th."""
        if self._devices is None:
            dmap = device_map(self.cfg, self.cfg.placement.device_type)
            first = dmap.ranks["actor_infer"][self.rank]
            self._devices = list(range(first, first + dmap.span.get("actor_infer", 1)))
        return self._devices

    def loaded_bytes(self) -> dict[str, int]:
        """Bytes of weights loaded since the worker started, by transport."""
        return dict(self.loaded)

    def finish_weight_update(self) -> None:
        self.engine.finish_weight_update()

    def update_lora(self, adapter: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        self.engine.update_lora(adapter, config)

    def abort(self) -> None:
        self.engine.abort()

    def interrupt(self) -> None:
        self.engine.interrupt()

    def score(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        return self.engine.score(input_ids, attention_mask, temperature)

    def metrics(self) -> dict[str, float]:
        return self.engine.metrics()

    def offload(self) -> None:
        if self.sleeps:
            self.engine.sleep(self.sleep_level)

    def reload(self) -> None:
        if self.sleeps:
            self.engine.wake_up()

    def wake_weights(self) -> None:
        if self.sleeps:
            self.engine.wake_weights()


class EngineGroup(WorkerGroup):
    """All actor_infer ranks; prompts are dealt to ranks in contiguous blocks."""

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(
            "actor_infer", EngineWorker, lambda rank: (rank, cfg), cfg, concurrency_groups={"control": 1}
        )
        self.detail = f"{cfg.rollout.engine} engine"
        self.weights_version = 0  # the actor_train ``weights_version`` it holds (both start from model.path)
        # actor_train's current version (set by the run; None without a trainer, as in `reroll generate`)
        self.policy_version: Callable[[], int] | None = None

    def check_fresh(self, stale_ok: bool = False) -> None:
        """Refuse to generate with weights older than actor_train's (a pipeline that forgot a sync would
        train off-policy without a word), unless the caller allows it (``stale_ok``)."""
        if stale_ok or self.policy_version is None:
            return
        policy = self.policy_version()
        if policy != self.weights_version:
            raise StaleWeights(
                f"actor_infer holds policy version {self.weights_version} but actor_train is at version "
                f"{policy}: a generation on stale weights is refused. Sync first (Roles.sync_if_stale; "
                "the run does so before every step), or generate through the rollout source, which allows "
                "staleness within rollout.max_staleness"
            )

    def generate(
        self,
        prompts: Sequence[str] | Sequence[list[int]],
        params: SamplingParams,
        phase: str = "generate",
        *,
        stale_ok: bool = False,
    ) -> list[list[Completion]]:
        """``params.n`` completions per prompt (text, or token ids used as given), in prompt order."""
        return self.collect(self.submit(prompts, params, stale_ok=stale_ok), phase)

    def submit(
        self, prompts: Sequence[str] | Sequence[list[int]], params: SamplingParams, *, stale_ok: bool = False
    ) -> list[Any]:
        """Start ``generate`` on every rank and return at once (Ray references, for ``collect``). Each
        rank runs its calls in the order they were submitted, weight loads included."""
        self.check_fresh(stale_ok)
        return [h.generate.remote(part, params) for h, part in zip(self.handles, self._deal(prompts))]

    def collect(self, refs: Sequence[Any], phase: str = "generate") -> list[list[Completion]]:
        """The completions of a ``submit``, in prompt order (waits for them)."""
        return [group for part in self._wait(refs, phase) for group in part]

    def submit_first(
        self,
        prompts: Sequence[str] | Sequence[list[int]],
        params: SamplingParams,
        keep: int,
        *,
        stale_ok: bool = False,
    ) -> list[Any]:
        """``submit`` for over-sampling: each rank keeps the first groups of its block to finish, its share
        of ``keep`` (``shares``: in proportion to its block), and interrupts the rest
        (``EngineWorker.generate_first``). For ``collect_first``."""
        self.check_fresh(stale_ok)
        parts = self._deal(prompts)
        quotas = shares(keep, [len(p) for p in parts])
        return [h.generate_first.remote(p, params, q) for h, p, q in zip(self.handles, parts, quotas)]

    def collect_first(
        self, refs: Sequence[Any], phase: str = "generate"
    ) -> tuple[list[int], list[list[Completion]]]:
        """What a ``submit_first`` made: the kept groups' prompt indices (rank by rank, each in the order
        its groups finished) and every prompt's group in prompt order (waits for them)."""
        kept: list[int] = []
        groups: list[list[Completion]] = []
        for kept_here, part in self._wait(refs, phase):
            kept += [len(groups) + i for i in kept_here]
            groups += part
        return kept, groups

    def stream(
        self,
        prompts: Sequence[str] | Sequence[list[int]],
        params: SamplingParams,
        phase: str = "generate",
        *,
        stale_ok: bool = False,
    ) -> Iterator[tuple[int, list[Completion]]]:
        """``(prompt index, group)`` as each prompt's ``params.n`` completions finish, from every rank,
        in the order they arrive. ``interrupt()`` makes the ranks yield the rest as they stand."""
        self.check_fresh(stale_ok)
        parts = self._deal(prompts)
        offsets = [sum(map(len, parts[:r])) for r in range(len(parts))]
        calls = [
            h.stream.options(num_returns="streaming").remote(p, params) for h, p in zip(self.handles, parts)
        ]
        for rank, (i, group) in stream_items(
            calls, role=self.role, phase=phase, timeout_s=self.timeout_s, detail=self.detail
        ):
            yield offsets[rank] + i, group

    def stream_tokens(
        self, prompts: Sequence[str] | Sequence[list[int]], params: SamplingParams, phase: str = "generate"
    ) -> Iterator[TokenDelta]:
        """Each response's new tokens as the engines make them (``TokenDelta``, its ``prompt`` an index
        into ``prompts``), from every rank, in the order they arrive (engines whose spec has
        ``streams_tokens``: ``reroll serve``'s ``stream: true``)."""
        self.check_fresh()
        parts = self._deal(prompts)
        offsets = [sum(map(len, parts[:r])) for r in range(len(parts))]
        calls = [
            h.stream_tokens.options(num_returns="streaming").remote(p, params)
            for h, p in zip(self.handles, parts)
        ]
        for rank, delta in stream_items(
            calls, role=self.role, phase=phase, timeout_s=self.timeout_s, detail=self.detail
        ):
            yield replace(delta, prompt=offsets[rank] + delta.prompt)

    def submit_resume(self, refs: Sequence[Any], params: SamplingParams) -> list[Any]:
        """Queue, on every rank, the continuation of what ``refs`` (a ``submit`` or ``submit_resume``,
        one reference per rank, maybe cut by ``interrupt``) generated: the responses cut are continued
        with the weights the engine holds when the call runs (``EngineWorker.resume``)."""
        return [h.resume.remote(ref, params) for h, ref in zip(self.handles, refs)]

    def interrupt(self) -> None:
        """End every rank's ``generate``/``stream`` in flight at its next decoding step, keeping what
        it generated (responses not finished come back with ``finish_reason == "abort"``)."""
        self._wait(
            [h.interrupt.options(concurrency_group="control").remote() for h in self.handles], "interrupt"
        )

    def submit_weight_buckets(self, buckets: WeightBuckets | Iterable[WeightBucket]) -> list[Any]:
        """Queue ``load_weight_buckets``' calls on every rank without waiting for them (behind any
        ``generate`` submitted before): the references, to pass to ``wait_loaded``. Iterating waits
        only for the trainer to make each bucket. Object-store buckets only."""
        refs = [h.load_weights.remote(bucket) for bucket in buckets for h in self.handles]
        return refs + [h.finish_weight_update.remote() for h in self.handles]

    def submit_shared(self, shared: dict[int, SharedBucket]) -> list[Any]:
        """Start every rank loading one bucket of an 'ipc' sync (``{pool device: handle}``, the whole
        map to each: its workers pick their own devices'): the references, for ``wait_loaded``."""
        return [h.load_shared.remote(shared) for h in self.handles]

    def wait_loaded(self, refs: Sequence[Any]) -> None:
        """Wait for the weight loads ``submit_weight_buckets`` or ``submit_shared`` started (a failure
        names weight_sync)."""
        self._wait(refs, "weight_sync")

    def finish_weight_update(self) -> None:
        """Every rank drops what its old weights computed (prefix cache) after the last bucket."""
        self._wait([h.finish_weight_update.remote() for h in self.handles], "weight_sync")

    def loaded_bytes(self) -> list[dict[str, int]]:
        """Each rank's bytes of weights loaded since it started, by transport."""
        return self._wait([h.loaded_bytes.remote() for h in self.handles], "weight_sync")

    def load_weight_buckets(self, buckets: WeightBuckets | Iterable[WeightBucket]) -> None:
        """Load ``TrainerGroup.weight_buckets(...)`` into every rank, one bucket (``rollout.weight_sync_bucket_mb``,
        whole layers) at a time, so an engine's extra memory is one bucket; then each engine drops its
        prefix cache."""
        for bucket in buckets:
            try:
                self._wait([h.load_weights.remote(bucket) for h in self.handles], "weight_sync")
            except RoleError:
                if isinstance(buckets, WeightBuckets):  # the trainer may have failed to make it
                    buckets.raise_if_failed(bucket)
                raise
        self.finish_weight_update()

    def collective_bytes(self) -> list[int]:
        """Bytes each rank has received through the weight-sync group since it was formed."""
        return self._wait([h.collective_bytes.remote() for h in self.handles], "weight_sync")

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
        self._wait([h.offload.remote() for h in self._handles], "sleep")

    def reload(self) -> None:
        self._wait([h.reload.remote() for h in self._handles], "wake_up")

    def wake_weights(self) -> None:
        """Asleep: every rank's weights back on its GPU, the KV caches still asleep (``reload`` wakes them)."""
        self._wait([h.wake_weights.remote() for h in self._handles], "wake_up")

    def metrics(self, *, now: bool = False) -> dict[str, float]:
        """Each rank's ``engine/*`` metrics summed (throughput, requests), the KV-cache usage averaged.
        ``now``: on the control thread, without waiting for a ``generate`` in flight or queued."""
        method = lambda h: h.metrics.options(concurrency_group="control") if now else h.metrics  # noqa: E731
        parts = self._wait([method(h).remote() for h in self.handles], "metrics")
        return {
            k: sum(p[k] for p in parts) / (len(parts) if k == "engine/kv_cache_usage" else 1)
            for k in parts[0]
        }


def form_weight_group(actor: TrainerGroup, rollout: EngineGroup, backend: str) -> None:
    """The weight-sync group of the ``collective`` transport: actor_train rank 0 (the source, which
    hosts the rendezvous on a free port of its node) and every actor_infer rank, joined at once
    (``backend`` 'nccl' on GPUs, 'gloo' on CPUs). Formed again after either role restarts."""
    [address] = actor._wait([actor.handles[0].rendezvous_address.remote()], "weight_group")
    world = rollout.world_size + 1
    source = actor.handles[0].join_weight_group.remote(address, world, backend)
    engines = [
        h.join_weight_group.remote(address, rank + 1, world, backend)
        for rank, h in enumerate(rollout.handles)
    ]
    rollout._wait(engines, "weight_group")
    actor._wait([source], "weight_group")


def shares(keep: int, sizes: list[int]) -> list[int]:
    """``keep`` split over blocks of ``sizes`` items in proportion to them (largest remainders first), so
    that no block's share exceeds its size (``keep`` at most their sum)."""
    total = sum(sizes)
    exact = [keep * s / total if total else 0.0 for s in sizes]
    out = [int(e) for e in exact]
    by_remainder = sorted(range(len(sizes)), key=lambda r: exact[r] - out[r], reverse=True)
    for r in by_remainder[: keep - sum(out)]:
        out[r] += 1
    return out
