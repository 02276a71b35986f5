"""FSDP2: parameters, gradients and optimizer state sharded over the role's ranks (``fully_shard``).

Each decoder layer is one FSDP unit, the root (embeddings, final norm, head) another; a unit's
parameters are all-gathered for its forward and backward and its gradients reduce-scattered after.
Losses arrive normalised by the whole step's token/sequence counts (all micro-batches, all ranks), so
gradients are *summed* over ranks: the divide factor FSDP2 would apply (the world size) is set to 1.
One rank still builds a process group (in-process), so the same code runs at every world size.

The model is built on the meta device, changed as a loaded one would be (kernels, checkpointing, LoRA),
sharded, and then each rank reads its own rows of every weight from the checkpoint's safetensors files
(``reroll.strategies.shard_fill``, following transformers' renames and expert fusion, so a
vision-language model's towers too): a rank's host holds its shards (on a GPU, one tensor's at a time),
not the whole model. A checkpoint without safetensors files, or one whose tensors the plan cannot place
(a conversion it does not follow), is loaded whole on every rank's host as before (a log line says why).

With ``strategy.lora`` the policy is wrapped with peft before sharding and only the adapters train;
``full_state_dict`` then gives the base weights with the adapters merged in (Hugging Face names), and
``adapter_update`` the adapters alone. A checkpoint holds ``state/`` (every rank's shards of the
weights and optimizer in torch's distributed checkpoint format, which any world size resumes:
``sharded_state``), ``model/`` (Hugging Face, merged where LoRA is on, so it loads anywhere; written
by every rank one decoder layer at a time: ``hf_export``) and with LoRA ``adapter/`` (peft's format).
A checkpoint from before ``state/`` (``model/`` and ``optimizer_rank{r}.pt``, this rank's shard)
resumes at the world size it was saved at.

With ``context_parallel`` n > 1 (``strategy.context_parallel``) the ranks form groups of n that split
every sequence between them (Ulysses: ``reroll.strategies.context_parallel``); the model stays sharded
over all ranks, and gradients are summed over all of them as without.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from reroll.config.vision import CONTEXT_PARALLEL_REFUSED
from reroll.data.types import ImageInputs
from reroll.errors import UserError
from reroll.models.checkpoint_reader import CheckpointReader, checkpoint_files
from reroll.models.loading import (
    DTYPES,
    load_causal_lm,
    load_sequence_classifier,
    load_value_model,
    use_kernels,
)
from reroll.strategies import Head, SavedAtOtherWorldSize
from reroll.strategies.context_parallel import ContextParallel, group_ranks
from reroll.strategies.hf_export import (
    HFNames,
    decoder_layers,
    distinct_state,
    full_weights,
    layer_units,
    write_hf_model,
)
from reroll.strategies.host_parking import HostParking
from reroll.strategies.lora import (
    AdapterUpdate,
    adapter_names_to_saved,
    apply_lora,
    full_modules,
    load_adapter,
    lora_config_dict,
    merged_state_dict,
    save_adapter,
    trained_key,
)
from reroll.strategies.micro_batches import MicroBatchLoop
from reroll.strategies.shard_fill import Target, adapters_on_host, fill, meta_parameters, plan
from reroll.strategies.sharded_state import load_state, save_state
from reroll.strategies.training import (
    adamw_with_warmup,
    adapters_disabled,
    checkpoint_first_layers,
    forward_logits,
    optimizer_step,
    set_trainable,
    start_checkpointing,
)

if TYPE_CHECKING:
    from reroll.config.schema import RunConfig

log = logging.getLogger(__name__)

_LOADERS = {"causal_lm": load_causal_lm, "value": load_value_model, "reward": load_sequence_classifier}


class FSDP2Strategy(MicroBatchLoop):
    """The model sharded with FSDP2, its optimizer and schedule; the role decides the loss.

    ``head``: ``"causal_lm"`` (the policy, ``(B, T, V)`` logits) or ``"value"`` (a critic, ``(B, T, 1)``).
    LoRA (``strategy.lora``) applies to the policy and to a reward model (its ``score`` head trains in full).
    """

    fused_head = True  # the head's call is inside its FSDP unit's forward, where its weight is gathered

    def __init__(
        self,
        model_path: str,
        *,
        cfg: RunConfig,
        device: str = "cpu",
        trainable: bool = True,
        rank: int = 0,
        world_size: int = 1,
        head: Head = "causal_lm",
        context_parallel: int = 1,
    ) -> None:
        self.device = torch.device(device)
        self.rank, self.world_size = rank, world_size
        group_ranks(world_size, context_parallel)  # a ValueError now, not a hang at the first collective
        self.cp_size = context_parallel
        self.context_parallel: ContextParallel | None = None  # this rank's group, once joined
        self.settings = cfg.strategy.fsdp2
        self.lora = cfg.strategy.lora if head in ("causal_lm", "reward") else None
        self.full = full_modules(head)  # trained in full beside the adapters
        self._load = _LOADERS[head]
        model, self._unfilled = _start_model(
            self._load, model_path, cfg.model.dtype, zero_missing=head != "causal_lm"
        )
        self.checkpoint_bytes_read: int | None = None  # where this rank read its shards: how many bytes
        use_kernels(model, cfg, self.device)
        set_trainable(model, cfg, trainable)
        if getattr(model.config, "use_cache", None) is not None:
            model.config.use_cache = False
        start_checkpointing(model, cfg.model.gradient_checkpointing, trainable)  # before fully_shard
        self.hf_model = model  # the Hugging Face model inside any peft wrapper
        with adapters_on_host() if self._unfilled else contextlib.nullcontext():  # their values stay
            self.model: torch.nn.Module = (
                apply_lora(model, self.lora, trainable=trainable, full=self.full) if self.lora else model
            )
        if self._unfilled is not None:
            self._unfilled.check(self.model)
        self.optimizer: torch.optim.Optimizer | None = None
        self._parked = HostParking()  # the state's host memory while a colocated role has the GPU
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.mesh = None
        if world_size == 1:
            self.init_distributed("")

    def init_distributed(self, address: str) -> None:
        """Join the role's process group at ``tcp://address`` (one rank: an in-process group), then shard."""
        if self.mesh is not None:
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            if self.world_size == 1:
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            else:
                dist.init_process_group(
                    backend, init_method=f"tcp://{address}", rank=self.rank, world_size=self.world_size
                )
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(
                f"this process is already in a process group of {dist.get_world_size()} ranks, but the role "
                f"has {self.world_size}: run each role's ranks in their own processes (runtime.backend=ray)"
            )
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
        self.mesh = dist.device_mesh.init_device_mesh(self.device.type, (self.world_size,))
        if self.cp_size > 1:
            self._join_context_parallel()
        self._shard()
        if self._unfilled is not None:  # built on the meta device: each rank reads its shards
            with self._unfilled.reader as reader:
                fill(self.model, self._unfilled.targets, reader, self._home())
                self.checkpoint_bytes_read = reader.read_bytes
            self._unfilled = None
            log.info(
                "rank %d: read %.3f GB of the checkpoint, its shards",
                self.rank,
                self.checkpoint_bytes_read / 1e9,
            )

    def _join_context_parallel(self) -> None:
        """Form the context-parallel groups (every rank creates each, in the same order) and switch the
        model's attention to Ulysses' over this rank's group."""
        from reroll.models.ulysses import use_ulysses

        for ranks in group_ranks(self.world_size, self.cp_size):
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = ContextParallel(group, ranks.index(self.rank), self.cp_size)
        self.context_parallel = mine
        name = use_ulysses(self.hf_model, mine.group)
        log.info(
            "rank %d: context parallel, rank %d of a group of %d (attention %s)",
            self.rank, mine.rank, self.cp_size, name,
        )  # fmt: skip

    def _shard(self) -> None:
        """``fully_shard`` each decoder layer, then the root; gradients summed (divide factor 1)."""
        s = self.settings
        kwargs: dict[str, Any] = {
            "mesh": self.mesh,
            "reshard_after_forward": s.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=DTYPES[s.param_dtype] if s.param_dtype else None,
                reduce_dtype=DTYPES[s.reduce_dtype],
            ),
        }
        if s.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        layers = decoder_layers(self.hf_model)
        if not layers:
            log.warning("%s: no decoder layers found; the whole model is one FSDP unit", type(self.hf_model))
        for layer in layers:
            fully_shard(layer, **kwargs)
        fully_shard(self.model, **kwargs)
        for m in self.model.modules():
            if isinstance(m, FSDPModule):  # SUM with no division (gloo has no PREMUL_SUM)
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)

    def configure_optimizer(
        self, *, lr: float, betas: tuple[float, float], weight_decay: float, warmup_steps: int
    ) -> None:
        """A fresh AdamW over this rank's shards of the trainable parameters; linear warm-up, then constant."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = adamw_with_warmup(
            params, lr=lr, betas=betas, weight_decay=weight_decay, warmup_steps=warmup_steps
        )

    def logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        images: ImageInputs | None = None,
    ) -> torch.Tensor:
        """``(B, T, V)`` logits or a critic's ``(B, T, 1)``; a collective: every rank calls it equally often.
        With context parallelism, every rank of a group passes the same rows and gets its columns' part of
        the output (``ContextParallel.forward``)."""
        if self.context_parallel is not None:
            if images is not None:
                raise UserError(CONTEXT_PARALLEL_REFUSED)
            return self.context_parallel.forward(
                self.model, self.device, input_ids, attention_mask, position_ids
            )
        return forward_logits(self.model, self.device, input_ids, attention_mask, position_ids, images)

    def checkpoint_layers(self, count: int) -> None:
        """Recompute the first ``count`` decoder layers in backward from now on (``checkpoint_first_layers``;
        'auto''s count, which the worker chooses)."""
        checkpoint_first_layers(self.hf_model, count)

    def adapters_disabled(self) -> contextlib.AbstractContextManager[None]:
        """The base model inside: forward passes skip the LoRA adapters (the reference policy)."""
        return adapters_disabled(self.model, self.lora)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, grad_clip: float) -> dict[str, float]:
        """Clip the global norm of the (already summed, sharded) gradients and step.

        Returns ``grad_norm`` (before clipping), ``lr`` and ``peak_memory_gb`` (``memory.peak_memory_gb``).
        """
        assert self.optimizer is not None and self.scheduler is not None, "configure_optimizer first"
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        return optimizer_step(self.optimizer, self.scheduler, grad_norm, self.device)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight, unsharded, on CPU, in Hugging Face names (LoRA: merged into the base weights).

        A collective: every rank must call it; rank 0 gets the weights, the others an empty dict (so a
        node holds one full copy, not one per rank)."""
        state = _gather(self.model.state_dict(), keep=self.rank == 0)
        if self.lora is None:
            return state
        return merged_state_dict(state, scale=self.lora.alpha / self.lora.rank)

    def named_weights(self, *, on_device: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights one at a time, unsharded, in Hugging Face names: on the device (``on_device``)
        or as CPU copies. A collective (each DTensor is all-gathered in turn): every rank iterates to
        the end. With LoRA, the base weights with the adapters merged in, a decoder layer at a time,
        merged on the device (``full_weights``)."""

        def whole(value: torch.Tensor) -> torch.Tensor:
            return (value.full_tensor() if isinstance(value, DTensor) else value).detach()

        scale = self.lora.alpha / self.lora.rank if self.lora is not None else None
        return full_weights(self.model, self.hf_model, scale, whole, on_device=on_device)

    def adapter_update(self) -> AdapterUpdate:
        """The adapters alone (peft's saved names) and their ``LoraConfig``; a collective, like
        ``full_state_dict`` (the tensors on rank 0 only)."""
        if self.lora is None:
            raise RuntimeError("adapter_update needs strategy.lora")
        state = {k: v for k, v in self.model.state_dict().items() if trained_key(k, self.full)}
        adapters = adapter_names_to_saved(_gather(state, keep=self.rank == 0))
        return AdapterUpdate(adapters, lora_config_dict(self.lora))

    def offload(self) -> None:
        """Parameter shards, gradients and optimizer state to CPU (nothing moves on CPU or with cpu_offload)."""
        self._parked.offload(self.model, self.optimizer)

    def reload(self) -> None:
        self._parked.reload(self.model, self.optimizer, self._home())

    def _home(self) -> torch.device:
        """Where the parameter shards live between steps: the host with ``cpu_offload``, else the device."""
        return torch.device("cpu") if self.settings.cpu_offload else self.device

    def prepare_offload(self, worth_it: Callable[[int], bool]) -> None:
        """The unsharded tensors' buffers (a sharded one's host DTensor is made at its first offload)."""
        if not self.settings.cpu_offload:
            self._parked.prepare_for(self.model, self.optimizer, self.device, worth_it)

    def save(self, directory: Path, *, with_optimizer: bool) -> None:
        """``state/`` (this rank's shards, and of the optimizer ``with_optimizer``), ``model/`` (Hugging
        Face, part of its files), ``adapter/`` with LoRA (rank 0). A collective: every rank calls it."""
        directory.mkdir(parents=True, exist_ok=True)
        save_state(
            directory,
            self.model,
            self.optimizer,
            self.scheduler,
            with_optimizer=with_optimizer,
            keep=self._kept(),
        )
        adapter = self.adapter_update() if self.lora is not None else None
        if adapter is not None and self.rank == 0:
            save_adapter(directory / "adapter", adapter)
        self.export(directory / "model")

    def export(self, directory: Path) -> None:
        """Write the model as Hugging Face's ``save_pretrained`` would (LoRA merged), one decoder layer at
        a time: each is all-gathered in turn and its owner rank writes it (``hf_export``). A collective."""
        state = distinct_state(self.model)
        units = layer_units(self.model, state, decoder_layers(self.hf_model))
        scale = self.lora.alpha / self.lora.rank if self.lora is not None else None
        write_hf_model(
            directory,
            HFNames(self.hf_model, scale),
            state,
            units,
            lambda names, keep: _gather({n: state[n] for n in names}, keep=keep, on_host=False),
            rank=self.rank,
            world_size=self.world_size,
        )

    def load(self, directory: Path) -> None:
        """Weights, and where the checkpoint and this strategy have them the optimizer and schedule, from
        ``directory/state`` resharded to this world size; from a checkpoint older than ``state/``, the
        weights from ``model/`` (``adapter/`` with LoRA) and this rank's optimizer shard, saved at the
        same world size. A collective: every rank calls it."""
        if load_state(directory, self.model, self.optimizer, self.scheduler, keep=self._kept()):
            return
        shards = len(list(directory.glob("optimizer_rank*.pt"))) if self.optimizer is not None else 0
        if shards and shards != self.world_size:  # every rank alike, before any collective
            why = "a checkpoint of an earlier reroll, whose FSDP2 optimizer state is one shard per rank"
            raise SavedAtOtherWorldSize(directory, shards, self.world_size, why)
        if self.lora is not None:
            state = load_adapter(directory / "adapter")
        else:
            dtype = str(self.hf_model.dtype).removeprefix("torch.")
            state = self._load(directory / "model", dtype, "cpu").state_dict()
        _load_full(self.model, state, strict=self.lora is None)
        if shards:
            saved = torch.load(
                directory / f"optimizer_rank{self.rank}.pt", map_location="cpu", weights_only=False
            )
            self.optimizer.load_state_dict(_sharded_optimizer_state(self.optimizer, saved["optimizer"]))
            self.scheduler.load_state_dict(saved["scheduler"])

    def _kept(self) -> Callable[[str], bool] | None:
        """Which tensors ``state/`` holds: with LoRA those that train (the base is ``model.path``), else all."""
        if self.lora is None:
            return None
        return lambda name: trained_key(name, self.full)


@dataclass
class _Unfilled:
    """A model built on the meta device: where each parameter comes from (``shard_fill.plan``) and the
    checkpoint to read it from, once the model is sharded."""

    targets: list[Target]
    reader: CheckpointReader

    def check(self, model: torch.nn.Module) -> None:
        """Every meta parameter of ``model`` (``hf_model`` in any peft wrapper) is planned: an adapter left
        on the meta device would be filled with nothing."""
        planned = {id(getattr(t.module, t.attr)) for t in self.targets}
        unplanned = [n for n, p in meta_parameters(model).items() if id(p) not in planned]
        if unplanned:
            raise RuntimeError(
                f"parameters on the meta device that no checkpoint tensor fills: {unplanned[:5]}"
            )


def _start_model(
    load: Callable[..., Any], path: str, dtype: str, *, zero_missing: bool
) -> tuple[Any, _Unfilled | None]:
    """The model to shard: built on the meta device, to be filled shard by shard (``shard_fill``), where
    the checkpoint is safetensors files that ``plan`` places whole; else loaded whole on the host, on
    every rank (``fully_shard`` then moves each rank's shard to the device)."""
    files = checkpoint_files(path)
    if files is None:
        log.info("%s has no safetensors files: each rank loads the whole model on the host", path)
        return load(path, dtype, "cpu"), None
    model = load(path, dtype, "meta")
    reader = CheckpointReader(files, DTYPES[dtype])  # each tensor cast once, as from_pretrained casts it
    targets, unplaced = plan(model, reader, zero_missing=zero_missing)
    if unplaced:
        reader.close()
        log.info(
            "%s cannot be read by shards (%s%s): each rank loads the whole model on the host",
            path, "; ".join(unplaced[:3]), f"; {len(unplaced) - 3} more" if len(unplaced) > 3 else "",
        )  # fmt: skip
        return load(path, dtype, "cpu"), None
    zeros = [t.name for t in targets if not t.source.rows]
    if zeros:  # as the loader says it
        log.info("%s: %s start at zero", path, ", ".join(zeros))
    return model, _Unfilled(targets, reader)


def _gather(state: dict[str, torch.Tensor], *, keep: bool, on_host: bool = True) -> dict[str, torch.Tensor]:
    """Full CPU copies of a state dict's tensors where ``keep``, else {} (a DTensor is all-gathered, one
    at a time: a collective every rank joins). ``on_host=False``: the whole tensors where they are, not
    copied (for ``export``, which merges LoRA adapters on their device and copies each tensor to the
    host as it writes it, before the weights change again)."""
    out = {}
    for name, value in state.items():
        value = value.detach()
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if keep:
            out[name] = full.to("cpu", copy=True) if on_host else full
    return out


def _load_full(model: torch.nn.Module, state: dict[str, torch.Tensor], *, strict: bool) -> None:
    """Copy full tensors into a sharded model (each rank keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=strict))


def _sharded_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """An older checkpoint's optimizer shard (``optimizer.state_dict()`` with each DTensor as this rank's
    local shard) with its shards wrapped as DTensors like their parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for i, s in saved["state"].items():
        p = params[int(i)]
        state[i] = {
            k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            if isinstance(p, DTensor) and k != "step"
            else v
            for k, v in s.items()
        }
    return {**saved, "state": state}
