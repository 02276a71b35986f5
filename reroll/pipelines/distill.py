"""Distillation: a student (actor_train / actor_infer) learns from frozen teachers (the ``teacher`` role).

``distill.mode: on_policy``: each step the student samples ``rollout.group_size`` responses to each of
``rollout.batch_size / group_size`` prompts, each row's teacher (routed by the row's ``domain``, see
``reroll.config.teacher.teacher_for``) scores every response token, and actor_train minimises the
per-token reverse KL on those samples (``reroll.algorithms.distill.reverse_kl_pg_loss``).

``distill.mode: offline``: before step 1 the teachers compute their top-k next-token log-probs over
every SFT row (prompt + ``sft.target_template``), cached in ``<run dir>/teacher_cache.pt`` (a resumed
run reads it back); each step actor_train minimises the forward KL to them on ``distill.batch_size``
rows, mixed with the cross-entropy by ``distill.ce_weight`` (``forward_kl_topk_loss``).

An optional SFT warm start (``sft.steps``) runs first, as in rlvr. The held-out evaluation is the
shared one (greedy, scored by ``reward.fn``), so ``eval/accuracy`` compares with SFT and RL runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from reroll.config.schema import RunConfig
from reroll.config.teacher import teacher_for
from reroll.data.types import Rollout, Sample, TrainBatch, build_train_batch
from reroll.errors import UserError
from reroll.pipelines.common import (
    Rows,
    evaluate,
    prompt_sampler,
    sample_line,
    train_mini_batches,
)
from reroll.pipelines.pipeline import Checkpointed, Pipeline, register_pipeline
from reroll.pipelines.roles import Roles
from reroll.pipelines.rollout_source import QUEUE_FILE, RolloutSource
from reroll.roles.objectives import Distillation
from reroll.runtime import checkpoint

_CACHE_ROWS = 256  # SFT rows per teacher call while the cache is built


@register_pipeline
class Distill(Pipeline):
    name = "distill"

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        assert cfg.distill is not None and cfg.data is not None  # RunConfig.check guarantees them
        self.rows = Rows(cfg)  # the prompts in the run's format (chat template, system prompt), as rlvr's
        self.tokenizer, self.held_out = self.rows.tokenizer, self.rows.held_out
        self.offline = cfg.distill.mode == "offline"
        # offline: the rows whose targets the teachers score (sft.files where set); on-policy: the prompts
        self.train = self.rows.targets if self.offline else self.rows.train
        for sample in self.train:
            self._route(sample)  # every row has a teacher, checked before any role starts
        self.position = {id(s): i for i, s in enumerate(self.train)}  # offline: a row's cache entry
        self.objective = Distillation(on_policy=not self.offline, ce_weight=cfg.distill.ce_weight)
        if self.offline:
            self.sampler = self.rows.target_sampler(cfg.distill.batch_size, cfg.seed)
        else:
            self.sampler = prompt_sampler(cfg, self.train)
            self.source = RolloutSource(cfg, self.sampler, scores=False)
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] = []  # offline: per row, (n_target, k) each
        self.last: Rollout | None = None

    def _route(self, sample: Sample) -> str:
        assert self.cfg.distill is not None
        try:
            return teacher_for(self.cfg.distill, sample.domain)
        except ValueError as e:
            raise UserError(f"row {sample.uid!r}: {e}") from e

    @property
    def step_generates(self) -> bool:
        return not self.offline

    def texts(self) -> Iterable[str]:
        return self.rows.texts()

    def warm_start(self, roles: Roles) -> None:
        self.rows.warm_start(roles)
        if self.offline:
            self._teacher_cache(roles)

    def restore(self, saved: dict[str, Any], directory: Path) -> None:
        self.sampler.restore(saved["sampler"])
        if not self.offline:
            self.source.restore(
                saved.get("rollout_source", {"engine_version": saved.get("step", 0)}), directory
            )

    def checkpointed(self) -> Checkpointed:
        if self.offline:
            return Checkpointed({"sampler": self.sampler.state()})
        objects = {QUEUE_FILE: self.source.queue_state()} if self.source.holds_samples else {}
        return Checkpointed({"sampler": self.sampler.state(), "rollout_source": self.source.state()}, objects)

    def evaluate(self, roles: Roles) -> dict[str, float]:
        return evaluate(self.cfg, roles, self.held_out)

    def step(self, roles: Roles, step: int) -> dict[str, float]:
        return self._offline_step(roles) if self.offline else self._on_policy_step(roles, step)

    def _on_policy_step(self, roles: Roles, step: int) -> dict[str, float]:
        cfg = self.cfg
        assert roles.teacher is not None and cfg.distill is not None
        scored, source_metrics = self.source.next(roles, step)  # the generate phase (async, tail, ...)
        rollouts = scored.rollouts
        batch = self.rows.with_images(
            build_train_batch(rollouts, self.tokenizer.pad_token_id), [r.sample for r in rollouts]
        )
        owners = [self._route(r.sample) for r in rollouts]
        with roles.phase("teacher", "teacher"):
            if cfg.distill.on_policy_loss == "topk":
                topk = roles.teacher.compute_topk(batch, owners, cfg.distill.top_k)
                batch.teacher_topk_logprobs, batch.teacher_topk_ids = topk
            batch.teacher_logprobs = roles.teacher.compute_logprobs(batch, owners)  # for the metrics too
        with roles.phase("train", "actor_train"):
            metrics = train_mini_batches(
                cfg, batch, step, lambda mb: roles.actor_train.train(mb, self.objective)
            )
        metrics |= self.source.after_update(roles, step)
        self.last = rollouts[0]
        return metrics | _teacher_metrics(batch, owners) | _rollout_metrics(rollouts, batch) | source_metrics

    def _offline_step(self, roles: Roles) -> dict[str, float]:
        if not self.cache:  # a resumed run: read back (or rebuild) the cache
            self._teacher_cache(roles)
        rows = self.sampler.next_batch()
        batch = self._with_cached_teacher(rows, self.rows.target_batch(rows))
        with roles.phase("train", "actor_train"):
            return roles.actor_train.train(batch, self.objective)

    def _teacher_cache(self, roles: Roles) -> None:
        """Every SFT row's teacher top-k log-probs and ids on its target tokens, from the run directory's
        cache when it is there, else computed by the teachers and saved there."""
        assert self.cfg.distill is not None and roles.teacher is not None
        path, k = self.cfg.run_dir / checkpoint.TEACHER_CACHE, self.cfg.distill.top_k
        if path.exists():
            self.cache = torch.load(path)
            if len(self.cache) == len(self.train):
                return
        self.cache = []
        with roles.phase("teacher_cache", "teacher"):
            for a in range(0, len(self.train), _CACHE_ROWS):
                rows = self.train[a : a + _CACHE_ROWS]
                batch = self.rows.target_batch(rows)
                values, ids = roles.teacher.compute_topk(batch, [self._route(s) for s in rows], k)
                for i in range(len(rows)):
                    mask = batch.response_mask[i]
                    self.cache.append((values[i][mask].clone(), ids[i][mask].to(torch.int32)))
        torch.save(self.cache, path)

    def _with_cached_teacher(self, rows: list[Sample], batch: TrainBatch) -> TrainBatch:
        k = self.cache[0][0].shape[-1]
        shape = (*batch.input_ids.shape, k)
        batch.teacher_topk_logprobs = torch.zeros(shape, dtype=torch.float32)
        batch.teacher_topk_ids = torch.zeros(shape, dtype=torch.long)
        for i, s in enumerate(rows):
            values, ids = self.cache[self.position[id(s)]]
            mask = batch.response_mask[i]
            batch.teacher_topk_logprobs[i, mask], batch.teacher_topk_ids[i, mask] = values, ids.long()
        return batch

    def sample_line(self) -> str | None:
        if self.last is None:
            return None
        return sample_line(
            self.tokenizer, self.last.completion, float("nan")
        )  # no reward: the teacher scores


def _teacher_metrics(batch: TrainBatch, owners: list[str]) -> dict[str, float]:
    """Per teacher with several: ``distill/<teacher>/reverse_kl``, the mean over its rows' response tokens
    of log pi_S - log pi_T, pi_S from the engine's sampling log-probs."""
    if len(set(owners)) < 2 or batch.rollout_logprobs is None or batch.teacher_logprobs is None:
        return {}
    gap = (batch.rollout_logprobs - batch.teacher_logprobs) * batch.response_mask
    out = {}
    for name in dict.fromkeys(owners):
        rows = torch.tensor([o == name for o in owners])
        out[f"distill/{name}/reverse_kl"] = float(
            gap[rows].sum() / batch.response_mask[rows].sum().clamp(min=1)
        )
    return out


def _rollout_metrics(rollouts: list[Rollout], batch: TrainBatch) -> dict[str, float]:
    n = len(rollouts)
    return {
        "rollout/response_length": float(batch.response_mask.sum(-1).float().mean()),
        "rollout/truncated": sum(r.completion.finish_reason == "length" for r in rollouts) / n,
    }
