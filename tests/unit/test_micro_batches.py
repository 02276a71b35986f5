"""A step's micro-batches handed to the strategy together (``Strategy.train_micro_batches``): the loop
every strategy runs, and the pieces of Megatron's pipeline schedule that need no process group (the
schedule itself runs on spawned gloo ranks: ``tests/integration/test_megatron_pipeline.py``, ``-m long``)."""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest
import torch

from reroll.strategies.megatron_pipeline import Handed, _on_host
from reroll.strategies.micro_batches import MicroBatchLoop


class _Recording(MicroBatchLoop):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def backward(self, loss: torch.Tensor) -> None:
        self.calls.append(f"backward {float(loss.detach())}")
        loss.backward()


def test_the_loop_backpropagates_each_loss_before_the_next_forward_and_keeps_the_records_in_order():
    w = torch.ones((), requires_grad=True)
    s = _Recording()

    def loss_of(mb: float) -> tuple[torch.Tensor, str]:
        s.calls.append(f"loss {mb}")
        return w * mb, f"record {mb}"

    assert s.train_micro_batches([1.0, 2.0, 3.0], loss_of) == ["record 1.0", "record 2.0", "record 3.0"]
    assert s.calls == ["loss 1.0", "backward 1.0", "loss 2.0", "backward 2.0", "loss 3.0", "backward 3.0"]
    assert float(w.grad) == 6.0  # summed over the micro-batches
    assert s.score_micro_batches([1, 2], lambda mb: mb * 10) == [10, 20]


def test_the_loop_adds_each_micro_batchs_router_term_from_the_routers_its_forward_ran():
    import contextlib

    from reroll.strategies.micro_batches import RouterLoss

    w = torch.ones((), requires_grad=True)
    s, seen = _Recording(), []

    class Routing:  # StepRouting's part the loop uses: its routers' capture and the term
        class routers:
            @staticmethod
            @contextlib.contextmanager
            def capture():
                seen.append("capture")
                yield "routed"
                seen.append("released")

        @staticmethod
        def term(routed: str, share: float) -> torch.Tensor:
            seen.append((routed, share))
            return w * share

    def loss_of(mb: float) -> tuple[torch.Tensor, None]:
        seen.append(f"forward {mb}")
        return w * mb, None

    s.train_micro_batches([1.0, 2.0], loss_of, RouterLoss(Routing(), [0.25, 0.75]))
    first = ["capture", "forward 1.0", "released", ("routed", 0.25)]
    assert seen == [*first, "capture", "forward 2.0", "released", ("routed", 0.75)]
    assert s.calls == ["backward 1.25", "backward 2.75"]  # each loss with its term
    assert float(w.grad) == 1.0 + 0.25 + 2.0 + 0.75


def test_a_scheduled_loss_gets_its_rows_logits_cut_to_its_width_and_no_other_rows():
    rows = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])  # a member's rows among the group's: padded to 4
    logits = torch.arange(2 * 4 * 3.0).reshape(2, 4, 3)
    assert torch.equal(Handed(logits, rows)(rows[:, :3]), logits[:, :3])
    for other in (rows[:1, :3], torch.tensor([[5, 6, 7], [8, 1, 0]])):  # fewer rows; another token
        with pytest.raises(RuntimeError, match="other rows than the micro-batch's input_ids"):
            Handed(logits, rows)(other)


def test_records_go_back_to_their_rank_on_the_host_detached():
    w = torch.ones(2, requires_grad=True)
    sent = _on_host([(w * 2, "rows 3", {"actor/loss": w.sum(), "n": 4})])
    ((value, inputs, metrics),) = sent
    assert not value.requires_grad and torch.equal(value, torch.tensor([2.0, 2.0]))
    assert inputs == "rows 3" and metrics["n"] == 4 and not metrics["actor/loss"].requires_grad


@dataclass
class _MB:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def test_megatron_schedules_only_what_it_can_the_same_on_every_rank():
    pytest.importorskip("megatron.core")
    from reroll.strategies.megatron import MegatronStrategy

    mb = _MB(torch.ones(1, 2), torch.ones(1, 2))

    def strategy(**state) -> MegatronStrategy:
        s = MegatronStrategy.__new__(MegatronStrategy)
        vars(s).update({"pipe": object(), "context_parallel": None, "moe_routers": None} | state)
        return s

    assert strategy()._schedules([mb, mb])
    assert not strategy(pipe=None)._schedules([mb])  # one stage: nothing to overlap
    # context parallelism: a dense model's columns are gathered inside the scheduled loss; a mixture of
    # experts' router term pools the group's columns, not yet under the schedule
    assert strategy(context_parallel=object())._schedules([mb])
    assert not strategy(context_parallel=object(), moe_routers=object())._schedules([mb])
    assert strategy(moe_routers=object())._schedules([mb])
    assert not strategy()._schedules([types.SimpleNamespace(chosen=mb)])  # pairs: no input_ids
