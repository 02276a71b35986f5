"""DPO and its family (IPO, hinge, robust / conservative DPO, reference-free SimPO) on preference pairs.

Each step actor_train takes one optimizer step on ``preference.batch_size`` pairs; the loss compares
the policy's response log-probs with the reference's (``reroll.algorithms.preference.dpo_loss``). The
reference is the policy the loop starts from (after the optional SFT warm start on
``data.train_files``; with LoRA, the base model with the adapters disabled). With
``dpo.reference: cached`` it scores every training pair once, before step 1, and the cache is saved
in checkpoints; with ``on_the_fly`` it scores each step's pairs. SimPO needs no reference.

Images: a pair's prompt may carry images (``data.image_field``), which its chosen and rejected rows
share; the policy and the reference score both with the prompt's pixels and the model's own 3D positions
(``pair_encoder``), as rlvr's trainer passes do. Rows are not packed for a vision-language model.

Evaluation: with ``data.eval_files``, greedy generations scored by the reward (``eval/accuracy``, as
in sft and rlvr, so the runs compare); with ``preference.eval_files``, the implicit rewards on held-out
pairs (``eval/pair_accuracy``, ``eval/margins``, ``eval/rewards/chosen`` / ``rejected``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from reroll.algorithms.preference import dpo_loss
from reroll.config.schema import RunConfig
from reroll.data.datasets import PromptSampler
from reroll.data.preferences import PairBatch, PreferencePair
from reroll.data.types import Sample
from reroll.models.loading import load_tokenizer
from reroll.pipelines.common import (
    Rows,
    evaluate,
)
from reroll.pipelines.pairs import (
    batches,
    load_preference_data,
    pair_encoder,
    pair_texts,
    write_synthetic_pairs,
)
from reroll.pipelines.pipeline import Checkpointed, Pipeline, register_pipeline
from reroll.pipelines.roles import Roles
from reroll.roles.objectives import DirectPreference
from reroll.roles.trainer import TrainerGroup

SCORE_BATCH = 256  # pairs per reference-scoring call
CACHE_FILE = "dpo_reference.pt"


@register_pipeline
class DPO(Pipeline):
    name = "dpo"

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.settings = cfg.dpo
        self.objective = DirectPreference(cfg.dpo)
        write_synthetic_pairs(cfg)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.pairs, self.held_out_pairs = load_preference_data(cfg, self.tokenizer)
        self.encode = pair_encoder(cfg, self.tokenizer, [*self.pairs, *self.held_out_pairs])
        self.rows = Rows(cfg) if cfg.data is not None else None  # the warm start's, and the held-out
        self.held_out: list[Sample] = self.rows.held_out if self.rows is not None else []
        assert cfg.preference is not None
        self.sampler = PromptSampler(
            list(range(len(self.pairs))),  # type: ignore[arg-type]  # pair indices: the cache is by index
            cfg.preference.batch_size,
            seed=cfg.seed,
            shuffle=cfg.preference.shuffle,
        )
        self.ref_cache: torch.Tensor | None = None  # (N, 2): the reference's log-probs of chosen, rejected
        self.held_out_ref: torch.Tensor | None = None

    def texts(self) -> Iterable[str]:
        yield from pair_texts([*self.pairs, *self.held_out_pairs])
        yield from self.rows.texts() if self.rows is not None else []

    @property
    def step_generates(self) -> bool:
        return False

    def warm_start(self, roles: Roles) -> None:
        if self.rows is not None:
            self.rows.warm_start(roles)

    def restore(self, saved: dict[str, Any], directory: Path) -> None:
        self.sampler.restore(saved["sampler"])
        cache = directory / CACHE_FILE
        self.ref_cache = torch.load(cache) if cache.exists() else None

    def checkpointed(self) -> Checkpointed:
        objects = {} if self.ref_cache is None else {CACHE_FILE: self.ref_cache}
        return Checkpointed({"sampler": self.sampler.state()}, objects)

    def step(self, roles: Roles, step: int) -> dict[str, float]:
        index = torch.tensor(self.sampler.next_batch())
        batch = self.encode([self.pairs[i] for i in index])
        on_the_fly = self.settings.reference == "on_the_fly"
        if self.cfg.needs_reference and (on_the_fly or self.ref_cache is None):
            with roles.phase("reference", self._reference(roles).role):
                if on_the_fly:
                    batch.ref_chosen, batch.ref_rejected = self._reference_scores(roles, [batch])
                else:  # once, before the first step (a resumed run loads it)
                    self.ref_cache = self._reference_cache(roles, self.pairs)
        if self.cfg.needs_reference and not on_the_fly:
            assert self.ref_cache is not None
            batch.ref_chosen, batch.ref_rejected = self.ref_cache[index, 0], self.ref_cache[index, 1]
        with roles.phase("train", "actor_train"):
            return roles.actor_train.train(batch, self.objective)

    def _reference(self, roles: Roles) -> TrainerGroup:
        return roles.reference or roles.actor_train  # a LoRA run's reference: actor_train's base model

    def _reference_scores(
        self, roles: Roles, parts: Iterable[PairBatch]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's response log-probs of the chosen and of the rejected ``(P,)``, over ``parts``
        (called where the reference holds its device)."""
        ref = self._reference(roles)
        scores = [ref.score_pairs(b, base_model=roles.reference is None) for b in parts]
        return torch.cat([c for c, _ in scores]), torch.cat([r for _, r in scores])

    def _reference_cache(self, roles: Roles, pairs: list[PreferencePair]) -> torch.Tensor:
        """``(N, 2)``: the reference's log-probs of every pair's chosen and rejected response."""
        chosen, rejected = self._reference_scores(roles, batches(pairs, self.encode, SCORE_BATCH))
        return torch.stack([chosen, rejected], dim=-1)

    def evaluate(self, roles: Roles) -> dict[str, float]:
        out = evaluate(self.cfg, roles, self.held_out) if self.held_out else {}
        if not self.held_out_pairs:
            return out
        simpo = self.settings.loss == "simpo"
        if self.cfg.needs_reference and self.held_out_ref is None:  # once: the reference does not change
            roles.hold(self._reference(roles).role)
            self.held_out_ref = self._reference_cache(roles, self.held_out_pairs)
        roles.hold("actor_train")
        parts = batches(self.held_out_pairs, self.encode, SCORE_BATCH)
        scores = [roles.actor_train.score_pairs(b, average=simpo) for b in parts]
        chosen, rejected = torch.cat([c for c, _ in scores]), torch.cat([r for _, r in scores])
        ref = self.held_out_ref
        _, m = dpo_loss(
            chosen,
            rejected,
            None if ref is None else ref[:, 0],
            None if ref is None else ref[:, 1],
            loss=self.settings.loss,
            beta=self.settings.beta,
            simpo_gamma=self.settings.simpo_gamma,
        )
        return out | {
            "eval/pair_accuracy": float(m["accuracy"].mean()),
            "eval/margins": float(m["margins"].mean()),
            "eval/rewards/chosen": float(m["rewards/chosen"].mean()),
            "eval/rewards/rejected": float(m["rewards/rejected"].mean()),
        }
