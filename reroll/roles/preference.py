"""What actor_train and reference do with preference pairs (pipelines reward_model and dpo): score them and
train on them, through the same strategy, micro-batching and non-finite guard as every other step.

A pair is never split: ranks get whole pairs (``PairBatch.split``) and micro-batches are cut over pairs
(``PairBatch.proxy``: ``optim.micro_batch_size`` counts pairs, ``max_tokens_per_micro_batch`` both
sequences' tokens). Each micro-batch runs its chosen and rejected rows as one forward. The losses are
``reroll.algorithms.preference``'s; each micro-batch's is its pairs' sum over the step's pair count,
so micro-batches and ranks add up to the full batch's mean.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from reroll.algorithms.preference import bradley_terry_loss, dpo_loss, sequence_logprob
from reroll.config.preference import DPOConfig, RewardModelConfig
from reroll.data.preferences import PairBatch
from reroll.data.types import TrainBatch

# metrics averaged over pairs (weighted by each part's pairs when ranks combine); the rest are means
PAIR_WEIGHTED = "pairs"


class PairWorkerMixin:
    """Pair methods of ``TrainerWorker`` (needs ``StrategyWorker``'s ``_micro_batches``, ``_forward``,
    ``_backward``, ``_step``, ``strategy`` and ``cfg``)."""

    def _pair_micro_batches(self, batch: PairBatch, *, forward_only: bool = False) -> Iterator[PairBatch]:
        # pairs stay whole: a proxy's rows are pairs in order (by_length=False), each cut at pair bounds
        proxies = self._micro_batches(batch.proxy(), forward_only=forward_only, by_length=False)  # type: ignore[attr-defined]
        for proxy in proxies:
            first, last = int(proxy.group_ids[0]), int(proxy.group_ids[-1])
            yield batch.select(slice(first, last + 1))

    def _pair_scores(
        self, mb: PairBatch, *, average: bool = False
    ) -> tuple[torch.Tensor, TrainBatch, torch.Tensor | None]:
        """``(2p,)`` scores of the micro-batch's chosen then rejected rows: a reward model's rewards, or a
        causal LM's response log-probs at temperature 1 (summed; ``average``: per token). Also the stacked
        rows and their token log-probs (None for a reward model)."""
        rows = mb.stacked()
        if self.cfg.policy_head == "reward":  # type: ignore[attr-defined]
            out = self._forward(rows)  # type: ignore[attr-defined]
            if out.dim() == 3:  # packed: the head's per-token output, read at each row's last token
                last = rows.attention_mask.sum(-1).to(out.device) - 1
                out = out[torch.arange(len(last), device=out.device), last]
            return out.squeeze(-1).float(), rows, None
        logprobs, _ = self._response_stats(rows, 1.0, entropy=False)  # type: ignore[attr-defined]
        mask = rows.response_mask.to(logprobs.device)
        return sequence_logprob(logprobs, mask, average=average), rows, logprobs

    @torch.no_grad()
    def score_pairs(
        self, batch: PairBatch, average: bool = False, base_model: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(P,)`` scores of the chosen and of the rejected responses (see ``_pair_scores``);
        ``base_model``: with the LoRA adapters disabled (a LoRA run's reference)."""
        disabled = self.strategy.adapters_disabled() if base_model else contextlib.nullcontext()  # type: ignore[attr-defined]
        chosen, rejected = [], []
        with disabled:
            for mb in self._pair_micro_batches(batch, forward_only=True):
                scores, _, _ = self._pair_scores(mb, average=average)
                chosen.append(scores[: len(mb)].cpu())
                rejected.append(scores[len(mb) :].cpu())
        return torch.cat(chosen), torch.cat(rejected)

    def train_pairs(self, batch: PairBatch) -> dict[str, float]:
        """One optimizer step on this rank's pairs: the Bradley-Terry loss of a reward model (pipeline
        reward_model) or the DPO family's (pipeline dpo). Metrics are means over this rank's pairs, with
        their count as ``pairs``."""
        assert batch.num_pairs is not None
        reward = self.cfg.policy_head == "reward"  # type: ignore[attr-defined]
        sums: dict[str, float] = {}
        total = 0.0
        for mb in self._pair_micro_batches(batch):
            loss, metrics = self._rm_loss(mb) if reward else self._dpo_loss(mb)
            loss = loss / batch.num_pairs
            self._backward(loss, mb.chosen, f"{len(mb)} pairs")  # type: ignore[attr-defined]
            total += float(loss.detach())
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach().float().sum())
        pairs = float(len(batch))
        prefix = "rm" if reward else "dpo"
        out = {f"{prefix}/{k}": v / pairs for k, v in sums.items()} | {f"{prefix}/loss": total}
        out |= self._step(prefix, f"{prefix}/nonfinite_skipped")  # type: ignore[attr-defined]
        return out | {PAIR_WEIGHTED: pairs}

    def _rm_loss(self, mb: PairBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        settings = self.cfg.reward_model or RewardModelConfig()  # type: ignore[attr-defined]
        scores, _, _ = self._pair_scores(mb)
        chosen, rejected = scores[: len(mb)], scores[len(mb) :]
        per_pair, m = bradley_terry_loss(
            chosen, rejected, margin=settings.margin, center_coef=settings.center_coef
        )
        both = torch.stack([chosen, rejected], -1).detach()
        m |= {"reward_mean": both.mean(-1), "reward_sq_mean": (both**2).mean(-1)}
        return per_pair.sum(), m

    def _dpo_loss(self, mb: PairBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        settings = self.cfg.dpo or DPOConfig()  # type: ignore[attr-defined]
        simpo = settings.loss == "simpo"
        scores, rows, logprobs = self._pair_scores(mb, average=simpo)
        p = len(mb)
        dev = scores.device
        ref_c = None if mb.ref_chosen is None else mb.ref_chosen.to(dev)
        ref_r = None if mb.ref_rejected is None else mb.ref_rejected.to(dev)
        per_pair, m = dpo_loss(
            scores[:p],
            scores[p:],
            ref_c,
            ref_r,
            loss=settings.loss,
            beta=settings.beta,
            label_smoothing=settings.label_smoothing,
            simpo_gamma=settings.simpo_gamma,
        )
        if settings.sft_weight and logprobs is not None:
            nll = -sequence_logprob(logprobs[:p], rows.response_mask[:p].to(dev), average=True)
            per_pair = per_pair + settings.sft_weight * nll
            m["chosen_nll"] = nll.detach()
        return per_pair.sum(), m


def combine_pair_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The ranks' ``train_pairs`` metrics as one: pair-weighted means, losses summed (each rank's is its
    share of the step's), the optimizer's numbers averaged, and ``*/reward_std`` from the moments."""
    pairs = [p.get(PAIR_WEIGHTED, 1.0) for p in parts]
    n = sum(pairs)
    out: dict[str, float] = {}
    for key in {k for p in parts for k in p} - {PAIR_WEIGHTED}:
        values = [p[key] for p in parts if key in p]
        if key.endswith("/loss"):
            out[key] = sum(values)
        elif key.endswith(("/grad_norm", "/lr", "/nonfinite_skipped", "/peak_memory_gb")):
            out[key] = sum(values) / len(values)
        else:
            out[key] = sum(p[key] * w for p, w in zip(parts, pairs) if key in p) / n
    for prefix in ("rm",):
        if f"{prefix}/reward_sq_mean" in out:
            var = out.pop(f"{prefix}/reward_sq_mean") - out[f"{prefix}/reward_mean"] ** 2
            out[f"{prefix}/reward_std"] = max(var, 0.0) ** 0.5
    return dict(sorted(out.items()))
