"""learned_reward: a trained reward model served as a role, scoring whole responses in batches (RLHF).

The checkpoint is an ``AutoModelForSequenceClassification`` with one label (what ``pipeline:
reward_model`` writes, or any Bradley-Terry reward model). A ``LearnedRewardWorker`` holds it in a training
strategy, forward only, on the devices ``roles.learned_reward`` gives it (its own, or shared with the
policy: the run offloads it between phases like the reference). It is loaded as the critic is
(``reroll.models.loading.load_value_model``: the body and the one-output ``score`` head, applied at every
position), and the reward is the output at the last token of ``reward.model.template`` (over
``{prompt}`` and ``{response}``), which is what the sequence-classification model itself returns for
an unpadded row. Because the critic loads the same way, ``critic.model_path: <the reward model>``
starts PPO's value function from the reward model.

Texts are tokenised with the reward model's own tokenizer (it need not be the policy's), without special
tokens, its eos appended (``reward.model.append_eos``, as reward models are trained on prompt + response +
eos), keeping the last ``reward.model.max_length`` tokens; micro-batches follow the forward-only
``optim.logprob_*`` limits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from reroll.config.schema import RunConfig
from reroll.data.types import TrainBatch
from reroll.models.loading import load_tokenizer
from reroll.roles.strategy_worker import StrategyGroup, StrategyWorker

ROLE = "learned_reward"


class LearnedRewardWorker(StrategyWorker):
    """One rank of the reward model."""

    def __init__(self, rank: int, cfg: RunConfig) -> None:
        assert cfg.reward.model is not None, "the learned_reward role needs reward.model"
        path = cfg.reward.model.path
        super().__init__(ROLE, rank, cfg, model_path=path, trainable=False, head="value")
        self.tokenizer = load_tokenizer(path)
        self.max_length, self.append_eos = cfg.reward.model.max_length, cfg.reward.model.append_eos

    def score(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores (n,), truncated bool (n,))``: the model's output at each text's last token."""
        if not texts:
            return torch.zeros(0), torch.zeros(0, dtype=torch.bool)
        eos = [self.tokenizer.eos_token_id] if self.append_eos else []
        rows = [self.tokenizer.encode(t, add_special_tokens=False) + eos for t in texts]
        truncated = torch.tensor([len(r) > self.max_length for r in rows])
        rows = [r[-self.max_length :] or [self.tokenizer.pad_token_id] for r in rows]
        batch = _right_padded(rows, self.tokenizer.pad_token_id)
        scores = self._score(batch, lambda mb: self.forward(mb)[..., 0].float())
        last = batch.attention_mask.sum(-1) - 1
        return scores[torch.arange(len(rows)), last], truncated


def _right_padded(rows: list[list[int]], pad_id: int) -> TrainBatch:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = True
    return TrainBatch(ids, mask, mask.clone(), torch.arange(len(rows)))


class LearnedRewardGroup(StrategyGroup):
    """The reward model's ranks; texts are dealt in contiguous blocks across them."""

    def __init__(self, cfg: RunConfig) -> None:
        assert cfg.reward.model is not None
        super().__init__(ROLE, LearnedRewardWorker, lambda rank: (rank, cfg), cfg)
        self.template = cfg.reward.model.template

    def score(
        self, prompts: Sequence[str], responses: Sequence[str], phase: str = "reward"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores ``(n,)`` of ``template.format(prompt=..., response=...)`` and which were truncated ``(n,)``."""
        texts = [self.template.format(prompt=p, response=r) for p, r in zip(prompts, responses)]
        parts = self._wait([h.score.remote(part) for h, part in zip(self.handles, self._deal(texts))], phase)
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
