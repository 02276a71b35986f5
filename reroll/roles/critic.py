"""critic: the learned value function that GAE (``adv_estimator: gae``, the ``ppo`` preset) needs.

A ``CriticWorker`` holds a training strategy with a value head (``reroll.models.loading.load_value_model``).
Its values are aligned like the log-probs: ``values[b, t]`` is V of the state before token ``t``
(``token_values``). Training regresses them on the GAE returns with PPO's clipped value loss; the
batch carries the values the advantages were computed with in ``values`` and the targets in
``returns``. It saves into ``<checkpoint>/critic/`` (``model/`` in Hugging Face form, and the
optimizer state per rank).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from reroll.algorithms.aggregation import aggregate
from reroll.algorithms.value import token_values, value_loss
from reroll.config.schema import RunConfig
from reroll.data.transfer import metrics_to_host, to_device
from reroll.data.types import TrainBatch
from reroll.roles.objectives import rows_inputs
from reroll.roles.strategy_worker import StrategyGroup, StrategyWorker, mean_metrics

SUBDIR = "critic"  # where the critic goes inside a checkpoint directory


class CriticWorker(StrategyWorker):
    """One rank of the critic; its optimizer is set from the ``critic`` section when it starts."""

    def __init__(self, rank: int, cfg: RunConfig) -> None:
        assert cfg.critic is not None, "CriticWorker needs a critic section"
        super().__init__("critic", rank, cfg, model_path=cfg.critic_model_path, trainable=True, head="value")
        self.configure_optimizer(cfg.critic.lr, cfg.critic.warmup_steps)

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """``(B, T)`` values V(x_<t), zero in column 0 (no gradient)."""
        return self._score(batch, lambda mb: token_values(self.forward(mb)))

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch: the token mean of PPO's clipped value loss.

        Each micro-batch's loss is divided by the whole step's ``batch.num_tokens``, so the shares of
        micro-batches and ranks add up to the full batch's loss (``critic/vf_loss`` is this rank's share).
        """
        assert self.cfg.critic is not None
        clip = self.cfg.critic.value_clip

        def loss_of(mb: TrainBatch) -> tuple[torch.Tensor, str, tuple[dict[str, Any], torch.Tensor]]:
            values = token_values(self.forward(mb))
            old_values, returns, mask = (
                to_device(t, values.device) for t in (mb.values, mb.returns, mb.response_mask)
            )
            token_loss, m = value_loss(values, old_values, returns, mask, clip=clip)
            loss = aggregate(token_loss, mask, mode="token-mean", num_tokens=batch.num_tokens)
            return (
                loss,
                rows_inputs(mb, f"returns {float(mb.returns.abs().max())} max abs"),
                (m, loss.detach()),
            )

        records = self._train_micro_batches(self.micro_batches(batch), loss_of)
        parts, losses = [m for m, _ in records], [loss for _, loss in records]
        step = self._step("critic", "critic/nonfinite_skipped")  # waits for the gradient norm
        # one copy, after the step; the losses (each micro-batch's share) summed in their order
        *metrics, shares = metrics_to_host([*parts, {str(i): v for i, v in enumerate(losses)}])
        return mean_metrics(metrics) | {"critic/vf_loss": sum(shares.values(), 0.0)} | step

    def save(self, directory: str, with_optimizer: bool = True) -> None:
        super().save(str(Path(directory) / SUBDIR), with_optimizer)

    def load(self, directory: str) -> None:
        super().load(str(Path(directory) / SUBDIR))


class CriticGroup(StrategyGroup):
    """The critic's ranks; batches are split by rows across them."""

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__("critic", CriticWorker, lambda rank: (rank, cfg), cfg)

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        shards = batch.split(self.world_size)
        parts = self._wait([h.compute_values.remote(s) for h, s in zip(self.handles, shards)], "values")
        return TrainBatch.concat(parts, width=batch.input_ids.shape[1])

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step; ``critic/vf_loss`` is the full batch's (the ranks' shares summed)."""
        shards = batch.split(self.world_size)
        parts = self._wait([h.train.remote(s) for h, s in zip(self.handles, shards)], "critic")
        return mean_metrics(parts) | {"critic/vf_loss": sum(p["critic/vf_loss"] for p in parts)}
