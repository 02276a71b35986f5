"""actor_train and reference: a worker that holds a training strategy, and its group of ranks.

The same worker serves both roles (the reference is built with ``trainable=False`` and never steps).
The loss comes from ``reroll.algorithms``; the strategy only runs forward, backward and step.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from reroll.algorithms.objective import actor_loss
from reroll.config.schema import RunConfig
from reroll.data.types import TrainBatch
from reroll.models.loading import mismatch_metrics, token_entropy, token_logprobs
from reroll.runtime.actors import WorkerGroup, free_address
from reroll.strategies.torch_strategy import TorchStrategy


def _mean_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for p in parts for k in p}
    return {k: sum(p[k] for p in parts if k in p) / sum(1 for p in parts if k in p) for k in sorted(keys)}


class TrainerWorker:
    """One rank of actor_train or reference."""

    def __init__(self, role: str, rank: int, cfg: RunConfig, trainable: bool) -> None:
        role_cfg = getattr(cfg.roles, role)
        torch.set_num_threads(role_cfg.torch_threads or torch.get_num_threads())
        torch.manual_seed(cfg.seed + rank)
        self.role, self.rank, self.cfg = role, rank, cfg
        device = "cuda" if role_cfg.num_gpus_per_worker > 0 else "cpu"
        self.strategy = TorchStrategy(
            cfg.model.path,
            dtype=cfg.model.dtype,
            device=device,
            trainable=trainable,
            gradient_checkpointing=cfg.model.gradient_checkpointing,
            rank=rank,
            world_size=role_cfg.world_size,
        )
        self.temperature = cfg.rollout.temperature or 1.0

    def rendezvous_address(self) -> str:
        return free_address()

    def init_distributed(self, address: str) -> None:
        self.strategy.init_distributed(address)

    def configure_optimizer(self, lr: float, warmup_steps: int) -> None:
        o = self.cfg.optim
        self.strategy.configure_optimizer(
            lr=lr, betas=o.betas, weight_decay=o.weight_decay, warmup_steps=warmup_steps
        )

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``(B, T)`` log-probs of ``batch.input_ids`` at the sampling temperature."""
        parts = []
        for mb in batch.chunks(self.cfg.optim.micro_batch_size):
            logits = self.strategy.logits(mb.input_ids, mb.attention_mask)
            parts.append(token_logprobs(logits, mb.input_ids.to(logits.device), self.temperature).cpu())
        return TrainBatch.concat(parts, width=batch.input_ids.shape[1])

    def train_rl(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch; the policy loss is the algorithm's."""
        metrics = []
        alg = self.cfg.algorithm
        for mb in batch.chunks(self.cfg.optim.micro_batch_size):
            logits = self.strategy.logits(mb.input_ids, mb.attention_mask)
            ids = mb.input_ids.to(logits.device)
            logprobs = token_logprobs(logits, ids, self.temperature)
            entropy = token_entropy(logits, self.temperature)
            if alg.entropy_coef == 0:
                entropy = entropy.detach()
            dev = logprobs.device
            loss, m = actor_loss(
                alg,
                logprobs=logprobs,
                old_logprobs=None if mb.old_logprobs is None else mb.old_logprobs.to(dev),
                advantages=mb.advantages.to(dev),
                response_mask=mb.response_mask.to(dev),
                ref_logprobs=None if mb.ref_logprobs is None else mb.ref_logprobs.to(dev),
                entropy=entropy,
                rollout_logprobs=None if mb.rollout_logprobs is None else mb.rollout_logprobs.to(dev),
                num_tokens=batch.num_tokens,
                num_seqs=batch.num_seqs,
                max_response_len=self.cfg.rollout.max_new_tokens,
            )
            self._check_finite(loss, mb)
            self.strategy.backward(loss)
            if mb.old_logprobs is None and mb.rollout_logprobs is not None:  # on-policy: measured here
                m |= mismatch_metrics(logprobs, mb.rollout_logprobs.to(dev), mb.response_mask.to(dev))
            metrics.append({k: float(v) for k, v in m.items()} | {"actor/loss": float(loss.detach())})
        return _mean_metrics(metrics) | {
            f"actor/{k}": v for k, v in self.strategy.step(self.cfg.optim.grad_clip).items()
        }

    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step of next-token loss on the response tokens (token mean over the whole step)."""
        total = 0.0
        for mb in batch.chunks(self.cfg.optim.micro_batch_size):
            logits = self.strategy.logits(mb.input_ids, mb.attention_mask)
            logprobs = token_logprobs(logits, mb.input_ids.to(logits.device), 1.0)
            mask = mb.response_mask.to(logprobs.device)
            loss = -(logprobs * mask).sum() / batch.num_tokens
            self._check_finite(loss, mb)
            self.strategy.backward(loss)
            total += float(loss.detach())
        return {"sft/loss": total} | {
            f"sft/{k}": v for k, v in self.strategy.step(self.cfg.optim.grad_clip).items()
        }

    def _check_finite(self, loss: torch.Tensor, mb: TrainBatch) -> None:
        if not math.isfinite(float(loss.detach())):
            raise FloatingPointError(
                f"{self.role}[{self.rank}] loss is {float(loss.detach())} on a micro-batch of {len(mb)} rows, "
                f"{int(mb.response_mask.sum())} response tokens, advantages "
                f"{None if mb.advantages is None else float(mb.advantages.abs().max())} max abs: stopping"
            )

    def weights(self) -> dict[str, torch.Tensor]:
        return self.strategy.full_state_dict()

    def save(self, directory: str, with_optimizer: bool) -> None:
        self.strategy.save(Path(directory), with_optimizer=with_optimizer)

    def load(self, directory: str) -> None:
        self.strategy.load(Path(directory))


class TrainerGroup(WorkerGroup):
    """The ranks of actor_train or reference; batches are split by rows across ranks."""

    def __init__(self, role: str, cfg: RunConfig, *, trainable: bool) -> None:
        super().__init__(role, TrainerWorker, lambda rank: (role, rank, cfg, trainable), cfg)
        if self.world_size > 1:
            [address] = self._wait([self.handles[0].rendezvous_address.remote()], "rendezvous")
            self._wait([h.init_distributed.remote(address) for h in self.handles], "init_distributed")

    def configure_optimizer(self, lr: float, warmup_steps: int) -> None:
        self._wait(
            [h.configure_optimizer.remote(lr, warmup_steps) for h in self.handles], "configure_optimizer"
        )

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        shards = batch.split(self.world_size)
        parts = self._wait(
            [h.compute_logprobs.remote(s) for h, s in zip(self.handles, shards)], "compute_logprobs"
        )
        return TrainBatch.concat(parts, width=batch.input_ids.shape[1])

    def train_rl(self, batch: TrainBatch) -> dict[str, float]:
        shards = batch.split(self.world_size)
        return _mean_metrics(
            self._wait([h.train_rl.remote(s) for h, s in zip(self.handles, shards)], "train")
        )

    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        shards = batch.split(self.world_size)
        return _mean_metrics(self._wait([h.train_sft.remote(s) for h, s in zip(self.handles, shards)], "sft"))

    def weights_ref(self) -> Any:
        """A reference to rank 0's full weights, to hand to the engine without passing through the driver."""
        return self.handles[0].weights.remote()

    def save(self, directory: Path, with_optimizer: bool = True) -> None:
        self._wait([h.save.remote(str(directory), with_optimizer) for h in self.handles], "save")

    def load(self, directory: Path) -> None:
        self._wait([h.load.remote(str(directory)) for h in self.handles], "load")
