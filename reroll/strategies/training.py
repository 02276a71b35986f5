"""What the strategies that hold a Hugging Face model under a torch optimizer share: the warm-up
schedule, the forward pass over padded or packed rows, the finite-norm guarded step (a non-finite
gradient norm skips the update), parking the state in host memory while a colocated role has the
GPU, and the LoRA reference switch."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from reroll.config.vision import PACKING_REFUSED
from reroll.data.transfer import to_device
from reroll.data.types import ImageInputs
from reroll.errors import UserError
from reroll.models.loading import position_ids_from
from reroll.models.packed_attention import packed_kwargs
from reroll.models.vision import freeze_vision, model_inputs
from reroll.strategies.memory import alloc_retries, peak_memory_gb

if TYPE_CHECKING:
    from reroll.config.schema import RunConfig

logger = logging.getLogger(__name__)


def compile_model(model: torch.nn.Module) -> None:
    """``torch.compile`` the whole model in place (``model.compile``), with dynamic shapes: one graph
    for training and one for no-grad passes serve every sequence length, and parameter names and the
    state dict stay as they are (weight sync and checkpoints read them). Compiling each decoder layer
    instead recompiles per layer (Hugging Face attention reads its ``layer_idx``), past dynamo's cache
    limit of 8, after which the layers run eagerly: measured on an H200, no gain."""
    model.compile(dynamic=True)


def warmup_factor(step: int, warmup_steps: int) -> float:
    """The lr multiplier at optimizer step ``step`` (0-based): linear warm-up over ``warmup_steps``, then 1."""
    warm = max(warmup_steps, 0)
    return min(1.0, (step + 1) / warm) if warm else 1.0


def warmup_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_factor(step, warmup_steps))


def adamw_with_warmup(
    params: list[torch.nn.Parameter],
    *,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    warmup_steps: int,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """A fresh AdamW over ``params`` and its warm-up schedule; fused where ``fused_adamw`` says."""
    optimizer = torch.optim.AdamW(
        params, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused_adamw(params) or None
    )
    return optimizer, warmup_schedule(optimizer, warmup_steps)


def fused_adamw(params: list[torch.nn.Parameter]) -> bool:
    """Whether AdamW takes its fused CUDA kernel (one launch over all parameters, against the multi-tensor
    default's several per group): where every parameter is a floating-point CUDA tensor (FSDP2's
    shards too). Its step counters then stay on the GPU, which ``HostParking`` leaves in place."""
    return bool(params) and all(p.device.type == "cuda" and p.dtype.is_floating_point for p in params)


def text_decoder_layers(model: Any) -> list[torch.nn.Module]:
    """A Hugging Face model's language-model decoder layers, in order (a vision-language model's text
    model's, not its vision tower's blocks): those of the ``layers`` list of its decoder
    (``get_decoder()``) that can be checkpointed (``GradientCheckpointingLayer``)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None) or getattr(getattr(decoder, "model", None), "layers", None)
    return [m for m in layers or () if isinstance(m, GradientCheckpointingLayer)]


def checkpoint_first_layers(model: Any, count: int) -> None:
    """Recompute the first ``count`` decoder layers' activations in backward, each keeping only its input
    (non-reentrant ``torch.utils.checkpoint`` through Hugging Face's per-layer flag, which runs inside
    the layer's ``__call__`` and so inside FSDP2's hooks on it: FSDP2 leaves the recompute's unshard to
    its pre-backward hook); the others keep their activations. 0: none. Other checkpointable modules
    (a vision tower's blocks) are checkpointed where any decoder layer is. Why the first layers:
    ``reroll.config.memory.kept_activations``. Can be called again to change the count."""
    layers = text_decoder_layers(model)
    if count > len(layers):
        raise UserError(
            f"model.gradient_checkpointing is {count}, but the model has {len(layers)} decoder layers: "
            f"set at most {len(layers)} (or true for all)"
        )
    if count == 0:
        if getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_disable()
        return
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in layers[count:]:
        layer.gradient_checkpointing = False


def start_checkpointing(model: Any, setting: bool | int | str, trainable: bool) -> None:
    """``model.gradient_checkpointing`` at a trainer's start: true every checkpointable module (Hugging
    Face's ``gradient_checkpointing_enable``, non-reentrant), a count the first that many decoder
    layers, false none; 'auto' none until the role's worker chooses its count from its first pass
    (``StrategyWorker``). Nothing for a role that does not train (it runs no backward)."""
    if not trainable or setting is False or setting == "auto":
        return
    if setting is True:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        checkpoint_first_layers(model, int(setting))


def set_trainable(model: torch.nn.Module, cfg: RunConfig, trainable: bool) -> None:
    """Train mode and gradients for a role's model: all of it where ``trainable``, except a
    vision-language model's vision tower unless ``model.train_vision``; nothing for a scoring role."""
    model.train(trainable)
    model.requires_grad_(trainable)
    if trainable and not cfg.model.train_vision:
        frozen = freeze_vision(model)
        if frozen:
            logger.info("model.train_vision is false: the vision tower's %d parameters are frozen", frozen)


def forward_logits(
    model: Any,
    device: torch.device,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    images: ImageInputs | None = None,
) -> torch.Tensor:
    """``model``'s output for right-padded rows (``attention_mask``) or packed rows (``position_ids``, no
    mask; the rows' bounds go along for attention that keeps them apart: ``packed_attention``):
    ``(B, T, V)`` logits, or a critic's ``(B, T, 1)``. ``images``: the rows' images (a vision-language
    model), whose positions the model computes itself (3D, from the image grids: none are passed)."""
    input_ids = to_device(input_ids, device)  # queued: the host does not wait for the GPU here
    packed: dict[str, Any] = {}
    if images is not None:
        if attention_mask is None:
            raise ValueError(PACKING_REFUSED)
        attention_mask = to_device(attention_mask, device)
        vision = model_inputs(model, input_ids, images)
        return model(input_ids=input_ids, attention_mask=attention_mask, **vision).logits
    if attention_mask is not None:
        attention_mask = to_device(attention_mask, device)
        if position_ids is None:
            position_ids = position_ids_from(attention_mask)
    else:
        packed = packed_kwargs(position_ids, device)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=to_device(position_ids, device),
        **packed,
    )
    return out.logits


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    grad_norm: torch.Tensor,
    device: torch.device,
) -> dict[str, float]:
    """Step with already clipped gradients, unless their pre-clip ``grad_norm`` is not finite: then the
    gradients are dropped, nothing changes (weights, optimizer state, schedule) and ``skipped`` is 1.

    Returns ``grad_norm``, the ``lr`` used, ``skipped``, ``peak_memory_gb`` and on a GPU ``alloc_retries``."""
    lr = scheduler.get_last_lr()[0]
    norm = float(grad_norm)  # one wait for the GPU: whether to step depends on the norm
    skipped = not math.isfinite(norm)
    if not skipped:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {
        "grad_norm": norm,
        "lr": float(lr),
        "skipped": float(skipped),
        "peak_memory_gb": peak_memory_gb(device),
    } | alloc_retries(device)


class HostParking:
    """Where a strategy's state waits in host memory while a colocated role has the GPU.

    ``offload`` copies every parameter, gradient, buffer and Adam moment (not the step counters: a
    non-capturable AdamW wants them on the CPU, the fused one on the GPU, and they stay where they are) into pinned host memory and frees its GPU memory;
    ``reload`` copies them back into fresh GPU tensors. Every copy is queued without waiting and the
    move waits once, at its end: between pinned memory and the GPU a copy runs at the link's speed
    (about 53 GB/s each way on an H200 or H100, against 2-3 GB/s out and 6-9 GB/s back through
    pageable memory; ``benchmarks/offload.py``).

    Each tensor gets a host buffer of its exact size at the first offload, page-locked in place
    (``cudaHostRegister``) and kept for every later one (pinning costs about ten copies): the run holds
    the state's size in pinned host memory. (``torch.empty(pin_memory=True)`` would round every buffer
    up to a power of two: 1.9x the state for the 0.5B shape.) A sharded tensor (FSDP2's DTensor) is
    parked in a host DTensor made once by ``.to("cpu")``, whose local shard is page-locked and copied
    into at later offloads (not ``DTensor.from_local`` around an own buffer: that moves the buffer back
    to the mesh's GPU). Off CUDA, or where page-locking is refused, plain moves. Buffers are matched to
    tensors by their order in the walk (the module's, then the optimizer's), the same at every
    offload; a tensor whose shape, dtype or sharding differs from its buffer's gets a new one."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._locked: set[int] = set()  # data_ptr of each page-locked buffer
        self._next = 0
        self._pin = torch.cuda.is_available()

    def __del__(self) -> None:
        if not self._locked:
            return
        try:
            for buffer in self._buffers:
                self._unlock(buffer)
        except Exception:  # at interpreter exit CUDA may be gone already: the OS unpins with the process
            pass

    def offload(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self._next = 0
        self._walk(model, optimizer, self._park)

    def reload(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device
    ) -> None:
        self._walk(model, optimizer, lambda t: t.to(device, non_blocking=True))

    def park_storages(self, storages: list[torch.UntypedStorage]) -> list[Callable[[], None]]:
        """Each GPU storage copied into its host buffer and then freed in place, for state whose tensors
        must keep their identity (Megatron's DDP hooks sit on its parameters; its optimizer's shards are
        views): they stay the same objects and hold no GPU memory until the storage's returned
        callable brings it back. Storages off the GPU are left alone. Buffers are matched to storages
        by their order, as ``offload``'s to tensors."""
        self._next = 0
        gpu = [st for st in storages if st.device.type == "cuda" and st.nbytes()]
        hosts = [self._park(_bytes_of(st)) for st in gpu]
        if gpu:
            torch.cuda.synchronize()  # every queued copy done before the GPU memory goes
        restore = []
        for st, host in zip(gpu, hosts, strict=True):
            st.resize_(0)
            restore.append(partial(_bring_back, st, host))
        return restore

    @property
    def pinned_bytes(self) -> int:
        """The bytes of this parking's page-locked buffers (a DTensor's: its local shard)."""
        return sum(_nbytes(_local(b)) for b in self._buffers if _local(b).data_ptr() in self._locked)

    def _walk(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, move: Any) -> None:
        with torch.no_grad():
            model._apply(move)  # what Module.to does; FSDP2's modules re-register their shards after it
            for state in optimizer.state.values() if optimizer is not None else ():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and k != "step":
                        state[k] = move(v)
        if torch.cuda.is_initialized():  # the queued copies done: host copies are read only after this
            torch.cuda.synchronize()

    def _park(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s host copy, queued into its buffer (made now if none fits)."""
        if t.device.type == "cpu":
            return t
        i, self._next = self._next, self._next + 1
        old = self._buffers[i] if i < len(self._buffers) else None
        if old is not None and _fits(old, t):
            _local(old).copy_(_local(t), non_blocking=_local(old).data_ptr() in self._locked)
            return old
        if old is not None:
            self._unlock(old)
        if _is_dtensor(t):  # a host DTensor of t's sharding, then its shard locked
            buffer = t.to("cpu")
            self._lock(_local(buffer))
        else:  # locked first, so that even the first copy does not wait
            buffer = torch.empty(t.shape, dtype=t.dtype)
            self._lock(buffer)
            buffer.copy_(t, non_blocking=buffer.data_ptr() in self._locked)
        self._buffers[i : i + 1] = [buffer]
        return buffer

    def _lock(self, host: torch.Tensor) -> None:
        if self._pin and _nbytes(host):
            error = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), _nbytes(host), 0)
            if int(error) == 0:
                self._locked.add(host.data_ptr())
            else:  # page-locking refused (a memlock limit): plain copies still work
                logger.warning(
                    "page-locking host memory failed (cudaError %d): offload copies wait", int(error)
                )
                self._pin = False

    def _unlock(self, buffer: torch.Tensor) -> None:
        host = _local(buffer)
        if host.data_ptr() in self._locked:
            self._locked.discard(host.data_ptr())
            torch.cuda.cudart().cudaHostUnregister(host.data_ptr())


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole of ``storage`` as a tensor of bytes (sharing it)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _bring_back(storage: torch.UntypedStorage, host: torch.Tensor) -> None:
    """A storage ``park_storages`` freed, given its memory again and its bytes from ``host`` (queued: the
    GPU's later work on the stream runs after the copy)."""
    storage.resize_(_nbytes(host))
    _bytes_of(storage).copy_(host, non_blocking=host.is_pinned())


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    return t.to_local() if _is_dtensor(t) else t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _fits(buffer: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``t`` can be copied into ``buffer`` as it is: same shape, dtype and, for DTensors, the same
    sharding and local shape."""
    if _is_dtensor(buffer) != _is_dtensor(t) or buffer.shape != t.shape or buffer.dtype != t.dtype:
        return False
    return not _is_dtensor(t) or (
        buffer.placements == t.placements and _local(buffer).shape == _local(t).shape
    )


@contextlib.contextmanager
def adapters_disabled(model: Any, lora: Any) -> Iterator[None]:
    """The base model inside: forward passes skip the LoRA adapters (the reference policy)."""
    if lora is None:
        raise RuntimeError("adapters_disabled needs strategy.lora")
    with model.disable_adapter():
        yield
