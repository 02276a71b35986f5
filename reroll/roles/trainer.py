"""actor_train and reference: a worker that holds a training strategy, and its group of ranks.

The same worker serves both roles (the reference is built with ``trainable=False`` and never steps).
The loss comes from ``reroll.algorithms``; the strategy only runs forward, backward and step.
"""

from __future__ import annotations

from typing import Any

import torch

from reroll.algorithms.objective import actor_loss
from reroll.config.schema import RunConfig
from reroll.data.types import TrainBatch
from reroll.models.loading import mismatch_metrics, token_entropy, token_logprobs
from reroll.roles.strategy_worker import StrategyGroup, StrategyWorker, mean_metrics


class TrainerWorker(StrategyWorker):
    """One rank of actor_train or reference."""

    def __init__(self, role: str, rank: int, cfg: RunConfig, trainable: bool) -> None:
        super().__init__(role, rank, cfg, model_path=cfg.model.path, trainable=trainable, head="causal_lm")
        self.temperature = cfg.rollout.temperature or 1.0

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``(B, T)`` log-probs of ``batch.input_ids`` at the sampling temperature."""
        return self._score(
            batch, lambda logits, mb: token_logprobs(logits, mb.input_ids.to(logits.device), self.temperature)
        )

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
            self._check_finite(loss, mb, _advantage_stats(mb))
            self.strategy.backward(loss)
            if mb.old_logprobs is None and mb.rollout_logprobs is not None:  # on-policy: measured here
                m |= mismatch_metrics(logprobs, mb.rollout_logprobs.to(dev), mb.response_mask.to(dev))
            metrics.append({k: float(v) for k, v in m.items()} | {"actor/loss": float(loss.detach())})
        return mean_metrics(metrics) | self._step("actor")

    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step of next-token loss on the response tokens (token mean over the whole step)."""
        total = 0.0
        for mb in batch.chunks(self.cfg.optim.micro_batch_size):
            logits = self.strategy.logits(mb.input_ids, mb.attention_mask)
            logprobs = token_logprobs(logits, mb.input_ids.to(logits.device), 1.0)
            mask = mb.response_mask.to(logprobs.device)
            loss = -(logprobs * mask).sum() / batch.num_tokens
            self._check_finite(loss, mb, _advantage_stats(mb))
            self.strategy.backward(loss)
            total += float(loss.detach())
        return {"sft/loss": total} | self._step("sft")

    def weights(self) -> dict[str, torch.Tensor]:
        return self.strategy.full_state_dict()


def _advantage_stats(mb: TrainBatch) -> str:
    top = None if mb.advantages is None else float(mb.advantages.abs().max())
    return f"advantages {top} max abs"


class TrainerGroup(StrategyGroup):
    """The ranks of actor_train or reference; batches are split by rows across ranks."""

    def __init__(self, role: str, cfg: RunConfig, *, trainable: bool) -> None:
        super().__init__(role, TrainerWorker, lambda rank: (role, rank, cfg, trainable), cfg)

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        shards = batch.split(self.world_size)
        parts = self._wait(
            [h.compute_logprobs.remote(s) for h, s in zip(self.handles, shards)], "compute_logprobs"
        )
        return TrainBatch.concat(parts, width=batch.input_ids.shape[1])

    def train_rl(self, batch: TrainBatch) -> dict[str, float]:
        shards = batch.split(self.world_size)
        return mean_metrics(self._wait([h.train_rl.remote(s) for h, s in zip(self.handles, shards)], "train"))

    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        shards = batch.split(self.world_size)
        return mean_metrics(self._wait([h.train_sft.remote(s) for h, s in zip(self.handles, shards)], "sft"))

    def weights_ref(self) -> Any:
        """A reference to rank 0's full weights, to hand to the engine without passing through the driver."""
        return self.handles[0].weights.remote()
