"""``model.gradient_checkpointing: auto`` for one rank on a GPU: the count of first decoder layers a
training role recomputes in backward, chosen by ``reroll plan``'s estimate (``auto_checkpointed_layers``)
for rows of the longest prompt seen so far plus ``rollout.max_new_tokens`` (wider where rows were:
an SFT target longer than that), and raised (never lowered) as longer rows come. A role that does not train follows actor_train's count (computed the same
way, not applied): its forward-only passes are sized from actor_train's training micro-batch."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from reroll.config.memory import Shape, model_token_shape
from reroll.config.placement import run_roles
from reroll.config.role_memory import GIB, auto_checkpointed_layers, planned
from reroll.config.schema import RunConfig
from reroll.data.transfer import to_device
from reroll.errors import UserError
from reroll.models.loading import parameter_counts

log = logging.getLogger(__name__)


class AutoCheckpointing:
    """The count a rank checkpoints, the same on every rank of its role (a checkpointed layer's
    recompute runs FSDP2's and Ulysses' collectives again, so all ranks must recompute the same layers):
    the largest any rank's prompts need. ``apply``: None where the count only sizes forward-only passes
    (a role that does not train: no layer to checkpoint, no collective)."""

    def __init__(
        self,
        cfg: RunConfig,
        role: str,
        shape: Shape,
        gpu_memory_gib: float,
        apply: Callable[[int], None] | None,
    ) -> None:
        self.cfg, self.role, self.shape, self.gpu_memory_gib = planned(cfg, None), role, shape, gpu_memory_gib
        self._apply = apply
        self.count = 0  # layers checkpointed now
        self._prompt = -1  # the longest prompt the wanted count was chosen for
        self._wanted = 0

    def fit(self, prompt_tokens: int) -> int:
        """Checkpoint as many first layers as rows of ``prompt_tokens`` need (and earlier ones needed);
        a collective where the role has several ranks: every rank calls it at the same point."""
        if prompt_tokens > self._prompt:
            self._prompt = prompt_tokens
            self._wanted = auto_checkpointed_layers(
                self.cfg,
                self.shape,
                self.role,
                prompt_tokens=prompt_tokens,
                gpu_memory_gib=self.gpu_memory_gib,
            )
        wanted = self._wanted
        if self._apply is None:
            self.count = max(self.count, wanted)
            return self.count
        if dist.is_initialized() and dist.get_world_size() > 1:
            most = to_device(torch.tensor([wanted]), _collective_device())  # queued, not waited for
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            [wanted] = most.tolist()
        if wanted > self.count:
            self._apply(wanted)
            log.info(
                "%s: activation checkpointing on the first %d of %d decoder layers (model.gradient_checkpointing "
                "auto, for prompts of up to %d tokens on %.0f GiB GPUs)",
                self.role, wanted, self.shape.layers, prompt_tokens, self.gpu_memory_gib,
            )  # fmt: skip
            self.count = wanted
        return self.count


def _collective_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )


def auto_checkpointing(
    cfg: RunConfig, role: str, strategy: object, model_path: str, *, trainable: bool
) -> AutoCheckpointing | None:
    """The chooser of a rank whose ``model.gradient_checkpointing`` is 'auto', on a GPU (off GPUs memory
    does not bound it: nothing is checkpointed): a training role's own, applied through its strategy's
    ``checkpoint_layers`` (torch, fsdp2; the others refuse 'auto' at start); actor_train's, not applied,
    for a role that does not train. None otherwise."""
    device = getattr(strategy, "device", torch.device("cpu"))
    model = getattr(strategy, "hf_model", None)
    apply = getattr(strategy, "checkpoint_layers", None) if trainable else None
    if cfg.model.gradient_checkpointing != "auto" or device.type != "cuda" or model is None:
        return None
    target = role if trainable else "actor_train"  # whose train phase the count fits
    if (trainable and apply is None) or target not in run_roles(cfg, "cuda"):
        return None
    token = model_token_shape(model_path)
    if token is None:
        raise UserError(
            f"model.gradient_checkpointing=auto needs the model's shape, which {model_path!r}'s config does not "
            "give (layers, hidden size, heads, vocabulary): set a count of layers, or true"
        )
    params, experts = parameter_counts(model)
    shape = dataclasses.replace(token, params=params, expert_params=experts)
    gib = torch.cuda.get_device_properties(device).total_memory / GIB
    return AutoCheckpointing(cfg, target, shape, gib, apply)
