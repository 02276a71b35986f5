"""A non-finite loss stops the run with the batch statistics."""

import pytest
import torch

from reroll.data.types import TrainBatch
from reroll.roles.strategy_worker import StrategyWorker


def test_trainer_stops_on_non_finite_loss_with_batch_stats():

    mb = TrainBatch(
        input_ids=torch.zeros(2, 3, dtype=torch.long),
        attention_mask=torch.ones(2, 3, dtype=torch.bool),
        response_mask=torch.tensor([[False, True, True], [False, True, False]]),
        group_ids=torch.arange(2),
    )
    worker = StrategyWorker.__new__(StrategyWorker)  # only the check, no model
    worker.role, worker.rank = "actor_train", 0
    with pytest.raises(
        FloatingPointError, match=r"actor_train\[0\] loss is nan .* 2 rows, 3 response tokens"
    ):
        worker._check_finite(torch.tensor(float("nan")), mb, "advantages 1.0 max abs")
