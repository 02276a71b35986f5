"""A non-finite loss or gradient norm skips the optimizer step (nothing changes), is counted, and
``optim.max_nonfinite_steps`` of them in a row stop the run with the batch's statistics."""

from types import SimpleNamespace

import pytest
import torch

from reroll.data.types import TrainBatch
from reroll.roles.objectives import rows_inputs
from reroll.roles.strategy_worker import StrategyWorker
from reroll.strategies.micro_batches import MicroBatchLoop
from reroll.strategies.training import adamw_with_warmup, optimizer_step


class LinearStrategy(MicroBatchLoop):
    """The torch strategy's step (clip, then the finite-norm guarded ``optimizer_step``) on a 2 -> 1 linear."""

    device = torch.device("cpu")  # every strategy names its device (the worker reads it after a step)

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(2, 1)
        params = list(self.model.parameters())
        self.optimizer, self.scheduler = adamw_with_warmup(
            params, lr=0.1, betas=(0.9, 0.999), weight_decay=0.0, warmup_steps=2
        )

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, grad_clip: float) -> dict[str, float]:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip)
        return optimizer_step(self.optimizer, self.scheduler, norm, torch.device("cpu"))


def _worker(limit: int = 3) -> StrategyWorker:
    worker = StrategyWorker.__new__(StrategyWorker)  # the step logic only, around a small model
    worker.role, worker.rank = "actor_train", 0
    worker.cfg = SimpleNamespace(optim=SimpleNamespace(grad_clip=1.0, max_nonfinite_steps=limit))
    worker.nonfinite_in_row, worker._losses = 0, []
    worker.strategy = LinearStrategy()
    return worker


MB = TrainBatch(
    input_ids=torch.zeros(2, 3, dtype=torch.long),
    attention_mask=torch.ones(2, 3, dtype=torch.bool),
    response_mask=torch.tensor([[False, True, True], [False, True, False]]),
    group_ids=torch.arange(2),
)


def _train_step(worker: StrategyWorker, extra: float) -> dict[str, float]:
    """One optimizer step on the loss ``sum(model(x)) + extra``: ``extra`` inf makes the loss inf while
    the gradient stays finite, the case only the loss check catches."""
    loss = worker.strategy.model(torch.ones(2, 2)).sum() + extra
    worker._train_micro_batches([MB], lambda mb: (loss, rows_inputs(mb, "advantages 1.0 max abs"), None))
    return worker._step("actor", "train/nonfinite_skipped")


def test_non_finite_loss_skips_the_step_and_changes_nothing():
    worker = _worker()
    before = [p.detach().clone() for p in worker.strategy.model.parameters()]
    out = _train_step(worker, float("inf"))
    assert out["train/nonfinite_skipped"] == 1.0
    assert out["actor/grad_norm"] != out["actor/grad_norm"]  # nan: the loss's gradients were poisoned
    assert all(torch.equal(a, p) for a, p in zip(before, worker.strategy.model.parameters()))
    assert worker.strategy.optimizer.state == {}  # AdamW never stepped: no moments
    assert worker.strategy.scheduler.last_epoch == 0  # the warm-up schedule did not advance
    assert all(p.grad is None for p in worker.strategy.model.parameters())  # gradients dropped
    assert worker.nonfinite_in_row == 1

    out = _train_step(worker, 0.0)  # a finite step updates and resets the count
    assert out["train/nonfinite_skipped"] == 0.0
    assert not all(torch.equal(a, p) for a, p in zip(before, worker.strategy.model.parameters()))
    assert worker.strategy.scheduler.last_epoch == 1
    assert worker.nonfinite_in_row == 0


def test_non_finite_steps_in_a_row_stop_with_the_batch_statistics():
    worker = _worker(limit=3)
    for _ in range(2):
        assert _train_step(worker, float("nan"))["train/nonfinite_skipped"] == 1.0
    with pytest.raises(FloatingPointError) as e:
        _train_step(worker, float("nan"))
    message = str(e.value)
    assert "3 optimizer steps in a row" in message and "optim.max_nonfinite_steps=3" in message
    assert "loss nan on a micro-batch of 2 rows, 3 response tokens, advantages 1.0 max abs" in message


def test_a_non_finite_gradient_with_a_finite_loss_is_skipped_too():
    worker = _worker()
    worker.strategy.model.weight.register_hook(lambda g: torch.full_like(g, float("inf")))  # an overflow
    loss = worker.strategy.model(torch.ones(2, 2)).sum()
    worker._train_micro_batches([MB], lambda mb: (loss, rows_inputs(mb, "advantages 1.0 max abs"), None))
    out = worker._step("actor", "train/nonfinite_skipped")
    assert out["train/nonfinite_skipped"] == 1.0 and worker._losses == []


def test_a_finite_losss_gradients_are_those_of_its_plain_backward():
    """``_train_micro_batches`` multiplies a finite loss by a factor 1 chosen on the device (no wait for the loss's
    value): exact, so the gradients equal ``loss.backward()``'s bit for bit, and nothing is noted."""
    worker, plain = _worker(), LinearStrategy()
    x = torch.tensor([[0.3, -1.7], [2.1, 0.4]])
    worker._train_micro_batches([x], lambda x: (worker.strategy.model(x).pow(3).sum(), "rows", None))
    plain.model(x).pow(3).sum().backward()
    for a, b in zip(worker.strategy.model.parameters(), plain.model.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert [inputs for _, inputs in worker._losses] == ["rows"]  # kept for a skipped step's diagnostic
