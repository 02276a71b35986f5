"""The DeepSpeed strategy: ZeRO-2 (gradients and optimizer state sharded) or ZeRO-3 (parameters too).

Losses arrive normalised by the whole step's token/sequence counts (all micro-batches, all ranks), so
the gradient the step needs is the *sum* over micro-batches and ranks. DeepSpeed would divide by
``gradient_accumulation_steps`` and average over data-parallel ranks; here every ``backward`` passes
``scale_wrt_gas=False`` and multiplies the loss by the number of ranks, which undoes both exactly.

The accumulation boundary is explicit: the engine runs with ``managed_gradient_accumulation: false``,
so each ``backward`` only accumulates and each ``step`` is the boundary, whatever the number of
micro-batches that step had (token-budget micro-batching changes it from step to step).

Clipping is DeepSpeed's (``gradient_clipping`` = ``optim.grad_clip``, the same rule as
``torch.nn.utils.clip_grad_norm_``); ``step`` returns the pre-clip norm DeepSpeed measured. A non-finite
norm makes DeepSpeed skip the update, and the step reports ``skipped`` 1 (fp16 aside, where a
skipped step is the dynamic loss scale backing off: logged, not counted). The optimizer is
``torch.optim.AdamW`` (``DeepSpeedCPUAdam`` with ``offload_optimizer``) under our linear warm-up
``LambdaLR``.

Checkpoints: ``model/`` in Hugging Face form, written by every rank one decoder layer at a time
(ZeRO-3 gathers each in turn: ``hf_export``), and, for resume, ``deepspeed/`` in DeepSpeed's own layout
(every rank's optimizer partition, the fp32 master weights and the schedule). A role of another world
size resumes it through DeepSpeed's universal checkpoint: rank 0 converts ``deepspeed/`` once into
``deepspeed/universal/`` (one tensor per parameter and moment), which any number of ranks loads.
``full_state_dict`` gathers ZeRO-3 parameters on every rank: a collective that all ranks must call.

LoRA (``strategy.lora``): the model is wrapped with peft before the engine is built, so the optimizer
holds the adapters (and a reward model's score head) alone. Weight sync and ``model/`` get the base
weights with the adapters merged in, ``adapter/`` the adapters; ``deepspeed/`` holds the trained
tensors only (``exclude_frozen_parameters``), and a resume builds the base from ``model.path`` again
and loads them into it, at any world size (the universal form holds the trained tensors alone).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime import constants as ds_constants

from reroll.config.startable import deepspeed_problems
from reroll.data.types import ImageInputs
from reroll.errors import UserError
from reroll.models.loading import load_causal_lm, load_sequence_classifier, load_value_model, use_kernels
from reroll.strategies import Head
from reroll.strategies.hf_export import HFNames, decoder_layers, distinct_state, layer_units, write_hf_model
from reroll.strategies.lora import (
    AdapterUpdate,
    adapter_names_to_saved,
    apply_lora,
    full_modules,
    is_adapter_key,
    load_adapter,
    lora_config_dict,
    merged_state_dict,
    save_adapter,
    trained_key,
)
from reroll.strategies.memory import peak_memory_gb
from reroll.strategies.micro_batches import MicroBatchLoop
from reroll.strategies.training import (
    adapters_disabled,
    forward_logits,
    set_trainable,
    start_checkpointing,
    warmup_schedule,
)

if TYPE_CHECKING:
    from reroll.config.schema import RunConfig

log = logging.getLogger(__name__)

_LOADERS = {"causal_lm": load_causal_lm, "value": load_value_model, "reward": load_sequence_classifier}
_TAG = "state"  # the one tag under ``<checkpoint>/deepspeed/``: a checkpoint directory holds one step
_UNIVERSAL = "universal"  # ``<checkpoint>/deepspeed/universal/``: the state for any world size


class DeepSpeedStrategy(MicroBatchLoop):
    """Holds the model in a DeepSpeed engine (a frozen ZeRO-2 model, e.g. the reference, needs none).

    The engine is built as soon as the process group exists: in the constructor for one rank, in
    ``init_distributed`` for several. Until ``configure_optimizer`` the optimizer carries
    ``optim``'s settings and no warm-up.
    """

    fused_head = False  # ZeRO-3 gathers a module's parameters by hooks of its own: not proven with it

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
    ) -> None:
        self.cfg, self.ds = cfg, cfg.strategy.deepspeed
        if not hasattr(ds_constants, "MANAGED_GRADIENT_ACCUMULATION"):
            raise UserError(
                f"strategy.name is 'deepspeed' but deepspeed {deepspeed.__version__} lacks "
                "managed_gradient_accumulation (caller-owned step boundaries): pip install 'deepspeed>=0.19.8'"
            )
        problems = deepspeed_problems(cfg)
        if problems:
            raise UserError("; ".join(message for _, message in problems))
        self.device = torch.device(device)
        self.rank, self.world_size, self.trainable = rank, world_size, trainable
        self._load = _LOADERS[head]
        self._model_path = model_path
        o = cfg.optim
        self._optim: dict[str, Any] = dict(lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, warmup=0)
        self.engine: Any = None
        self.model: torch.nn.Module | None = None  # what the engine wraps: the peft model with LoRA
        self.hf_model: torch.nn.Module | None = None  # the Hugging Face model inside it
        self.lora = cfg.strategy.lora if head in ("causal_lm", "reward") else None
        self.full = full_modules(head)  # trained in full beside the adapters
        if world_size == 1:
            if not dist.is_initialized():  # DeepSpeed needs a process group, even of one rank
                dist.init_process_group(self._backend(), store=dist.HashStore(), rank=0, world_size=1)
            self._build(model_path)

    # --- setup -----------------------------------------------------------------------------------

    def _backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def init_distributed(self, address: str) -> None:
        """Join the process group of this role's ranks at ``tcp://address`` and build the engine there."""
        if self.world_size == 1:
            return
        if not dist.is_initialized():
            dist.init_process_group(
                self._backend(), init_method=f"tcp://{address}", rank=self.rank, world_size=self.world_size
            )
        self._build(self._model_path)

    def _ds_config(self, *, universal: bool = False) -> dict[str, Any]:
        """DeepSpeed's config from ours: precision from ``model.dtype``, ZeRO stage, offload, clipping;
        ``universal``: an engine that loads a universal checkpoint."""
        dtype = self.cfg.model.dtype
        zero: dict[str, Any] = {"stage": self.ds.zero_stage, "overlap_comm": False}
        if self.ds.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": self.device.type == "cuda"}
        if self.ds.offload_params:
            zero["offload_param"] = {"device": "cpu", "pin_memory": self.device.type == "cuda"}
        return {
            "train_micro_batch_size_per_gpu": 1,  # unused: batches are ours, not DeepSpeed's loader's
            "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False,  # each step() is the boundary
            "gradient_clipping": self.cfg.optim.grad_clip,
            "bf16": {"enabled": dtype == "bfloat16"},
            "fp16": {"enabled": dtype == "float16"},
            "zero_optimization": zero,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
            "checkpoint": {"load_universal": universal},
        }

    def _build(self, model_path: str | Path, *, universal: bool = False) -> None:
        """A fresh model from ``model_path`` in a fresh engine (replacing any engine this rank had);
        ``universal``: one that loads a universal checkpoint."""
        if self.engine is not None:
            self.engine.destroy()
        self.engine = None
        # The model is loaded on CPU; DeepSpeed places it (ZeRO-3 partitions it first).
        model = self._load(model_path, self.cfg.model.dtype, "cpu")
        use_kernels(model, self.cfg, self.device)
        set_trainable(model, self.cfg, self.trainable)
        start_checkpointing(model, self.cfg.model.gradient_checkpointing, self.trainable)  # counts: refused
        if getattr(model.config, "use_cache", None) is not None:
            model.config.use_cache = False
        self.hf_model = model
        if self.lora is not None:
            model = apply_lora(model, self.lora, trainable=self.trainable, full=self.full)
        self.model = model
        if not self.trainable and self.ds.zero_stage == 2:  # nothing to shard: a plain copy
            model.to(self.device)
            return
        os.environ.setdefault("LOCAL_RANK", "0")  # Ray shows each actor only its own GPU(s)
        optimizer = self._new_optimizer(model) if self.trainable else None
        self.engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=self._new_schedule if self.trainable else None,
            config=self._ds_config(universal=universal),
            dist_init_required=False,
        )

    def _new_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        o = self._optim
        if self.ds.offload_optimizer:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(
                params, lr=o["lr"], betas=o["betas"], weight_decay=o["weight_decay"], adamw_mode=True
            )
        return torch.optim.AdamW(params, lr=o["lr"], betas=o["betas"], weight_decay=o["weight_decay"])

    def _new_schedule(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """Linear warm-up to the optimizer's lr over ``warmup`` steps, then constant."""
        for group in optimizer.param_groups:
            group["initial_lr"] = self._optim["lr"]
        return warmup_schedule(optimizer, self._optim["warmup"])

    def configure_optimizer(
        self, *, lr: float, betas: tuple[float, float], weight_decay: float, warmup_steps: int
    ) -> None:
        """A fresh AdamW (moments and step count cleared) with linear warm-up to ``lr`` then constant."""
        self._optim = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, warmup=warmup_steps)
        if self.engine is None or not self.trainable:
            return
        inner = self.engine.basic_optimizer  # the AdamW over this rank's fp32 partition
        inner.state.clear()
        for group in inner.param_groups:
            group.update(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        self.engine.lr_scheduler = self._new_schedule(inner)

    def adapters_disabled(self) -> contextlib.AbstractContextManager[None]:
        """The base model inside: forward passes skip the LoRA adapters (the reference policy)."""
        return adapters_disabled(self.model, self.lora)

    # --- training --------------------------------------------------------------------------------

    def logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        images: ImageInputs | None = None,
    ) -> torch.Tensor:
        """What the model's forward gives: ``(B, T, V)`` logits, or a critic's ``(B, T, 1)``.

        Right-padded rows pass ``attention_mask``; packed rows pass ``position_ids`` and no mask."""
        device = self.engine.device if self.engine is not None else self.device
        forward = self.engine if self.engine is not None else self.model
        return forward_logits(forward, device, input_ids, attention_mask, position_ids, images)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate this micro-batch's gradient; ``* world_size`` undoes DeepSpeed's rank average."""
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)

    def step(self, grad_clip: float) -> dict[str, float]:
        """Reduce gradients, clip, step: the pre-clip ``grad_norm``, the ``lr`` used, ``peak_memory_gb``."""
        assert self.engine is not None and self.trainable, "step needs a trainable strategy"
        if grad_clip != self.cfg.optim.grad_clip:
            raise ValueError(
                f"DeepSpeed clips inside its engine at optim.grad_clip={self.cfg.optim.grad_clip}; "
                f"step(grad_clip={grad_clip}) cannot change it: set optim.grad_clip instead"
            )
        lr = self.engine.lr_scheduler.get_last_lr()[0]
        skipped = self.engine.skipped_steps
        self.engine.step()
        grad_norm = float(self.engine.get_global_grad_norm())
        was_skipped = self.engine.skipped_steps > skipped
        if was_skipped and self.cfg.model.dtype == "float16":
            log.warning("fp16 loss scale overflow: update skipped, loss scale backs off")
            was_skipped = False  # the loss scale's business, not a non-finite step
        elif not was_skipped and not math.isfinite(grad_norm):
            raise FloatingPointError(
                f"gradient norm is {grad_norm} and DeepSpeed applied the update: stopping"
            )
        memory = peak_memory_gb(self.device)
        return {
            "grad_norm": grad_norm,
            "lr": float(lr),
            "skipped": float(was_skipped),
            "peak_memory_gb": memory,
        }

    # --- weights ---------------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight, unsharded, on CPU, in Hugging Face names, LoRA merged into the base weights
        (ZeRO-3: a collective on every rank)."""
        state = self._gathered(lambda name: True)
        if self.lora is None:
            return state
        return merged_state_dict(state, scale=self.lora.alpha / self.lora.rank)

    def adapter_update(self) -> AdapterUpdate:
        """The LoRA adapters alone (peft's saved names) and their ``LoraConfig`` (ZeRO-3: a collective)."""
        if self.lora is None:
            raise RuntimeError("adapter_update needs strategy.lora")
        adapters = adapter_names_to_saved(self._gathered(lambda name: trained_key(name, self.full)))
        return AdapterUpdate(adapters, lora_config_dict(self.lora))

    def _gathered(self, wanted: Callable[[str], bool]) -> dict[str, torch.Tensor]:
        """CPU copies of the model's state whose names ``wanted`` takes; ZeRO-3 gathers a module at a time."""
        assert self.model is not None
        if self.engine is None or self.ds.zero_stage != 3:
            state = self.model.state_dict()
            return {k: v.detach().to("cpu", copy=True) for k, v in state.items() if wanted(k)}
        out: dict[str, torch.Tensor] = {}
        for prefix, module in self.model.named_modules():
            prefix = f"{prefix}." if prefix else ""
            params = [p for n, p in module.named_parameters(recurse=False) if wanted(prefix + n)]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):  # one module at a time
                for name, p in module.named_parameters(recurse=False):
                    if wanted(prefix + name):
                        out[prefix + name] = p.detach().to("cpu", copy=True)
            for name, buf in module.named_buffers(recurse=False):
                if name not in module._non_persistent_buffers_set and wanted(prefix + name):
                    out[prefix + name] = buf.detach().to("cpu", copy=True)
        return out

    def save(self, directory: Path, *, with_optimizer: bool) -> None:
        """Hugging Face weights into ``directory/model`` (every rank its files); DeepSpeed's state into
        ``directory/deepspeed``. A collective: every rank calls it."""
        assert self.model is not None
        directory.mkdir(parents=True, exist_ok=True)
        self.export(directory / "model")
        if self.lora is not None:
            adapter = self.adapter_update()
            if self.rank == 0:
                save_adapter(directory / "adapter", adapter)
        if with_optimizer and self.trainable:
            self.engine.save_checkpoint(
                str(directory / "deepspeed"),
                tag=_TAG,
                save_latest=False,
                exclude_frozen_parameters=self.lora is not None,  # the base is model.path's
            )

    def export(self, directory: Path) -> None:
        """Write the model as ``save_pretrained`` would, one decoder layer at a time (ZeRO-3 gathers each
        in turn; otherwise every rank holds the weights), each rank its share of the files."""
        assert self.model is not None
        state = distinct_state(self.model)
        zero3 = self.engine is not None and self.ds.zero_stage == 3
        shapes = {  # a partitioned ZeRO-3 parameter is empty; ds_shape is its shape
            n: torch.empty(getattr(t, "ds_shape", t.shape), dtype=t.dtype, device="meta")
            for n, t in state.items()
        }

        def gather(names: Sequence[str], keep: bool) -> dict[str, torch.Tensor]:
            params = [state[n] for n in names if hasattr(state[n], "ds_id")] if zero3 else []
            with (
                deepspeed.zero.GatheredParameters(params, modifier_rank=None)
                if params
                else contextlib.nullcontext()
            ):
                return {n: state[n].detach().to("cpu", copy=True) for n in names} if keep else {}

        assert self.hf_model is not None
        units = layer_units(self.model, state, decoder_layers(self.hf_model))
        scale = self.lora.alpha / self.lora.rank if self.lora is not None else None
        write_hf_model(
            directory,
            HFNames(self.hf_model, scale),
            shapes,
            units,
            gather,
            rank=self.rank,
            world_size=self.world_size,
        )

    def load(self, directory: Path) -> None:
        """A fresh engine on ``directory/model``; where present, DeepSpeed's optimizer and schedule too,
        through a universal checkpoint where they were saved by another number of ranks.

        A collective: every rank calls it."""
        state = directory / "deepspeed"
        saved = len(list((state / _TAG).glob("*optim_states.pt"))) if self.trainable else 0
        universal = bool(saved) and saved != self.world_size
        if universal:
            self._to_universal(state)
        # with LoRA the base comes from model.path and the trained tensors from deepspeed/ (or adapter/)
        self._build(self._model_path if self.lora is not None else directory / "model", universal=universal)
        if self.lora is not None and not saved:
            self._load_trained(load_adapter(directory / "adapter"), directory)
        if saved:
            path, _ = self.engine.load_checkpoint(
                str(state / _UNIVERSAL if universal else state),
                tag=_TAG,
                load_optimizer_states=True,
                load_lr_scheduler_states=True,
                load_module_strict=self.lora is None,
            )
            if path is None:
                raise FileNotFoundError(f"DeepSpeed found no checkpoint to load in {state / _TAG}")

    def _load_trained(self, tensors: dict[str, torch.Tensor], directory: Path) -> None:
        """The adapters (and fully trained modules) saved in ``directory/adapter``, in the live model's
        names, copied into the model (ZeRO-3: into each gathered parameter, partitioned again after)."""
        assert self.model is not None
        params = dict(self.model.named_parameters())
        unknown = sorted(set(tensors) - set(params))
        missing = sorted(n for n in params if is_adapter_key(n) and n not in tensors)
        if unknown or missing:
            raise KeyError(f"adapter in {directory} does not fit the model: {unknown or missing}")
        zero3 = self.engine is not None and self.ds.zero_stage == 3
        for name, value in tensors.items():
            p = params[name]
            with (
                deepspeed.zero.GatheredParameters([p], modifier_rank=0) if zero3 else contextlib.nullcontext()
            ):
                if not zero3 or self.rank == 0:
                    with torch.no_grad():
                        p.copy_(value.to(p.device, p.dtype))

    def _to_universal(self, state: Path) -> None:
        """``state/universal/`` from ``state/``, converted by rank 0 unless an earlier resume did (the other
        ranks wait): DeepSpeed's ``ds_to_universal``, its output kept quiet."""
        out = state / _UNIVERSAL
        if self.rank == 0 and not (out / _TAG / "zero").is_dir():
            from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

            args = argparse.Namespace(
                input_folder=str(state / _TAG),
                output_folder=str(out / _TAG),
                num_extract_workers=1,  # in this process: a Ray worker's children are not Ray's to place
                num_merge_workers=1,
                keep_temp_folder=False,
                strict=True,
                inject_missing_state=True,  # what it needs of a model that is not Megatron's
            )
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                ds_to_universal(args)
        if dist.is_initialized():
            dist.barrier()

    # --- colocation ------------------------------------------------------------------------------

    def offload(self) -> None:
        """Parameters, gradients and optimizer state off the accelerator (nothing to move on CPU)."""
        if self.device.type == "cpu":
            return
        if self.engine is None:
            self.model.to("cpu")
        elif self.trainable and not self.ds.offload_params:
            self.engine.offload_states()
        else:
            raise NotImplementedError(
                "DeepSpeed cannot move a frozen ZeRO-3 model or offloaded parameters (offload_params): "
                "give this role its own GPUs instead of colocating it"
            )

    def prepare_offload(self, worth_it: Callable[[int], bool]) -> None:
        """Nothing: DeepSpeed's ``offload_states`` makes its own host buffers."""

    def reload(self) -> None:
        """Bring back what ``offload`` moved."""
        if self.device.type == "cpu":
            return
        if self.engine is None:
            self.model.to(self.device)
        else:
            self.engine.reload_states()
