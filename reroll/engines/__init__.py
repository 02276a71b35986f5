"""Generation engines behind one interface (``base.Engine``): hf, vllm, sglang, or one of your own.

``make_engine`` is the one place a config's ``rollout.engine`` becomes an engine; what each engine can
do is its spec (``reroll.config.engines``). Each engine module imports its backend (vllm, sglang) only
when the engine is built, so ``import reroll`` works without either installed.
"""

from __future__ import annotations

from collections.abc import Sequence

from reroll.config.engines import AUTO, ENGINES, engine_class, engine_spec
from reroll.config.rollout import RolloutConfig
from reroll.engines.base import Engine
from reroll.errors import UserError
from reroll.packages import importable


def engine_available(name: str) -> bool:
    """Whether ``name``'s backend package can be imported here (an engine class of one's own: its module;
    'auto' always: it falls back to hf where vLLM is missing)."""
    if name == AUTO:
        return True
    if name not in ENGINES:
        return importable(name.partition(":")[0])
    package = ENGINES[name].package
    return package is None or importable(package)


def engine_missing(name: str) -> str | None:
    """Why engine ``name`` cannot be built here (its backend package is not installed), with the
    install line; None when it can."""
    if engine_available(name):
        return None
    spec = engine_spec(name)
    return (
        f"rollout.engine is {name!r} but the '{spec.package}' package is not installed here: "
        f"{spec.install}, or set rollout.engine=hf"
    )


def make_engine(
    model_path: str,
    rollout: RolloutConfig,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    shared_device: bool = False,
    lora_targets: Sequence[str] = (),
) -> Engine:
    """The engine ``rollout.engine`` names, loaded from ``model_path``. ``shared_device``: another role
    takes the engine's GPU in turn, so it is built able to sleep where that is a choice (vLLM's
    ``enable_sleep_mode`` left unset). ``lora_targets``: the modules whose LoRA adapters will reach the
    engine (``update_lora``); the vllm and sglang engines, which merge them into the checkpoint's base
    weights, start reading those at once (the hf engine keeps its own weights as the base).

    A backend that is not installed is a ``UserError`` saying what to install.
    """
    name = rollout.engine
    missing = engine_missing(name)
    if missing:
        raise UserError(missing)
    if name == "hf":
        from reroll.engines.hf import HFEngine

        return HFEngine(
            model_path,
            dtype=dtype,
            device=device,
            batch_size=rollout.generate_batch_size,
            static_cache=rollout.hf_static_cache,
            images=rollout.images,
        )
    if name == "vllm":
        from reroll.engines.vllm import VLLMEngine

        vllm = rollout.vllm
        if vllm.enable_sleep_mode is None:  # auto: able to sleep where another role takes the GPU in turn
            vllm = vllm.model_copy(update={"enable_sleep_mode": shared_device})
        keep_cut = rollout.partial_rollouts or rollout.oversample is not None
        return VLLMEngine(
            model_path,
            vllm,
            dtype=dtype,
            device=device,
            keep_cut=keep_cut,
            images=rollout.images,
            lora_targets=lora_targets,
        )
    if name == "sglang":
        from reroll.engines.sglang import SGLangEngine

        return SGLangEngine(model_path, dtype=dtype, lora_targets=lora_targets)
    return engine_class(name)(model_path, rollout, dtype=dtype, device=device)
