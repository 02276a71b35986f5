"""What actor_train and reference do with preference pairs (pipelines reward_model and dpo): cut them
into micro-batches and score them, through the same strategy and micro-batching as every other pass;
the losses on them are objectives (``reroll.roles.objectives.BradleyTerry``, ``DirectPreference``).

A pair is never split: ranks get whole pairs (``PairBatch.split``) and micro-batches are cut over pairs
(``PairBatch.proxy``: ``optim.micro_batch_size`` counts pairs, ``max_tokens_per_micro_batch`` both
sequences' tokens). Each micro-batch runs its chosen and rejected rows as one forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from reroll.algorithms.preference import sequence_logprob
from reroll.data.preferences import PairBatch
from reroll.data.transfer import to_device
from reroll.data.types import TrainBatch


class PairWorkerMixin:
    """Pair methods of ``TrainerWorker`` (needs ``StrategyWorker``'s ``_micro_batches``, ``_forward``,
    ``response_stats``, ``strategy`` and ``cfg``)."""

    def pair_micro_batches(self, batch: PairBatch, *, forward_only: bool = False) -> Iterator[PairBatch]:
        # pairs stay whole: a proxy's rows are pairs in order (by_length=False), each cut at pair bounds
        proxies = self.micro_batches(batch.proxy(), forward_only=forward_only, by_length=False)  # type: ignore[attr-defined]
        for proxy in proxies:
            first, last = int(proxy.group_ids[0]), int(proxy.group_ids[-1])
            yield batch.select(slice(first, last + 1))

    def pair_scores(
        self, mb: PairBatch, *, average: bool = False
    ) -> tuple[torch.Tensor, TrainBatch, torch.Tensor | None]:
        """``(2p,)`` scores of the micro-batch's chosen then rejected rows: a reward model's rewards, or a
        causal LM's response log-probs at temperature 1 (summed; ``average``: per token). Also the stacked
        rows and their token log-probs (None for a reward model)."""
        rows = mb.stacked()
        if self.cfg.policy_head == "reward":  # type: ignore[attr-defined]
            out = self.forward(rows)  # type: ignore[attr-defined]
            if out.dim() == 3:  # packed: the head's per-token output, read at each row's last token
                last = to_device(rows.attention_mask.sum(-1) - 1, out.device)
                out = out[torch.arange(len(last), device=out.device), last]
            return out.squeeze(-1).float(), rows, None
        logprobs, _ = self.response_stats(rows, 1.0, entropy=False)  # type: ignore[attr-defined]
        mask = to_device(rows.response_mask, logprobs.device)
        return sequence_logprob(logprobs, mask, average=average), rows, logprobs

    @torch.no_grad()
    def score_pairs(
        self, batch: PairBatch, average: bool = False, base_model: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(P,)`` scores of the chosen and of the rejected responses (see ``pair_scores``);
        ``base_model``: with the LoRA adapters disabled (a LoRA run's reference)."""
        disabled = self.strategy.adapters_disabled() if base_model else contextlib.nullcontext()  # type: ignore[attr-defined]
        chosen, rejected = [], []
        with disabled:
            for mb in self.pair_micro_batches(batch, forward_only=True):
                scores, _, _ = self.pair_scores(mb, average=average)  # kept where computed:
                chosen.append(scores[: len(mb)])  # one copy to the host, at the end
                rejected.append(scores[len(mb) :])
        return torch.cat(chosen).cpu(), torch.cat(rejected).cpu()
