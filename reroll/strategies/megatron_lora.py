"""LoRA on the Megatron strategy's ``GPTModel``: adapters on its tensor-parallel linear layers, split as
the layers are, so that every rank merges its own shard and the weights leave in Hugging Face names as
before (``merged_state``).

Megatron fuses what Hugging Face keeps apart: ``linear_qkv`` holds q, k and v, ``linear_fc1`` the gate
and up projections. One adapter on a fused layer is one ``A`` for its input and one ``B`` for all its
outputs, so ``strategy.lora.target_modules`` names either all of a fused layer's parts or none of them
(``reroll.config.startable.megatron_targets``). Each adapted layer keeps its weight and gains two parameters:

- a column-parallel layer (``linear_qkv``, ``linear_fc1``: its outputs split over the TP ranks):
  ``lora_A`` ``(r, in)`` whole on every rank, ``lora_B`` ``(out / tp, r)`` split as the weight. The
  branch is ``B (copy_to_tp(A x))``: the copy's backward sums ``B``'s partial products over the TP
  ranks, so ``A``'s gradient and the input's are whole on every rank; under sequence parallelism the
  input is first gathered over the sequence (its backward keeps this rank's part of a gradient that is
  whole already);
- a row-parallel layer (``linear_proj``, ``linear_fc2``: its inputs split): ``lora_A`` ``(r, in / tp)``
  split as the weight, ``lora_B`` ``(out, r)`` whole. The branch is ``B (reduce_from_tp(A x))``, the
  ``r`` partial sums added over the TP ranks, then (sequence parallelism) cut to this rank's part of
  the sequence as the layer's own output is.

The split ones are marked tensor-parallel as the weights are, so the gradient norm counts each once.
``A`` is drawn as peft draws it (uniform in +-1/sqrt(in)), from a generator seeded by the layer's name:
every rank draws the whole matrix and keeps its part, so any layout starts from the same adapters and
trains as one rank does. ``B`` starts at zero: the model computes what it did without adapters.

For an adapters-only weight sync and a checkpoint's ``adapter/`` the adapters leave in peft's names
(``peft_adapters``); a checkpoint also holds the merged model and each rank's adapters with their Adam
state (``save``: resumed at the layout that wrote them).

Left out (refused by ``reroll.config.startable``): a mixture of experts' experts, Transformer Engine's
fused norm-and-linear layers (the local spec is used), adapter dropout (a TP group would need one mask).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import MethodType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from reroll.config.startable import megatron_targets
from reroll.errors import UserError

if TYPE_CHECKING:
    from reroll.config.training import LoRAConfig

COLUMN = ("linear_qkv", "linear_fc1")  # outputs split over the TP ranks; the others' inputs are
FILE = "lora_rank{rank}.pt"  # in a checkpoint: this rank's adapters and their optimizer state
_SEED = 1234


def add_adapters(chunks: Sequence[torch.nn.Module], lora: LoRAConfig, tp_rank: int, tp: int) -> int:
    """Adapters on the targeted layers of every model chunk (the module doc); every other parameter
    frozen. Returns the number of layers adapted on this rank."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    layers, problem = megatron_targets(lora.target_modules)
    if problem:
        raise ValueError(f"strategy.lora.target_modules: {problem}")
    scale = lora.alpha / lora.rank
    adapted = 0
    for chunk in chunks:
        chunk.requires_grad_(False)
        for name, module in chunk.named_modules():
            kind = name.rsplit(".", 1)[-1]
            if kind not in layers or ".experts." in name:
                continue
            column = kind in COLUMN
            out_local, in_local = module.weight.shape
            full_in = in_local if column else in_local * tp
            a = _draw_a(_global_name(chunk, name), lora.rank, full_in)
            if not column:
                a = a.chunk(tp, dim=1)[tp_rank]
            b = torch.zeros(out_local, lora.rank)
            like = module.weight
            module.lora_A = torch.nn.Parameter(a.to(like.device, like.dtype).contiguous())
            module.lora_B = torch.nn.Parameter(b.to(like.device, like.dtype))
            split = module.lora_B if column else module.lora_A
            set_tensor_model_parallel_attributes(split, True, 0 if column else 1, 1)
            module.lora_scale, module.lora_on = scale, True
            original = module.forward
            branch = _column_branch if column else _row_branch
            module.forward = MethodType(_adapted(original, branch), module)
            adapted += 1
    return adapted


def _layer_number(chunk: torch.nn.Module, name: str) -> int:
    """The decoder layer's number in the whole model (from 1, as every layout numbers it: its
    ``layer_number``) of the module ``name`` (``decoder.layers.{i}.self_attention.linear_qkv``, ``i``
    counted within the chunk)."""
    return chunk.decoder.layers[int(name.split(".")[2])].layer_number


def _global_name(chunk: torch.nn.Module, name: str) -> str:
    """``name`` with the decoder layer's number in the whole model in place of the chunk's index."""
    parts = name.split(".")
    parts[2] = str(_layer_number(chunk, name))
    return ".".join(parts)


def _draw_a(name: str, rank: int, fan_in: int) -> torch.Tensor:
    """``A`` as peft draws it (kaiming-uniform with a = sqrt(5): uniform in +-1/sqrt(fan_in)), from a
    generator seeded by the layer's name, the same on every rank and layout."""
    g = torch.Generator().manual_seed(_SEED + zlib.crc32(name.encode()))
    bound = 1 / math.sqrt(fan_in)
    return torch.empty(rank, fan_in).uniform_(-bound, bound, generator=g)


def _adapted(original: Any, branch: Any) -> Any:
    def forward(self: torch.nn.Module, input_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        output, bias = original(input_, *args, **kwargs)
        if self.lora_on:
            output = output + branch(self, input_)
        return output, bias

    return forward


def _column_branch(layer: Any, x: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    group = layer.tp_group
    if layer.sequence_parallel:  # this rank's part of the sequence: the layer gathers it as well
        x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=group)
    h = F.linear(x, layer.lora_A)
    if group is not None and group.size() > 1:
        h = copy_to_tensor_model_parallel_region(h, group=group)
    return F.linear(h, layer.lora_B) * layer.lora_scale


def _row_branch(layer: Any, x: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import (
        reduce_from_tensor_model_parallel_region,
        scatter_to_sequence_parallel_region,
    )

    group = layer.tp_group
    h = F.linear(x, layer.lora_A)
    if group is not None and group.size() > 1:
        h = reduce_from_tensor_model_parallel_region(h, group=group)
    y = F.linear(h, layer.lora_B) * layer.lora_scale
    if layer.sequence_parallel:  # the layer's output is this rank's part of the sequence
        y = scatter_to_sequence_parallel_region(y, group=group)
    return y


def _adapted_layers(chunks: Sequence[torch.nn.Module]) -> Iterator[torch.nn.Module]:
    for chunk in chunks:
        for module in chunk.modules():
            if hasattr(module, "lora_on"):
                yield module


@contextlib.contextmanager
def disabled(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """The base model: every adapter skipped (a LoRA run's reference policy)."""
    layers = list(_adapted_layers(chunks))
    for layer in layers:
        layer.lora_on = False
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_on = True


def is_adapter(key: str) -> bool:
    return key.endswith((".lora_A", ".lora_B"))


def merged_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state (a model chunk's), each adapted weight with ``scale * B @ A`` added (this
    rank's shard of it: both are split as the weight is) and the adapters left out: what the model
    without adapters would hold, for weight sync and export."""
    from reroll.strategies.lora import merged_weight

    state = {k: v.detach() for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
    for layer_name, layer in module.named_modules():
        if hasattr(layer, "lora_on"):
            key = f"{layer_name}.weight"
            state[key] = merged_weight(
                state[key], layer.lora_A.detach(), layer.lora_B.detach(), layer.lora_scale
            )
    return {k: v for k, v in state.items() if not is_adapter(k)}


def adapter_state(chunks: Sequence[torch.nn.Module]) -> list[dict[str, torch.Tensor]]:
    """This rank's adapters, per model chunk, on CPU."""
    return [
        {k: v.detach().cpu().clone() for k, v in chunk.state_dict().items() if is_adapter(k)}
        for chunk in chunks
    ]


def load_adapter_state(
    chunks: Sequence[torch.nn.Module], saved: Sequence[Mapping[str, torch.Tensor]]
) -> None:
    with torch.no_grad():
        for chunk, state in zip(chunks, saved, strict=True):
            params = dict(chunk.named_parameters())
            for key, value in state.items():
                params[key].copy_(value)


# a Megatron layer -> its module in a decoder layer and the Hugging Face layers it holds, in its order
_HF = {
    "linear_qkv": ("self_attention", "self_attn.", ("q_proj", "k_proj", "v_proj")),
    "linear_proj": ("self_attention", "self_attn.", ("o_proj",)),
    "linear_fc1": ("mlp", "mlp.", ("gate_proj", "up_proj")),
    "linear_fc2": ("mlp", "mlp.", ("down_proj",)),
}


def peft_adapters(s: Any) -> dict[str, torch.Tensor]:
    """The adapters in peft's saved names (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.
    weight``), on rank 0 (the others get ``{}``): a collective over every rank. Each layer's split half
    is gathered over its TP group and merged as the weight it sits on would be (``megatron_convert.
    merge``); a fused layer's adapter becomes one per part, each with the fused layer's A and its rows
    of B (what the one adapter computes for that part); rank 0 collects the stages' layers."""
    import torch.distributed as dist

    from reroll.models import megatron_convert as mc

    merged: dict[str, torch.Tensor] = {}
    for chunk in s.chunks:
        for name, layer in chunk.named_modules():
            if not hasattr(layer, "lora_on"):
                continue
            i, kind = _layer_number(chunk, name) - 1, name.rsplit(".", 1)[-1]
            a, b = layer.lora_A.detach(), layer.lora_B.detach()
            split, whole = (b, a) if kind in COLUMN else (a, b)
            shards = [split]
            if s.tp > 1:
                shards = [torch.empty_like(split) for _ in range(s.tp)]
                dist.all_gather(shards, split.contiguous(), group=s.tp_group)
            key = f"decoder.layers.{i}.{_HF[kind][0]}.{kind}.weight"
            full = mc.merge([{key: t.cpu()} for t in shards])[key]
            a, b = (whole.cpu(), full) if kind in COLUMN else (full, whole.cpu())
            merged |= _peft_names(i, kind, a, b, s.shape)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return merged
    from megatron.core import parallel_state as ps

    mine = merged if s.tp_rank == 0 and ps.get_data_parallel_rank() == 0 else {}
    got: list[Any] = [None] * dist.get_world_size() if s.rank == 0 else None  # type: ignore[assignment]
    dist.gather_object(mine, got, dst=0)
    return {k: v for part in got for k, v in part.items()} if s.rank == 0 else {}


def _peft_names(i: int, kind: str, a: torch.Tensor, b: torch.Tensor, shape: Any) -> dict[str, torch.Tensor]:
    from reroll.models import megatron_convert as mc
    from reroll.strategies.lora import PREFIX

    _, hf_module, names = _HF[kind]
    rows = mc.split_qkv(b, shape) if kind == "linear_qkv" else b.chunk(2) if kind == "linear_fc1" else (b,)
    head = f"{PREFIX}model.layers.{i}.{hf_module}"
    out = {}
    for part, b_part in zip(names, rows, strict=True):
        out[f"{head}{part}.lora_A.weight"] = a.clone()
        out[f"{head}{part}.lora_B.weight"] = b_part.contiguous().clone()
    return out


def layout(s: Any) -> dict[str, int]:
    """What decides which adapter slices and optimizer state a rank holds."""
    return {
        "world_size": s.world_size,
        "tensor_parallel": s.tp,
        "pipeline_parallel": s.pp,
        "virtual_pipeline": s.vp,
        "context_parallel": s.cp,
        "rank": s.rank,
    }


def save(s: Any, directory: Path, *, with_optimizer: bool) -> None:
    """This rank's adapters (and their optimizer state) into ``directory/lora_rank{r}.pt``."""
    from reroll.strategies.megatron_optimizer_state import rank_state

    state: dict[str, Any] = {"layout": layout(s), "adapters": adapter_state(s.chunks), "steps": s.steps}
    if with_optimizer and s.optimizer is not None:
        state |= rank_state(s)
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(state, directory / FILE.format(rank=s.rank))


def load(s: Any, directory: Path) -> None:
    """This rank's adapters (and optimizer state, where saved and ``s`` has an optimizer) from
    ``directory``, refused unless ``s`` has the layout that wrote them."""
    from reroll.strategies.megatron_optimizer_state import load_rank_state

    path = directory / FILE.format(rank=s.rank)
    saved = torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None
    if saved is None or saved["layout"] != layout(s):
        was = (
            saved["layout"]
            if saved is not None
            else f"{len(list(directory.glob(FILE.format(rank='*'))))} ranks"
        )
        raise UserError(
            f"{directory}: a Megatron LoRA checkpoint resumes at the layout that wrote it ({was}), and this "
            f"run has {layout(s)}: resume with the strategy.megatron sizes and roles.actor_train.world_size it "
            f"was saved with, or start a new run from its merged weights (model.path={directory}/model, "
            "fresh adapters)"
        )
    load_adapter_state(s.chunks, saved["adapters"])
    if s.optimizer is None:
        return
    s.optimizer.reload_model_params()  # main params from the loaded adapters
    if "optimizers" in saved:
        load_rank_state(s, saved)
    else:
        s.steps = saved["steps"]
