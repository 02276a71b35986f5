"""SFT: supervised fine-tuning on prompt/target rows through the actor_train role.

The held-out evaluation generates greedily through actor_infer (weights synced first) and scores with
the reward, so SFT and RL runs report the same ``eval/accuracy``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from reroll.config.schema import RunConfig
from reroll.data.datasets import PromptSampler, load_samples
from reroll.models.loading import load_tokenizer
from reroll.pipelines.common import evaluate, load_data, prompt_format, sft_batch, write_synthetic_data
from reroll.pipelines.run import Checkpointed, Pipeline, Roles


class SFT(Pipeline):
    name = "sft"

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        assert cfg.sft is not None  # RunConfig.check guarantees it
        write_synthetic_data(cfg)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.format = prompt_format(cfg, self.tokenizer)
        self.train, self.held_out = load_data(cfg, self.format)
        if cfg.sft.files:
            self.train = load_samples(
                cfg.sft.files,
                template=cfg.data.prompt_template,
                render=self.format.prompt,
                required=[cfg.data.answer_field],
            )
        self.sampler = PromptSampler(
            self.train, cfg.sft.batch_size, seed=cfg.seed + 1, shuffle=cfg.data.shuffle
        )

    @property
    def total_steps(self) -> int:
        assert self.cfg.sft is not None
        return self.cfg.sft.steps

    def texts(self) -> Iterable[str]:
        assert self.cfg.sft is not None
        # as written, not through the chat template (whose special tokens are not characters)
        yield from (s.text for s in [*self.train, *self.held_out])
        yield from [self.cfg.data.system_prompt] if self.cfg.data.system_prompt else []
        yield from (self.cfg.sft.target_template.format(**s.row) for s in self.train)

    def optimizer(self) -> tuple[float, int]:
        assert self.cfg.sft is not None
        return self.cfg.sft.lr, self.cfg.sft.warmup_steps

    def restore(self, saved: dict[str, Any], directory: Path) -> None:
        self.sampler.restore(saved["sampler"])

    def checkpointed(self) -> Checkpointed:
        return Checkpointed({"sampler": self.sampler.state()})

    def step(self, roles: Roles, step: int) -> dict[str, float]:
        assert self.cfg.sft is not None
        with roles.phase("train", "actor_train"):
            batch = sft_batch(self.sampler.next_batch(), self.format, self.cfg.sft.target_template)
            return roles.actor.train_sft(batch)

    def evaluate(self, roles: Roles) -> dict[str, float]:
        return evaluate(self.cfg, roles, self.held_out)
