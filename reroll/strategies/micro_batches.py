"""How a strategy runs the micro-batches of one optimizer step, or of one forward-only pass, given all of
them at once with the function that makes each one's loss (or output).

Every strategy runs them one after the other (``MicroBatchLoop``): ``loss_of(mb)`` runs the forward
(it calls the strategy's ``logits`` once, for ``mb``'s rows) and returns the loss to backpropagate and a
record the caller keeps (its metrics); the loss's backward follows at once. A strategy may run them
otherwise where it gets the same gradients: Megatron's pipeline stages run a 1F1B schedule over them
(``reroll.strategies.megatron_pipeline``), the last stage computing every rank's loss from its rows'
logits. So ``loss_of`` must read nothing but ``mb``, the logits ``logits`` hands it, and what every rank
holds alike (the step's counts, the objective), and may run on another rank of the model's group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from reroll.models.moe import StepRouting

MB = TypeVar("MB")
Record = TypeVar("Record")


@dataclass(frozen=True)
class RouterLoss:
    """A mixture of experts' load-balancing term over a step: ``routing`` adds each micro-batch's (of its
    routers' logits in that micro-batch's forward), weighted by its share of the step (``shares``, one a
    micro-batch), to its loss, and keeps the statistics."""

    routing: StepRouting
    shares: Sequence[float]


class MicroBatchLoop:
    """Micro-batches one after the other: forward and loss, then backward, for each in turn."""

    def train_micro_batches(
        self: Any,
        batches: Sequence[MB],
        loss_of: Callable[[MB], tuple[torch.Tensor, Record]],
        router: RouterLoss | None = None,
    ) -> list[Record]:
        """Backpropagate every micro-batch's loss (gradients summed into the step's), ``router``'s term
        added; each one's record, in order."""
        records = []
        for i, mb in enumerate(batches):
            with router.routing.routers.capture() if router else contextlib.nullcontext() as routed:
                loss, record = loss_of(mb)
            if router is not None:
                term = router.routing.term(routed, router.shares[i])
                loss = loss if term is None else loss + term.to(loss.device)
            self.backward(loss)
            records.append(record)
        return records

    def score_micro_batches(self, batches: Sequence[MB], output_of: Callable[[MB], Record]) -> list[Record]:
        """``output_of(mb)`` of every micro-batch of a forward-only pass (no gradient), in order."""
        return [output_of(mb) for mb in batches]
