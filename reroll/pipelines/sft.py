"""SFT: supervised fine-tuning on prompt/target rows through the actor_train role.

The held-out evaluation generates greedily through actor_infer (weights synced first) and scores with
the reward, so SFT and RL runs report the same ``eval/accuracy``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from reroll.config.schema import RunConfig
from reroll.pipelines.common import Rows, evaluate
from reroll.pipelines.pipeline import Checkpointed, LearningRate, Pipeline, register_pipeline
from reroll.pipelines.roles import Roles
from reroll.roles.objectives import NextToken


@register_pipeline
class SFT(Pipeline):
    name = "sft"

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        assert cfg.sft is not None  # RunConfig.check guarantees it
        self.rows = Rows(cfg)
        self.held_out = self.rows.held_out
        self.sampler = self.rows.target_sampler(cfg.sft.batch_size, cfg.seed + 1)

    @property
    def total_steps(self) -> int:
        assert self.cfg.sft is not None
        return self.cfg.sft.steps

    @property
    def step_generates(self) -> bool:
        return False

    def texts(self) -> Iterable[str]:
        return self.rows.texts()

    def learning_rate(self) -> LearningRate:
        assert self.cfg.sft is not None
        return LearningRate(self.cfg.sft.lr, self.cfg.sft.warmup_steps)

    def restore(self, saved: dict[str, Any], directory: Path) -> None:
        self.sampler.restore(saved["sampler"])

    def checkpointed(self) -> Checkpointed:
        return Checkpointed({"sampler": self.sampler.state()})

    def step(self, roles: Roles, step: int) -> dict[str, float]:
        assert self.cfg.sft is not None
        with roles.phase("train", "actor_train"):
            return roles.actor_train.train(self.rows.target_batch(self.sampler.next_batch()), NextToken())

    def evaluate(self, roles: Roles) -> dict[str, float]:
        return evaluate(self.cfg, roles, self.held_out)
