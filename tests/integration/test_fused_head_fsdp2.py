"""The fused head under FSDP2: two ranks over gloo, each computing the response tokens' log-probs and
entropy inside its sharded lm_head's call (``fused_head_at``, ``model.fused_head: true``), take the steps one FSDP2
rank takes on the logits path (``fused_head`` off: ``head_at``'s ``(1, K, V)`` logits).

The root unit (embeddings, final norm, the tied head) is resharded after forward
(``strategy.fsdp2.reshard_after_forward``, the default), so the head's weight the fused backward reads
is the one FSDP2 gathers again when the gradient reaches the head's output. Losses: a log-prob pass, an
SFT step and an RL step with an entropy bonus (the entropy's gradient through the fused head too).

The steps compared are SGD steps of the same AdamW, within the float32 bound ``tests/same_step.py``
derives: the two sides differ in summation order alone (rows split over two ranks, the head's matmuls in
chunks). Log-probs: as ``tests/integration/test_context_parallel.py`` says, ``|a - b| <= RTOL *
max|log-prob|``.
"""

from __future__ import annotations

import socket

import pytest
import torch

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.data.types import TrainBatch
from reroll.models.loading import load_causal_lm
from reroll.roles.objectives import NextToken, PolicyGradient
from tests.conftest import write_config
from tests.integration import test_fsdp2 as fsdp2_test
from tests.same_step import EPS, RTOL, assert_same_steps, sgd_eps

# long (35 s on 2 cores): in CI the fused head's values and gradients equal the logits path's
# (tests/unit/test_linear_logprobs.py) and the torch strategy's packed step takes it
# (tests/integration/test_packed_training.py); the fused head is off by default since 2026-12-07, so
# this is the one test of it under FSDP2's resharding
pytestmark = [pytest.mark.integration, pytest.mark.long]

ETA = 0.1  # SGD's learning rate (gradients clipped to norm 1)
FSDP2 = [
    "strategy.name=fsdp2",
    "optim.micro_batch_size=4",
    "algorithm.entropy_coef=0.01",
    "model.fused_head=true",  # the pair; the single rank takes the logits path (FSDP2Strategy.fused_head off)
]


batch = fsdp2_test.batch  # test_fsdp2's fixture: its rows, with seeded advantages


def _steps(worker, batch) -> dict:
    """A log-prob pass, an SFT step and an RL step through ``worker``, and the shapes its head returned."""
    shapes: list[tuple[int, ...]] = []
    head = worker.strategy.hf_model.get_output_embeddings()
    head.register_forward_hook(lambda _m, _i, out: shapes.append(tuple(out.shape)))
    worker.configure_optimizer(ETA * EPS, 0)
    assert sgd_eps(worker.strategy) > 0  # its steps: SGD's at ETA (tests/same_step.py)
    out = {"logprobs": worker.compute_logprobs(batch)}
    out["sft"] = worker.train(batch, NextToken())
    out["rl"] = worker.train(batch, PolicyGradient.of(worker.cfg))
    out["weights"] = worker.strategy.full_state_dict()
    return out | {"shapes": shapes}


def _rank(rank: int, address: str, path: str, batch, result_dir: str) -> None:
    from reroll.roles.trainer import TrainerWorker

    cfg = load_config(path, RunConfig, [*FSDP2, "roles.actor_train.world_size=2", "runtime.backend=ray"])
    worker = TrainerWorker("actor_train", rank, cfg, True)
    worker.init_distributed(address)
    torch.save(_steps(worker, batch.split(2)[rank]), f"{result_dir}/rank{rank}.pt")


def test_two_fsdp2_ranks_with_the_fused_head_equal_one_on_the_logits_path(
    tmp_path, assets, batch, monkeypatch
):
    import torch.multiprocessing as mp

    from reroll.roles.trainer import TrainerWorker
    from reroll.strategies.fsdp2 import FSDP2Strategy

    path = write_config(tmp_path / "c.yaml", assets)
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{so.getsockname()[1]}"
    pair = mp.start_processes(
        _rank, args=(address, str(path), batch, str(tmp_path)), nprocs=2, start_method="spawn", join=False
    )
    cfg = load_config(path, RunConfig, [*FSDP2, "runtime.backend=local"])
    monkeypatch.setattr(FSDP2Strategy, "fused_head", False)  # this process only: the pair runs fused
    one = _steps(TrainerWorker("actor_train", 0, cfg, True), batch)  # while the pair starts
    while not pair.join():
        pass
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    # the fused head ran on both ranks (one log-prob a scored token, no vocabulary axis), the
    # reference on the logits; three passes each (log-probs, SFT, RL), one a micro-batch
    initial = load_causal_lm(cfg.model.path)
    vocab = initial.config.vocab_size
    assert one["shapes"] and all(len(s) == 3 and s[2] == vocab for s in one["shapes"])
    for r in ranks:
        assert r["shapes"] and all(len(s) == 2 for s in r["shapes"])
    responses = int(batch.response_mask.sum())
    assert sum(s[1] for r in ranks for s in r["shapes"]) == sum(s[1] for s in one["shapes"]) == 3 * responses

    lp = TrainBatch.concat([r["logprobs"] for r in ranks], width=batch.input_ids.shape[1])
    assert (one["logprobs"] != 0).sum() > 10
    torch.testing.assert_close(lp, one["logprobs"], rtol=0, atol=RTOL * float(one["logprobs"].abs().max()))
    for key, loss, prefix in (("sft", "sft/loss", "sft"), ("rl", "actor/loss", "actor")):
        assert sum(r[key][loss] for r in ranks) == pytest.approx(one[key][loss], rel=1e-5, abs=1e-7), key
        for r in ranks:  # the global norm, the same on each rank
            assert r[key][f"{prefix}/grad_norm"] == pytest.approx(one[key][f"{prefix}/grad_norm"], rel=1e-5)
    assert ranks[1]["weights"] == {}  # rank 0 gathers them
    assert_same_steps(one["weights"], ranks[0]["weights"], initial.state_dict(), steps=2)
