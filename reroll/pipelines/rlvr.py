"""RLVR: reinforcement learning with verifiable rewards (GRPO and the rest of the algorithm zoo).

One controller drives four roles, five with PPO's critic. Each step: actor_infer samples ``group_size``
responses per prompt, reward scores them, reference and actor_train score the tokens, the critic (if
any) gives its values, the algorithm turns rewards into advantages (and the critic's returns),
actor_train and the critic take their optimizer steps, and the new weights go to actor_infer. Every
phase is timed and holds the devices it needs (``reroll.pipelines.run``). An optional SFT warm start
runs first on the same actor_train role.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from reroll.algorithms.correction import mismatch_metrics
from reroll.algorithms.objective import AdvantageResult, AdvantageState, batch_advantages
from reroll.config.schema import RunConfig
from reroll.data.types import RewardItem, Rollout, Sample, TrainBatch, build_train_batch
from reroll.pipelines import headroom
from reroll.pipelines.common import (
    Rows,
    evaluate,
    policy_logprobs,
    prompt_sampler,
    sample_line,
    sampling,
    train_mini_batches,
)
from reroll.pipelines.pipeline import Checkpointed, Pipeline, register_pipeline
from reroll.pipelines.roles import Roles
from reroll.pipelines.rollout_source import QUEUE_FILE, RolloutSource, Scored
from reroll.rewards import routing
from reroll.rewards.base import RewardResult
from reroll.roles.objectives import PolicyGradient


@register_pipeline
class RLVR(Pipeline):
    name = "rlvr"

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.rows = Rows(cfg)
        self.tokenizer, self.held_out = self.rows.tokenizer, self.rows.held_out
        self.sampler = prompt_sampler(cfg, self.rows.train)
        self.source = RolloutSource(cfg, self.sampler)
        self.state = AdvantageState.initial(cfg.algorithm)
        self.objective = PolicyGradient(
            cfg.algorithm, cfg.rollout.temperature or 1.0, cfg.rollout.max_new_tokens
        )
        self.last: tuple[Rollout, RewardResult] | None = None

    def texts(self) -> Iterable[str]:
        yield from self.rows.texts()
        yield from (str(s.row.get("answer", "")) for s in self.rows.train)  # what the reward compares

    def warm_start(self, roles: Roles) -> None:
        self.rows.warm_start(roles)

    def restore(self, saved: dict[str, Any], directory: Path) -> None:
        self.sampler.restore(saved["sampler"])
        self.source.restore(saved.get("rollout_source", {"engine_version": saved.get("step", 0)}), directory)
        self.state = AdvantageState.from_state_dict(torch.load(directory / "algorithm_state.pt"))

    def checkpointed(self) -> Checkpointed:
        objects: dict[str, Any] = {"algorithm_state.pt": self.state.state_dict()}
        if self.source.holds_samples:  # generated ahead (waited for), or set aside for a tail step
            objects[QUEUE_FILE] = self.source.queue_state()
        return Checkpointed({"sampler": self.sampler.state(), "rollout_source": self.source.state()}, objects)

    def evaluate(self, roles: Roles) -> dict[str, float]:
        return evaluate(self.cfg, roles, self.held_out)

    def headroom(self, metrics: dict[str, float]) -> str | None:
        if "eval/accuracy" not in metrics:
            return None
        fit = self.rows.answer_fit(self.held_out)
        cfg = self.cfg
        return headroom.advice(
            metrics["eval/accuracy"], fit, sft_steps=cfg.warm_start_steps, group_size=cfg.rollout.group_size
        )

    def step(self, roles: Roles, step: int) -> dict[str, float]:
        cfg = self.cfg
        scored, source_metrics = self.source.next(roles, step)  # the generate and reward phases
        rollouts, results = scored.rollouts, scored.results
        with roles.phase("reward"):
            batch, domains = self._scored_batch(rollouts, results)
            learned = self._learned_reward(scored, batch)
        if cfg.needs_reference:
            batch.ref_logprobs = policy_logprobs(roles, batch, "reference")
        if _needs_old_logprobs(cfg):
            batch.old_logprobs = policy_logprobs(roles, batch, "old")
        if roles.critic is not None:
            with roles.phase("values", "critic"):
                batch.values = roles.critic.compute_values(batch)
        if cfg.algorithm.needs_greedy_baseline:
            batch.baseline_rewards = self._greedy_rewards(roles, scored.prompts)
        with roles.phase("advantages"):
            adv = self._advantages(batch, rollouts)
            kept = batch.select(adv.keep)
        with roles.phase("train", "actor_train"):
            metrics = train_mini_batches(
                cfg, kept, step, lambda mb: roles.actor_train.train(mb, self.objective)
            )
        if roles.critic is not None:
            with roles.phase("critic", "critic"):
                metrics |= train_mini_batches(cfg, kept, step, roles.critic.train)
        metrics |= self.source.after_update(roles, step)
        self.last = (rollouts[0], results[0])
        return (
            metrics
            | _rollout_metrics(rollouts, results, batch)
            | _token_metrics(cfg, batch, kept)
            | routing.domain_metrics(domains, results, per_domain=bool(cfg.reward.domains))
            | {k: float(v) for k, v in adv.metrics.items()}
            | source_metrics
            | learned
        )

    def _scored_batch(
        self, rollouts: list[Rollout], results: list[RewardResult]
    ) -> tuple[TrainBatch, list[str]]:
        """The rollouts' tensors with their rewards (normalised per domain where the config says)."""
        domains = [routing.route(self.cfg.reward, r.sample.domain) for r in rollouts]
        batch = build_train_batch(rollouts, self.tokenizer.pad_token_id)
        batch = self.rows.with_images(batch, [r.sample for r in rollouts])
        raw = torch.tensor([r.score for r in results], dtype=torch.float32)
        batch.rewards = routing.normalize_by_domain(raw, domains, self.cfg.reward)
        return batch, domains

    def _learned_reward(self, scored: Scored, batch: TrainBatch) -> dict[str, float]:
        """With ``reward.model``: the batch's rewards become weight x the reward model's score (the
        rollout source scored the samples with it) plus rule_weight x reward.fn's (RLHF). Returns the
        reward model's metrics (nothing without one)."""
        rm = self.cfg.reward.model
        if rm is None or not scored.model_scores:
            return {}
        results = scored.results
        scores = torch.tensor(scored.model_scores, dtype=torch.float32)
        truncated = torch.tensor(scored.model_truncated, dtype=torch.float32)
        batch.rewards = rm.weight * scores + rm.rule_weight * batch.rewards
        return {
            "rollout/reward_mean": float(batch.rewards.mean()),  # the training reward, as without one
            "rollout/reward_model_score": float(scores.mean()),
            "rollout/reward_model_score_std": float(scores.std()) if len(scores) > 1 else 0.0,
            "rollout/rule_reward_mean": sum(r.score for r in results) / len(results),
            "reward_model/truncated": float(truncated.mean()),
        }

    def _advantages(self, batch: TrainBatch, rollouts: list[Rollout]) -> AdvantageResult:
        adv = batch_advantages(
            self.cfg.algorithm,
            batch,
            self.state,
            truncated=torch.tensor([r.completion.finish_reason == "length" for r in rollouts]),
            max_response_len=self.cfg.rollout.max_new_tokens,
        )
        batch.advantages, batch.returns, self.state = adv.advantages, adv.returns, adv.state
        return adv

    def _greedy_rewards(self, roles: Roles, prompts: list[Sample]) -> torch.Tensor:
        """ReMax's baseline: the reward of each prompt's greedy response, repeated over its group ``(B,)``."""
        with roles.phase("baseline", "actor_infer"):
            params = sampling(self.cfg, n=1, greedy=True)
            greedy = [
                g[0]
                for g in roles.actor_infer.generate([s.engine_prompt for s in prompts], params, "baseline")
            ]
            results = roles.reward.score(
                [RewardItem.answering(s, c) for s, c in zip(prompts, greedy)], "baseline"
            )
        scores = torch.tensor([r.score for r in results], dtype=torch.float32)
        rm = self.cfg.reward.model
        if rm is not None and roles.learned_reward is not None:  # scored as the samples are
            with roles.phase("baseline", "learned_reward"):
                learned, _ = roles.learned_reward.score(
                    [s.prompt for s in prompts], [c.text for c in greedy], "baseline"
                )
            scores = rm.weight * learned + rm.rule_weight * scores
        return scores.repeat_interleave(self.cfg.rollout.group_size)

    def sample_line(self) -> str | None:
        if self.last is None:
            return None
        rollout, result = self.last
        return sample_line(self.tokenizer, rollout.completion, result.score)


def _needs_old_logprobs(cfg: RunConfig) -> bool:
    """One optimizer step per batch is on-policy: the trainer's log-probs before the step are the old
    ones, so the separate pass is skipped unless the KL-in-reward needs them up front."""
    alg = cfg.algorithm
    on_policy = cfg.optim.ppo_epochs == 1 and cfg.optim.mini_batches == 1
    return not on_policy or (alg.kl_in == "reward" and alg.kl_coef > 0)


def _token_metrics(cfg: RunConfig, batch: TrainBatch, kept: TrainBatch) -> dict[str, float]:
    """The step's token counts, for throughput and model-FLOPs utilisation: ``tokens/generated`` (the
    engine's new tokens), ``tokens/reference`` and ``tokens/old_logprobs`` (prompt and response tokens
    through each forward-only pass that ran) and ``tokens/trained`` (through actor_train's forward and
    backward passes: the rows the advantages kept, once per PPO epoch). Padding is not counted."""
    scored = float(batch.attention_mask.sum())
    out = {
        "tokens/generated": float(batch.response_mask.sum()),
        "tokens/trained": float(kept.attention_mask.sum()) * cfg.optim.ppo_epochs,
    }
    if cfg.needs_reference:
        out["tokens/reference"] = scored
    if _needs_old_logprobs(cfg):
        out["tokens/old_logprobs"] = scored
    return out


def _rollout_metrics(
    rollouts: list[Rollout], results: list[RewardResult], batch: TrainBatch
) -> dict[str, float]:
    n = len(rollouts)
    lengths = batch.response_mask.sum(-1).float()
    out = {
        "rollout/reward_mean": sum(r.score for r in results) / n,  # before any per-domain normalisation
        "rollout/accuracy": sum(routing.is_correct(r) for r in results) / n,
        "rollout/response_length": float(lengths.mean()),
        "rollout/response_length_max": float(lengths.max()),  # a long tail shows here, not in the mean
        "rollout/truncated": sum(r.completion.finish_reason == "length" for r in rollouts) / n,
    }
    # with the engine's log-probs (rollout.logprobs); without old log-probs the trainer measures it
    if batch.old_logprobs is not None and batch.rollout_logprobs is not None:
        out |= mismatch_metrics(batch.old_logprobs, batch.rollout_logprobs, batch.response_mask)
    return out
