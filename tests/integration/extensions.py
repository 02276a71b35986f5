"""Extensions of reroll written outside it, as a user would: an engine, an objective and a pipeline kind.

Nothing in reroll names them; configs and calls reach them by import path ('tests.integration.
extensions:PlainEngine'), which is how the Ray workers find them too (test_extensions.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field

from reroll.algorithms.objective import AdvantageState, batch_advantages
from reroll.config.algorithm import AlgorithmConfig
from reroll.config.data import DataConfig
from reroll.config.engines import EngineSpec
from reroll.config.rollout import RolloutConfig
from reroll.config.run import RunConfig, register_pipeline_config
from reroll.config.training import SFTConfig
from reroll.data.types import Rollout, TrainBatch, build_train_batch
from reroll.engines.hf import HFEngine
from reroll.pipelines.common import Rows, prompt_sampler, sampling, step_seed, train_mini_batches
from reroll.pipelines.pipeline import Checkpointed, Pipeline, register_pipeline
from reroll.pipelines.roles import Roles
from reroll.roles.objectives import Loss, Policy, PolicyGradient, TokenObjective, rows_inputs


class PlainEngine(HFEngine):
    """transformers' generate under an engine of its own, which says it can do less than hf: it neither
    streams nor takes LoRA adapters."""

    spec = EngineSpec(name="plain", streams=False, lora=False)

    def __init__(
        self, model_path: str, rollout: RolloutConfig, *, dtype: str = "float32", device: str = "cpu"
    ):
        super().__init__(model_path, dtype=dtype, device=device, batch_size=rollout.generate_batch_size)


@dataclass(frozen=True)
class Unlikelihood(TokenObjective):
    """Unlikelihood training (Welleck et al. 2019): -log(1 - p(token)) on the response tokens, token mean
    over the step; it pushes the responses' probabilities down."""

    prefix = "unlikely"
    skipped = "unlikely/nonfinite_skipped"
    loss_key = "unlikely/loss"

    def loss(self, policy: Policy, mb: TrainBatch, batch: TrainBatch) -> Loss:
        logprobs, _ = policy.response_stats(mb, 1.0, entropy=False)
        mask = mb.response_mask.to(logprobs.device)
        p = logprobs.exp().clamp(max=1 - 1e-6)
        value = -(torch.log1p(-p) * mask).sum() / batch.num_tokens
        return Loss(value, {"unlikely/loss": float(value.detach())}, rows_inputs(mb, "unlikelihood"))


ECHO = "tests.integration.extensions:Echo"


@register_pipeline_config
class EchoConfig(RunConfig):
    """Pipeline Echo: GRPO rewarding longer responses, computed in the controller (no reward role)."""

    pipeline: Literal["tests.integration.extensions:Echo"] = Field(ECHO, description="This pipeline.")
    data: DataConfig = Field(description="Prompts and answers.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantages, loss.")
    sft: SFTConfig | None = Field(None, description="A warm start.")

    @property
    def warm_start_steps(self) -> int:
        return self.sft.steps if self.sft is not None else 0

    def _roles(self) -> list[str]:
        return ["actor_train", "actor_infer"]


@register_pipeline
class Echo(Pipeline):
    """Generates, rewards and trains; it never syncs weights itself (the run does), and records how far
    the engine's policy was behind actor_train's when it generated (``echo/version_gap``)."""

    name = ECHO
    evaluate_uses = ()

    def __init__(self, cfg: EchoConfig) -> None:
        super().__init__(cfg)
        self.rows = Rows(cfg)
        self.sampler = prompt_sampler(cfg, self.rows.train)  # by reward domain where there are any
        self.state = AdvantageState.initial(cfg.algorithm)
        self.objective = PolicyGradient(cfg.algorithm, cfg.rollout.temperature or 1.0)

    def texts(self) -> Iterable[str]:
        return self.rows.texts()

    def warm_start(self, roles: Roles) -> None:
        self.rows.warm_start(roles)

    def restore(self, saved: dict[str, Any], directory: Path) -> None:
        self.sampler.restore(saved["sampler"])

    def checkpointed(self) -> Checkpointed:
        return Checkpointed({"sampler": self.sampler.state()})

    def step(self, roles: Roles, step: int) -> dict[str, float]:
        cfg = self.cfg
        prompts = self.sampler.next_batch()
        with roles.phase("generate", "actor_infer"):
            gap = roles.actor_train.weights_version - roles.actor_infer.weights_version
            params = sampling(cfg, n=cfg.rollout.group_size, seed=step_seed(cfg, step))
            groups = roles.actor_infer.generate([s.prompt for s in prompts], params)
        rollouts = [Rollout(s, g, c) for g, (s, comps) in enumerate(zip(prompts, groups)) for c in comps]
        batch = build_train_batch(rollouts, self.rows.tokenizer.pad_token_id)
        # longer is better: a reward that differs within a group from the first step (an untrained
        # model's exact-match rewards are all 0, which would leave nothing to learn)
        lengths = [float(len(r.completion.response_ids)) for r in rollouts]
        batch.rewards = torch.tensor(lengths)
        adv = batch_advantages(cfg.algorithm, batch, self.state)
        batch.advantages, self.state = adv.advantages, adv.state
        with roles.phase("train", "actor_train"):
            train = lambda mb: roles.actor_train.train(mb, self.objective)  # noqa: E731
            metrics = train_mini_batches(cfg, batch, step, train)
        return metrics | {
            "echo/version_gap": float(gap),
            "rollout/response_length": sum(lengths) / len(lengths),
        }
