"""What an optimizer step of a trainer minimises: objectives as small objects, one protocol for all.

``TrainerGroup.train(batch, objective)`` splits the batch over the ranks; each rank
(``TrainerWorker.train``) cuts its share into the objective's micro-batches, adds up the objective's
losses through backward, steps the optimizer and reduces the metrics; the group combines the ranks'.
An objective carries its own settings (the algorithm, the distillation or DPO section), so nothing below
it reads the run config to pick a loss, and a new loss family is one class (a test module may define
one: it travels to the workers with each call, so its module must import there).

Losses are the pure functions of ``reroll.algorithms``; an objective only feeds them the policy's
outputs on a micro-batch (``Policy``: the worker's forward helpers).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from reroll.algorithms.aggregation import aggregate
from reroll.algorithms.correction import scored_mismatch
from reroll.algorithms.distill import forward_kl_topk_loss, reverse_kl_pg_loss, reverse_kl_topk_loss
from reroll.algorithms.logprobs import token_log_softmax, token_logprobs, token_logprobs_at
from reroll.algorithms.objective import actor_loss
from reroll.algorithms.preference import bradley_terry_loss, dpo_loss, sequence_logprob
from reroll.config.algorithm import AlgorithmConfig
from reroll.config.preference import DPOConfig, RewardModelConfig
from reroll.data.preferences import PairBatch
from reroll.data.transfer import to_device
from reroll.data.types import TrainBatch
from reroll.roles.strategy_worker import mean_metrics


class Policy(Protocol):
    """What an objective may ask of the trainer rank it runs on."""

    def micro_batches(
        self, batch: TrainBatch, *, forward_only: bool = False, by_length: bool = True
    ) -> list[TrainBatch]: ...

    def response_stats(
        self, mb: TrainBatch, temperature: float, *, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, mb: TrainBatch) -> torch.Tensor: ...

    def pair_micro_batches(self, batch: PairBatch, *, forward_only: bool = False) -> Iterable[PairBatch]: ...

    def pair_scores(
        self, mb: PairBatch, *, average: bool = False
    ) -> tuple[torch.Tensor, TrainBatch, torch.Tensor | None]: ...


@dataclass
class Loss:
    """One micro-batch's share of the step's loss, its metrics, and what it was made of (named in the
    diagnostic of a non-finite loss). The metrics stay scalar tensors where the loss computed them: the
    worker reads every micro-batch's in one copy after the optimizer step (``metrics_to_host``), so the
    micro-batch loop never waits for the GPU."""

    value: torch.Tensor
    metrics: dict[str, torch.Tensor | float]
    inputs: str


class Objective(Protocol):
    """A loss family. ``prefix`` names the optimizer's metrics (``<prefix>/grad_norm``, ``/lr``) and
    ``skipped`` the count of steps skipped for a non-finite loss. ``share``: a micro-batch's weight in
    the step (the shares of every micro-batch of every rank add up to 1), by which a term computed per
    micro-batch, such as a mixture-of-experts router's load-balancing loss, joins its loss."""

    prefix: str
    skipped: str

    def micro_batches(self, policy: Policy, batch: Any) -> Iterable[Any]: ...

    def loss(self, policy: Policy, mb: Any, batch: Any) -> Loss: ...

    def share(self, mb: Any, batch: Any) -> float: ...

    def reduce(self, parts: list[dict[str, float]], batch: Any) -> dict[str, float]: ...

    def combine(self, ranks: list[dict[str, float]]) -> dict[str, float]: ...


def rows_inputs(mb: TrainBatch, stats: str) -> str:
    """A micro-batch of rows as a non-finite loss's diagnostic names it."""
    return f"{len(mb)} rows, {int(mb.response_mask.sum())} response tokens, {stats}"


class TokenObjective:
    """The common shape of objectives over rows: micro-batches of rows, each loss a share of the step's
    token mean (so micro-batches and ranks add up to the full batch's loss); metrics averaged, the
    loss (``loss_key``) summed."""

    prefix = "actor"
    skipped = "train/nonfinite_skipped"
    loss_key = "actor/loss"

    def micro_batches(self, policy: Policy, batch: TrainBatch) -> Iterable[TrainBatch]:
        return policy.micro_batches(batch)

    def share(self, mb: TrainBatch, batch: TrainBatch) -> float:
        """The micro-batch's response tokens over the step's (``batch.num_tokens``)."""
        assert batch.num_tokens is not None
        return float(mb.response_mask.sum()) / batch.num_tokens

    def reduce(self, parts: list[dict[str, float]], batch: TrainBatch) -> dict[str, float]:
        return mean_metrics(parts) | {self.loss_key: sum(p[self.loss_key] for p in parts)}

    def combine(self, ranks: list[dict[str, float]]) -> dict[str, float]:
        return mean_metrics(ranks) | {self.loss_key: sum(p[self.loss_key] for p in ranks)}


@dataclass(frozen=True)
class PolicyGradient(TokenObjective):
    """The RL objective: the algorithm's policy loss (clipping, KL, entropy, off-policy correction) on
    each row's response tokens, at the sampling ``temperature``."""

    algorithm: AlgorithmConfig
    temperature: float = 1.0
    max_response_len: int | None = None

    @classmethod
    def of(cls, cfg: Any) -> PolicyGradient:
        """The objective of a run that reads ``algorithm``: its loss at the sampling temperature, responses
        up to ``rollout.max_new_tokens`` long (the overlong options read it)."""
        return cls(cfg.algorithm, cfg.rollout.temperature or 1.0, cfg.rollout.max_new_tokens)

    def loss(self, policy: Policy, mb: TrainBatch, batch: TrainBatch) -> Loss:
        logprobs, entropy = policy.response_stats(mb, self.temperature, entropy=True)
        if self.algorithm.entropy_coef == 0:  # a metric only: backward skips the entropy's gradient
            entropy = entropy.detach()
        dev = logprobs.device
        on = lambda t: None if t is None else to_device(t, dev)  # noqa: E731
        rollout_logprobs = on(mb.rollout_logprobs)
        value, m = actor_loss(
            self.algorithm,
            logprobs=logprobs,
            old_logprobs=on(mb.old_logprobs),
            advantages=on(mb.advantages),
            response_mask=on(mb.response_mask),
            ref_logprobs=on(mb.ref_logprobs),
            entropy=entropy,
            rollout_logprobs=rollout_logprobs,
            num_tokens=batch.num_tokens,
            num_seqs=batch.num_seqs,
            max_response_len=self.max_response_len,
        )
        if mb.old_logprobs is None and rollout_logprobs is not None:  # on-policy: measured here
            scored = mb.response_mask.reshape(-1).nonzero().squeeze(-1)  # on the host: its size known
            m |= scored_mismatch(logprobs, rollout_logprobs, on(scored)) if scored.numel() else {}
        top = None if mb.advantages is None else float(mb.advantages.abs().max())
        metrics = dict(m) | {"actor/loss": value.detach()}
        return Loss(value, metrics, rows_inputs(mb, f"advantages {top} max abs"))


@dataclass(frozen=True)
class NextToken(TokenObjective):
    """SFT: the next-token loss on the response tokens (token mean over the whole step), temperature 1."""

    prefix = "sft"
    skipped = "sft/nonfinite_skipped"
    loss_key = "sft/loss"

    def loss(self, policy: Policy, mb: TrainBatch, batch: TrainBatch) -> Loss:
        logprobs, _ = policy.response_stats(mb, 1.0, entropy=False)
        mask = to_device(mb.response_mask, logprobs.device)
        value = -(logprobs * mask).sum() / batch.num_tokens
        return Loss(value, {"sft/loss": value.detach()}, rows_inputs(mb, "targets"))


@dataclass(frozen=True)
class Distillation(TokenObjective):
    """Distillation, token mean over the whole step, log-probs at temperature 1, the teacher's. Offline
    (``on_policy`` false): the forward KL to the teacher's top-k (``teacher_topk_*``), mixed with
    ``ce_weight`` of cross-entropy. On-policy: the per-token reverse KL on the student's own samples,
    estimated on the sampled token (``teacher_logprobs``) or exact over the student's distribution where
    the batch carries the teacher's top-k (``distill.on_policy_loss: topk``)."""

    on_policy: bool = True
    ce_weight: float = 0.0
    loss_key = "distill/loss"

    def loss(self, policy: Policy, mb: TrainBatch, batch: TrainBatch) -> Loss:
        logits = policy.forward(mb)
        on = lambda t: to_device(t, logits.device)  # noqa: E731
        ids, mask = on(mb.input_ids), on(mb.response_mask)
        if self.on_policy and mb.teacher_topk_ids is not None:
            token_loss, m = reverse_kl_topk_loss(
                token_log_softmax(logits), on(mb.teacher_topk_logprobs), on(mb.teacher_topk_ids), mask
            )
        elif mb.teacher_topk_ids is not None:
            token_loss, m = forward_kl_topk_loss(
                token_logprobs_at(logits, on(mb.teacher_topk_ids)),
                on(mb.teacher_topk_logprobs),
                token_logprobs(logits, ids),
                mask,
                ce_weight=self.ce_weight,
            )
        else:
            token_loss, m = reverse_kl_pg_loss(token_logprobs(logits, ids), on(mb.teacher_logprobs), mask)
        value = aggregate(token_loss, mask, mode="token-mean", num_tokens=batch.num_tokens)
        teacher = mb.teacher_topk_logprobs if mb.teacher_topk_logprobs is not None else mb.teacher_logprobs
        shown = "none" if teacher is None else f"min {float(teacher.min())}"
        metrics = dict(m) | {"distill/loss": value.detach()}
        return Loss(value, metrics, rows_inputs(mb, f"teacher log-probs {shown}"))


PAIRS = "pairs"  # the metric that counts a rank's pairs (weights its means when ranks combine)


class PairObjective:
    """Objectives over preference pairs: a pair is never split (ranks get whole pairs, micro-batches are
    cut at pair bounds), each micro-batch's loss is its pairs' sum over the step's pair count; metrics
    are means over pairs (weighted by each rank's pairs when ranks combine), losses summed."""

    prefix = "dpo"

    @property
    def skipped(self) -> str:
        return f"{self.prefix}/nonfinite_skipped"

    def micro_batches(self, policy: Policy, batch: PairBatch) -> Iterable[PairBatch]:
        return policy.pair_micro_batches(batch)

    def share(self, mb: PairBatch, batch: PairBatch) -> float:
        """The micro-batch's pairs over the step's (``batch.num_pairs``)."""
        assert batch.num_pairs is not None
        return len(mb) / batch.num_pairs

    def pair_loss(self, policy: Policy, mb: PairBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError

    def loss(self, policy: Policy, mb: PairBatch, batch: PairBatch) -> Loss:
        assert batch.num_pairs is not None
        per_pair, m = self.pair_loss(policy, mb)
        value = per_pair.sum() / batch.num_pairs
        sums = {k: v.detach().float().sum() for k, v in m.items()}
        rows = mb.chosen
        return Loss(value, sums | {"loss": value.detach()}, rows_inputs(rows, f"{len(mb)} pairs"))

    def reduce(self, parts: list[dict[str, float]], batch: PairBatch) -> dict[str, float]:
        pairs = float(len(batch))
        keys = dict.fromkeys(k for p in parts for k in p if k != "loss")
        out = {f"{self.prefix}/{k}": sum(p.get(k, 0.0) for p in parts) / pairs for k in keys}
        return out | {f"{self.prefix}/loss": sum(p["loss"] for p in parts), PAIRS: pairs}

    def combine(self, ranks: list[dict[str, float]]) -> dict[str, float]:
        """The ranks' metrics as one: pair-weighted means, losses summed (each rank's is its share of the
        step's), the optimizer's numbers averaged, and ``*/reward_std`` from the moments."""
        pairs = [p.get(PAIRS, 1.0) for p in ranks]
        n = sum(pairs)
        out: dict[str, float] = {}
        for key in {k for p in ranks for k in p} - {PAIRS}:
            values = [p[key] for p in ranks if key in p]
            if key.endswith("/loss"):
                out[key] = sum(values)
            elif key.endswith(("/grad_norm", "/lr", "/nonfinite_skipped", "/peak_memory_gb")):
                out[key] = sum(values) / len(values)
            else:
                out[key] = sum(p[key] * w for p, w in zip(ranks, pairs) if key in p) / n
        if f"{self.prefix}/reward_sq_mean" in out:
            var = out.pop(f"{self.prefix}/reward_sq_mean") - out[f"{self.prefix}/reward_mean"] ** 2
            out[f"{self.prefix}/reward_std"] = max(var, 0.0) ** 0.5
        return dict(sorted(out.items()))


@dataclass(frozen=True)
class BradleyTerry(PairObjective):
    """A reward model's loss on pairs: -log sigmoid(r_chosen - r_rejected - margin), with centring."""

    settings: RewardModelConfig
    prefix = "rm"

    def pair_loss(self, policy: Policy, mb: PairBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        scores, _, _ = policy.pair_scores(mb)
        chosen, rejected = scores[: len(mb)], scores[len(mb) :]
        per_pair, m = bradley_terry_loss(
            chosen, rejected, margin=self.settings.margin, center_coef=self.settings.center_coef
        )
        both = torch.stack([chosen, rejected], -1).detach()
        return per_pair, m | {"reward_mean": both.mean(-1), "reward_sq_mean": (both**2).mean(-1)}


@dataclass(frozen=True)
class DirectPreference(PairObjective):
    """The DPO family's loss on pairs (``dpo.loss``), against the reference's log-probs the batch carries."""

    settings: DPOConfig
    prefix = "dpo"

    def pair_loss(self, policy: Policy, mb: PairBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        s = self.settings
        scores, rows, logprobs = policy.pair_scores(mb, average=s.loss == "simpo")
        p, dev = len(mb), scores.device
        per_pair, m = dpo_loss(
            scores[:p],
            scores[p:],
            None if mb.ref_chosen is None else to_device(mb.ref_chosen, dev),
            None if mb.ref_rejected is None else to_device(mb.ref_rejected, dev),
            loss=s.loss,
            beta=s.beta,
            label_smoothing=s.label_smoothing,
            simpo_gamma=s.simpo_gamma,
        )
        if s.sft_weight and logprobs is not None:
            nll = -sequence_logprob(logprobs[:p], to_device(rows.response_mask[:p], dev), average=True)
            per_pair = per_pair + s.sft_weight * nll
            m["chosen_nll"] = nll.detach()
        return per_pair, m
