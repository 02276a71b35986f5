"""Reward-model training: a scalar score on (prompt, response), learned from preference pairs.

actor_train holds ``model.path`` as a one-output sequence classifier (``load_reward_model``: the
score of each row's last non-pad token, a new head at zero) and takes one optimizer step per
``preference.batch_size`` pairs on the Bradley-Terry loss (``reward_model.margin`` /
``center_coef``). No engine runs. The held-out evaluation scores ``preference.eval_files``:
``eval/accuracy`` is the pairwise accuracy (chosen scored above rejected). Checkpoints hold the model
in Hugging Face form (``<checkpoint>/model``, with the tokenizer): ``AutoModelForSequenceClassification``
loads it, and the ``reward_model`` reward scores with it. Pairs with images are refused
(``config.vision.image_problems``): transformers builds no sequence-classification head on a
vision-language model.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from reroll.config.schema import RunConfig
from reroll.models.loading import load_tokenizer
from reroll.pipelines.pairs import (
    batches,
    load_preference_data,
    pair_encoder,
    pair_sampler,
    pair_texts,
    reward_pair_metrics,
    write_synthetic_pairs,
)
from reroll.pipelines.pipeline import Checkpointed, Pipeline, register_pipeline
from reroll.pipelines.roles import Roles
from reroll.roles.objectives import BradleyTerry

EVAL_BATCH = 256  # held-out pairs per scoring call


@register_pipeline
class RewardModel(Pipeline):
    name = "reward_model"
    evaluate_uses = ("actor_train",)

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        write_synthetic_pairs(cfg)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.train, self.held_out = load_preference_data(cfg, self.tokenizer)
        self.encode = pair_encoder(cfg, self.tokenizer, [*self.train, *self.held_out])
        self.sampler = pair_sampler(cfg, self.train)
        self.objective = BradleyTerry(cfg.reward_model)

    @property
    def step_generates(self) -> bool:
        return False

    def texts(self) -> Iterable[str]:
        return pair_texts([*self.train, *self.held_out])

    def restore(self, saved: dict[str, Any], directory: Path) -> None:
        self.sampler.restore(saved["sampler"])

    def checkpointed(self) -> Checkpointed:
        return Checkpointed({"sampler": self.sampler.state()})

    def step(self, roles: Roles, step: int) -> dict[str, float]:
        with roles.phase("train", "actor_train"):
            batch = self.encode(self.sampler.next_batch())  # type: ignore[arg-type]
            return roles.actor_train.train(batch, self.objective)

    def evaluate(self, roles: Roles) -> dict[str, float]:
        if not self.held_out:
            return {}
        scores = [roles.actor_train.score_pairs(b) for b in batches(self.held_out, self.encode, EVAL_BATCH)]
        chosen, rejected = torch.cat([c for c, _ in scores]), torch.cat([r for _, r in scores])
        return reward_pair_metrics(chosen, rejected, "eval")
