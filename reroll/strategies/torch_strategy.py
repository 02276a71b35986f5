"""The plain PyTorch strategy: one full model copy per rank, gradients summed across ranks.

Losses are normalised by the token/sequence counts of the whole optimizer step (all micro-batches, all
ranks), so summing gradients over ranks gives exactly the full-batch gradient. Ranks talk over
``torch.distributed`` (gloo on CPU, NCCL on GPU) when there is more than one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from reroll.data.types import ImageInputs
from reroll.models.loading import load_causal_lm, load_sequence_classifier, load_value_model, use_kernels
from reroll.strategies import Head
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
    is_adapter_key,
    load_adapter,
    lora_config_dict,
    save_adapter,
    trained_key,
)
from reroll.strategies.micro_batches import MicroBatchLoop
from reroll.strategies.sharded_state import load_state, save_state
from reroll.strategies.training import (
    adamw_with_warmup,
    adapters_disabled,
    checkpoint_first_layers,
    compile_model,
    forward_logits,
    optimizer_step,
    set_trainable,
    start_checkpointing,
)

if TYPE_CHECKING:
    from reroll.config.schema import RunConfig

_LOADERS = {"causal_lm": load_causal_lm, "value": load_value_model, "reward": load_sequence_classifier}


class TorchStrategy(MicroBatchLoop):
    """Holds the model, its optimizer and schedule; the role decides what loss to run through it.

    ``head`` picks the model: ``"causal_lm"`` (the policy, ``(B, T, V)`` logits) or ``"value"``
    (a critic, ``(B, T, 1)`` scores; ``reroll.models.loading.load_value_model``). With ``strategy.lora``
    the policy is wrapped with peft and only its adapters train (``reroll.strategies.lora``).
    """

    fused_head = True  # the Hugging Face model as it is: its lm_head's weight is whole

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
        self.device = torch.device(device)
        self._load = _LOADERS[head]
        self.model = self._load(model_path, cfg.model.dtype, self.device)
        use_kernels(self.model, cfg, self.device)
        self.rank, self.world_size = rank, world_size
        self.optimizer: torch.optim.Optimizer | None = None
        self._parked = HostParking()  # the state's host memory while a colocated role has the GPU
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        set_trainable(self.model, cfg, trainable)
        start_checkpointing(self.model, cfg.model.gradient_checkpointing, trainable)
        if getattr(self.model.config, "use_cache", None) is not None:
            self.model.config.use_cache = False
        self.lora = cfg.strategy.lora if head in ("causal_lm", "reward") else None
        self.full = full_modules(head)  # trained in full beside the adapters
        self.hf_model = self.model  # the Hugging Face model inside any peft wrapper
        if self.lora is not None:
            self.model = apply_lora(self.hf_model, self.lora, trainable=trainable, full=self.full)
        if cfg.model.compile:  # the outer module: peft's wrapper calls the inner model's forward directly
            compile_model(self.model)

    def init_distributed(self, address: str) -> None:
        """Join the process group of this role's ranks at ``tcp://address``."""
        if self.world_size == 1 or dist.is_initialized():
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://{address}", rank=self.rank, world_size=self.world_size
        )

    def configure_optimizer(
        self, *, lr: float, betas: tuple[float, float], weight_decay: float, warmup_steps: int
    ) -> None:
        """A fresh AdamW with linear warm-up to ``lr`` then constant (called again when a phase changes lr)."""
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
        """What the model's forward gives: ``(B, T, V)`` logits, or a critic's ``(B, T, 1)``.

        Right-padded rows pass ``attention_mask``; packed rows pass ``position_ids`` and no mask."""
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
        """Sum gradients over ranks, clip, step; returns the pre-clip gradient norm and the lr used."""
        assert self.optimizer is not None and self.scheduler is not None, "configure_optimizer first"
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.world_size > 1:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        return optimizer_step(self.optimizer, self.scheduler, grad_norm, self.device)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, unsharded, on CPU, in Hugging Face names; with LoRA, the base weights with
        the adapters merged in (``named_weights``' copies, all at once)."""
        return dict(self.named_weights(on_device=False))

    def named_weights(self, *, on_device: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights one at a time, in Hugging Face names: the live tensors (``on_device``) or CPU
        copies; never the whole state dict at once. With LoRA, the base weights with the adapters merged
        in, a decoder layer at a time, merged where the weights are (``full_weights``)."""
        scale = self.lora.alpha / self.lora.rank if self.lora is not None else None
        return full_weights(self.model, self.hf_model, scale, torch.Tensor.detach, on_device=on_device)

    def adapter_update(self) -> AdapterUpdate:
        """The LoRA adapters alone (peft's saved names) and their ``LoraConfig``."""
        if self.lora is None:
            raise RuntimeError("adapter_update needs strategy.lora")
        # the adapters picked before any copy: the frozen base is most of the state (a 7B model's 15 GB
        # copied to the host and dropped made most of its 16 s sync on an H100, 2026-12-07)
        wanted = {k: v for k, v in self.model.state_dict().items() if trained_key(k, self.full)}
        adapters = adapter_names_to_saved({k: v.detach().to("cpu", copy=True) for k, v in wanted.items()})
        return AdapterUpdate(adapters, lora_config_dict(self.lora))

    def offload(self) -> None:
        """Parameters, gradients and optimizer state to CPU (nothing to move when already there)."""
        self._parked.offload(self.model, self.optimizer)

    def reload(self) -> None:
        self._parked.reload(self.model, self.optimizer, self.device)

    def prepare_offload(self, worth_it: Callable[[int], bool]) -> None:
        self._parked.prepare_for(self.model, self.optimizer, self.device, worth_it)

    def save(self, directory: Path, *, with_optimizer: bool) -> None:
        """``state/`` (the weights, and ``with_optimizer`` the optimizer: DCP, each tensor written by one of
        the ranks), ``model/`` (Hugging Face, merged with LoRA; its files split between the ranks) and with
        LoRA ``adapter/`` (rank 0). A collective where there are several ranks."""
        directory.mkdir(parents=True, exist_ok=True)
        save_state(
            directory,
            self.model,
            self.optimizer,
            self.scheduler,
            with_optimizer=with_optimizer,
            keep=self._kept(),
        )
        if self.rank == 0 and self.lora is not None:
            save_adapter(directory / "adapter", self.adapter_update())
        self.export(directory / "model")

    def export(self, directory: Path) -> None:
        """Write the model as ``save_pretrained`` would (LoRA merged), each rank its share of the files,
        one decoder layer at a time (``hf_export``)."""
        state = distinct_state(self.model)
        layers = decoder_layers(self.hf_model)
        scale = self.lora.alpha / self.lora.rank if self.lora is not None else None

        def gather(names: Sequence[str], keep: bool) -> dict[str, torch.Tensor]:
            # where the weights are: a LoRA merge runs there (on a GPU, not the host, which took most of
            # a 7B LoRA checkpoint's 94 s on an H100 machine, 2026-12-07); the writer copies each tensor
            # to the host as it writes it, before the next step changes any
            return {n: state[n].detach() for n in names} if keep else {}

        write_hf_model(
            directory,
            HFNames(self.hf_model, scale),
            state,
            layer_units(self.model, state, layers),
            gather,
            rank=self.rank,
            world_size=self.world_size,
        )

    def load(self, directory: Path) -> None:
        """Weights, and where the checkpoint and this strategy have them the optimizer and schedule, from
        ``directory/state`` (saved at any world size, by this strategy or fsdp2); from a checkpoint older
        than ``state/``, the weights from ``model/`` (``adapter/`` with LoRA) and rank 0's optimizer
        state (every rank's was the same)."""
        if load_state(directory, self.model, self.optimizer, self.scheduler, keep=self._kept()):
            return
        if self.lora is not None:
            missing, unexpected = self.model.load_state_dict(
                load_adapter(directory / "adapter"), strict=False
            )
            if unexpected or any(is_adapter_key(k) for k in missing):
                raise KeyError(f"adapter in {directory} does not fit the model: {unexpected or missing}")
        else:
            loaded = self._load(directory / "model", str(self.model.dtype).removeprefix("torch."), "cpu")
            self.model.load_state_dict(loaded.state_dict())
        path = directory / "optimizer_rank0.pt"
        if path.exists() and self.optimizer is not None:
            state = torch.load(path, map_location=self.device, weights_only=False)
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])

    def _kept(self) -> Callable[[str], bool] | None:
        """Which tensors ``state/`` holds: with LoRA those that train (the base is ``model.path``), else all."""
        if self.lora is None:
            return None
        return lambda name: trained_key(name, self.full)
