"""The Megatron strategy's optimizer state in the weights' layout-free form: ``<checkpoint>/optimizer/``.

Adam's moments (``exp_avg``, ``exp_avg_sq``) and, for a bf16 or fp16 model, the fp32 main parameters
are each a tensor per model parameter of that parameter's shape, so each is written as the weights are:
a Hugging Face model directory in fp32 (``optimizer/exp_avg/``, ``optimizer/exp_avg_sq/``,
``optimizer/main/``), streamed one decoder layer at a time by every rank, each writing its share of the
files (``reroll.strategies.megatron_weights.hf_weights`` gathers over TP, EP and the stages;
``reroll.strategies.hf_export.write_hf_model`` writes). Each rank reads back only the slices it holds
at its own layout through the converter that reads the weights (``megatron_convert.rank_from_hf`` over
a ``CheckpointReader``), so a checkpoint resumes at any tensor, pipeline, expert or data parallelism,
with or without the distributed optimizer, and no rank ever holds the whole state.

The distributed optimizer keeps each parameter's main copy and moments as flat ranges of the
parameter spread over its data-parallel ranks (``DistributedOptimizer._get_model_param_range_map``):
saving assembles a parameter's whole (this rank's TP/EP shard of it) when the writer asks for it, by a
sum over the data-parallel group of zero-padded ranges (exact: the ranges do not overlap), so a rank
holds one parameter's assembled state at a time beside the unit being written; loading cuts each rank's
range out of what it read. A mixture of experts' chained optimizers (dense, experts) are one map from
model parameter to its optimizer (``slots``). Where the model is fp32 the main parameters are the
weights (``model/``); a checkpoint without ``main/`` gives main parameters read from ``model/`` in fp32.

The scalars (Adam's step count, kept per parameter by torch's Adam and per group by the fused ones,
the strategy's warm-up step, an fp16 model's loss scale) are the same on every rank and layout:
``optimizer/state.json``, written by rank 0. Checkpoints written before this format hold
``optimizer_rank{r}.pt`` (this rank's torch optimizers' state) and resume at the layout that wrote
them only (``restorer`` refuses another world size or parallel layout before any weight is read).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from reroll.errors import UserError
from reroll.models.checkpoint_reader import CheckpointReader, checkpoint_files
from reroll.strategies import SavedAtOtherWorldSize

if TYPE_CHECKING:
    from reroll.strategies.megatron import MegatronStrategy

DIRECTORY = "optimizer"  # inside a checkpoint
STATE_FILE = "state.json"
MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's per-parameter tensors
MAIN = "main"  # fp32 main parameters (a bf16 / fp16 model's)
FORMAT = 1

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Slot:
    """Where one model parameter's optimizer state lives: its torch optimizer, its fp32 main parameter
    (None on a data-parallel rank of the distributed optimizer that holds none of it), and under the
    distributed optimizer the flat range ``[start, end)`` of the parameter that ``main`` is, and the
    data-parallel group its ranges are spread over (None: ``main`` is the whole parameter)."""

    inner: torch.optim.Optimizer
    main: torch.Tensor | None
    start: int = 0
    end: int = 0
    group: dist.ProcessGroup | None = None

    def state(self) -> dict[str, Any]:
        return self.inner.state[self.main] if self.main is not None else {}


def slots(optimizer: Any) -> dict[torch.Tensor, Slot]:
    """Each trainable model parameter's ``Slot`` in Megatron-Core's ``optimizer`` (a ``ChainedOptimizer``
    of a mixture of experts' dense and expert optimizers, a ``DistributedOptimizer``, a
    ``Float16OptimizerWithFloat16Params`` or an ``FP32Optimizer``), keyed by the parameter."""
    out: dict[torch.Tensor, Slot] = {}
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        if o is None or getattr(o, "is_stub_optimizer", False) or getattr(o, "optimizer", None) is None:
            continue
        inner = o.optimizer
        if hasattr(o, "model_param_group_index_map"):  # the distributed optimizer
            group = o.data_parallel_group
            for p in (p for b in o.buffers for p in b.params):
                out[p] = Slot(inner, None, group=group)
            for p, (gi, go) in o.model_param_group_index_map.items():
                r = o._get_model_param_range_map(p)["param"]
                out[p] = Slot(inner, inner.param_groups[gi]["params"][go], r.start, r.end, group)
        elif hasattr(o, "float16_groups"):  # main params are fp32 copies of bf16 / fp16 ones
            for models, mains in zip(o.float16_groups, o.fp32_from_float16_groups, strict=True):
                out |= {p: Slot(inner, m) for p, m in zip(models, mains, strict=True)}
            out |= {p: Slot(inner, p) for g in o.fp32_from_fp32_groups for p in g}
        else:  # fp32 parameters are their own main params
            out |= {p: Slot(inner, p) for g in inner.param_groups for p in g["params"]}
    return out


class ParamState(Mapping[str, torch.Tensor]):
    """One kind of optimizer state (``MOMENTS`` or ``MAIN``) of this rank's model shard, named as its
    ``GPTModel``'s state dict, in fp32: a tensor is assembled when asked for (over the data-parallel
    group under the distributed optimizer: a collective of that group's ranks, who ask in the same
    order). A name outside the optimizer (a frozen weight) reads as zeros."""

    def __init__(self, module: torch.nn.Module, by_param: dict[torch.Tensor, Slot], kind: str) -> None:
        self.params = {
            k: v for k, v in module.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")
        }
        self.by_param, self.kind = by_param, kind

    def __getitem__(self, name: str) -> torch.Tensor:
        p = self.params[name]
        slot = self.by_param.get(p)
        source = None if slot is None else slot.main if self.kind == MAIN else slot.state().get(self.kind)
        if slot is None or slot.group is None:
            whole = torch.zeros_like(p, dtype=torch.float32) if source is None else source.detach()
            return whole.float().view(p.shape)
        whole = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        if source is not None:
            whole[slot.start : slot.end] = source.detach().view(-1)
        dist.all_reduce(whole, group=slot.group)  # each rank's range, the others' zeros: exact
        return whole.view(p.shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)


def save_optimizer_state(s: MegatronStrategy, directory: Path) -> None:
    """``s``'s optimizer state into ``directory`` (see the module docstring). A collective."""
    directory.mkdir(parents=True, exist_ok=True)
    by_param = slots(s.optimizer)
    adam_step = _adam_step(by_param, s.device)
    kinds = [*MOMENTS] if adam_step else []  # before the first step Adam holds no moments
    if s.dtype != "float32":
        kinds.append(MAIN)
    for kind in kinds:
        _write(s, directory / kind, [ParamState(chunk, by_param, kind) for chunk in s.chunks])
    if s.rank == 0:
        scalers = [_scaler_state(o) for o in getattr(s.optimizer, "chained_optimizers", [s.optimizer])]
        state = {
            "format": FORMAT,
            "steps": s.steps,  # the warm-up schedule's
            "adam_step": adam_step,  # Adam's bias correction's
            "grad_scalers": scalers,
            "saved_at": {
                "world_size": s.world_size, "tensor_parallel": s.tp, "pipeline_parallel": s.pp,
                "virtual_pipeline": s.vp, "expert_parallel": s.ep, "context_parallel": s.cp,
                "data_parallel": s.dp,
                "distributed_optimizer": s.mcfg.distributed_optimizer, "dtype": s.dtype,
            },
        }  # fmt: skip
        (directory / STATE_FILE).write_text(json.dumps(state, indent=2))


def _write(s: MegatronStrategy, directory: Path, local: list[Mapping[str, torch.Tensor]]) -> None:
    """``local`` (one kind of state, this rank's shard of each model chunk) as an fp32 Hugging Face
    model directory, one
    decoder layer at a time, every rank writing its share (``MegatronStrategy.write_layers``, as the
    weights' export)."""
    s.write_layers(directory, s.meta_hf_model(torch.float32), s.hf_named(local, on_device=False))


def _adam_step(by_param: dict[torch.Tensor, Slot], device: torch.device) -> int:
    """How many steps Adam took: torch's counts them per parameter (``state["step"]``), Apex's and
    Transformer Engine's fused Adam per parameter group (``group["step"]``); all step together. The most
    over every rank (a rank of the distributed optimizer may hold no state); 0 before the first step.
    A collective."""
    here = 0.0
    for slot in by_param.values():
        for k, v in slot.state().items():
            if k not in (*MOMENTS, "step"):
                raise RuntimeError(f"megatron optimizer state {k!r} is neither Adam's moment nor its step")
            here = max(here, float(v)) if k == "step" else here
        here = max([here] + [float(g["step"]) for g in slot.inner.param_groups if "step" in g])
    most = torch.tensor([here], dtype=torch.float64, device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def _scaler_state(o: Any) -> dict[str, float] | None:
    """An fp16 model's dynamic loss scale (None: bf16 and fp32 have none)."""
    scaler = getattr(o, "grad_scaler", None)
    state = scaler.state_dict() if scaler is not None else {}
    return {k: float(v) for k, v in state.items()} or None


def restorer(
    s: MegatronStrategy,
    checkpoint: Path,
    shares: list[Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]],
) -> Callable[[], None] | None:
    """What restores ``s``'s optimizer state from ``checkpoint`` once its weights are loaded (None: the
    checkpoint holds none), checked now: a checkpoint ``s`` cannot resume from is refused here, before
    any weight is read. ``shares`` pick each model chunk's tensors out of a checkpoint's
    (``megatron_convert.rank_from_hf`` at ``s``'s layout)."""
    directory = checkpoint / DIRECTORY
    if directory.is_dir():
        state = json.loads((directory / STATE_FILE).read_text())
        if state.get("format") != FORMAT:
            raise UserError(
                f"{directory} holds optimizer state of format {state.get('format')}, which this reroll "
                f"cannot read (it reads format {FORMAT}): resume with the reroll that wrote it"
            )
        return partial(_load_optimizer_state, s, directory, state, checkpoint / "model", shares)
    if any(checkpoint.glob("optimizer_rank*.pt")):
        return partial(load_rank_state, s, _read_rank_file(s, checkpoint))
    return None


def _load_optimizer_state(
    s: MegatronStrategy,
    directory: Path,
    state: dict[str, Any],
    weights: Path,
    shares: list[Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]],
) -> None:
    """``s``'s optimizer state from ``directory`` (written by ``save_optimizer_state`` at any layout;
    ``state`` its ``state.json``), main parameters from ``directory/main`` or else from the ``weights``
    directory read in fp32 (an fp32 model's weights are its main parameters, loaded already). Sets
    ``s.steps``."""
    by_param = slots(s.optimizer)
    step = state["adam_step"]
    kinds = [(k, directory / k) for k in MOMENTS if step]
    if (directory / MAIN).is_dir():
        kinds.append((MAIN, directory / MAIN))
    elif s.dtype != "float32":  # saved in fp32: its weights are the main parameters
        kinds.append((MAIN, weights))
    log.info(
        "megatron: rank %d resumes the optimizer state saved at %s, at TP %d x PP %d (VP %d) x EP %d x DP %d",
        s.rank, state["saved_at"], s.tp, s.pp, s.vp, s.ep, s.dp,
    )  # fmt: skip
    for kind, path in kinds:
        for chunk, share in zip(s.chunks, shares, strict=True):
            _load_chunk(s, path, chunk, share, by_param, kind)
    if step:
        _set_step({id(slot.inner): slot.inner for slot in by_param.values()}.values(), by_param, step)
    chained = getattr(s.optimizer, "chained_optimizers", [s.optimizer])
    for o, saved in zip(chained, state["grad_scalers"], strict=False):
        scaler = getattr(o, "grad_scaler", None)
        if scaler is not None and saved:  # DynamicGradScaler's: a tensor and two counts
            counts = {k: int(v) for k, v in saved.items() if k != "scale"}
            scaler.load_state_dict({"scale": torch.tensor(saved["scale"]), **counts})
    s.steps = state["steps"]


def _load_chunk(
    s: MegatronStrategy,
    path: Path,
    chunk: torch.nn.Module,
    share: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]],
    by_param: dict[torch.Tensor, Slot],
    kind: str,
) -> None:
    """One kind of state of model chunk ``chunk`` (``share`` picks its tensors) from ``path``."""
    params = dict(chunk.state_dict(keep_vars=True))
    with CheckpointReader(checkpoint_files(path), torch.float32) as reader:
        try:
            ours = share(reader)
        except KeyError as e:
            raise UserError(
                f"{path} lacks {e}, which this model has: the checkpoint was written for another "
                f"model than model.path {s.model_path!r}; resume with the model it was trained from"
            ) from e
    for name, whole in ours.items():
        slot = by_param.get(params.get(name))
        if slot is not None and slot.main is not None:
            _put(slot, kind, whole)


def _set_step(inners: Iterable[torch.optim.Optimizer], by_param: dict[torch.Tensor, Slot], step: int) -> None:
    """Adam's step count, where each optimizer keeps it: torch's per parameter (a float32 scalar tensor,
    on the parameter's device where it is capturable or fused), Apex's and Transformer Engine's per
    parameter group."""
    for inner in inners:
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            for group in inner.param_groups:
                group["step"] = step
            continue
        on_device = inner.defaults.get("capturable") or inner.defaults.get("fused")
        for slot in by_param.values():
            if slot.inner is inner and slot.main is not None:
                device = slot.main.device if on_device else "cpu"
                slot.state()["step"] = torch.tensor(float(step), dtype=torch.float32, device=device)


def _put(slot: Slot, kind: str, whole: torch.Tensor) -> None:
    """This rank's part of ``whole`` (a parameter's state in this rank's TP/EP shard of its shape) into
    ``slot``: the main parameter copied into, a moment set."""
    assert slot.main is not None
    part = whole.reshape(-1)[slot.start : slot.end] if slot.group is not None else whole
    part = part.to(slot.main.device, slot.main.dtype).reshape(slot.main.shape)
    if kind == MAIN:
        with torch.no_grad():
            slot.main.copy_(part)
    else:
        slot.inner.state[slot.main][kind] = part.clone()


def _read_rank_file(s: MegatronStrategy, checkpoint: Path) -> dict[str, Any]:
    """This rank's ``optimizer_rank{r}.pt`` of a checkpoint written before ``optimizer/`` (its torch
    optimizers' state and fp32 main params), refused unless ``s`` has the layout that wrote it."""
    files = len(list(checkpoint.glob("optimizer_rank*.pt")))
    why = "a checkpoint of an earlier reroll, whose Megatron optimizer state is one file per rank"
    if files != s.world_size:
        raise SavedAtOtherWorldSize(checkpoint, files, s.world_size, why)
    state = torch.load(checkpoint / f"optimizer_rank{s.rank}.pt", map_location="cpu", weights_only=False)
    if "optimizer" in state:  # written before mixtures of experts: one optimizer
        state["optimizers"], state["main_params"] = [state["optimizer"]], [state["main_params"]]
    saved = [[tuple(p.shape) for p in m] for m in state["main_params"]]
    if saved != [[tuple(p.shape) for p in m] for m in _main_params(s.optimizer)]:
        raise UserError(
            f"{checkpoint}: {why}, and this rank's optimizer differs from the one that wrote it (another "
            f"tensor, pipeline or expert parallelism, or distributed_optimizer, at the same world size "
            f"{s.world_size}): resume it with the strategy.megatron settings it was saved with (its next "
            f"checkpoint resumes at any layout), or start a new run from its weights "
            f"(model.path={checkpoint}/model, a fresh optimizer)"
        )
    return state


def _main_params(optimizer: Any) -> list[list[torch.Tensor]]:
    """The main params of each torch optimizer inside Megatron's, as its param groups list them."""
    return [[p for g in inner.param_groups for p in g["params"]] for inner in _inners(optimizer)]


def _inners(optimizer: Any) -> list[torch.optim.Optimizer]:
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.optimizer for o in chained if o is not None and o.optimizer is not None]


def rank_state(s: MegatronStrategy) -> dict[str, Any]:
    """This rank's optimizer state as one file holds it (the form ``load_rank_state`` reads: each torch
    optimizer's state, its fp32 main params, the step count), on CPU: a LoRA checkpoint's
    (``reroll.strategies.megatron_lora``), and that of checkpoints from before ``optimizer/``."""
    return {
        "optimizers": [inner.state_dict() for inner in _inners(s.optimizer)],
        "main_params": [[p.detach().cpu().clone() for p in m] for m in _main_params(s.optimizer)],
        "steps": s.steps,
    }


def load_rank_state(s: MegatronStrategy, state: dict[str, Any]) -> None:
    """``rank_state``'s ``state`` (or ``_read_rank_file``'s) into ``s``'s optimizer. Sets ``s.steps``."""
    for inner, main, saved_state, saved_main in zip(
        _inners(s.optimizer),
        _main_params(s.optimizer),
        state["optimizers"],
        state["main_params"],
        strict=True,
    ):
        with torch.no_grad():
            for p, saved in zip(main, saved_main, strict=True):
                p.copy_(saved)
        inner.load_state_dict(saved_state)
    s.steps = state["steps"]
