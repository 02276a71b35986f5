"""reroll extended from outside: an engine, an objective and a pipeline kind, each defined in a test module
(``tests/integration/extensions.py``) and run through the Ray path with no other file of reroll changed.

The pipeline kind never syncs weights itself: the run does so before every step that generates, so it
trains on-policy (the engine's log-probs equal the trainer's on every sampled token)."""

from __future__ import annotations

import pytest
import torch

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.data.datasets import load_samples
from reroll.models.loading import load_tokenizer
from reroll.pipelines.common import sft_batch
from reroll.roles.trainer import TrainerGroup
from reroll.runtime.actors import start_ray
from reroll.runtime.metrics import read_metrics
from tests.conftest import QUICKSTART, quickstart_overrides, reroll_here, write_config
from tests.integration.extensions import ECHO, Unlikelihood

pytestmark = pytest.mark.integration

PLAIN = "rollout.engine=tests.integration.extensions:PlainEngine"
SMALL = ["sft.steps=20", "data.eval_limit=32", "rollout.batch_size=64", "optim.micro_batch_size=64"]


def test_an_engine_of_ones_own_runs_the_quickstart(tmp_path):
    run = reroll_here("train", QUICKSTART, *quickstart_overrides(tmp_path, total_steps=2), *SMALL, PLAIN)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "done: quickstart" in run.stdout
    rows = read_metrics(tmp_path / "quickstart")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["rollout/response_length"] > 0 for r in rows[1:])  # the engine generated
    # its spec says it does not stream: over-sampling, which interrupts a stream, is refused up front
    refused = reroll_here(
        "validate",
        QUICKSTART,
        *quickstart_overrides(tmp_path / "v", total_steps=2),
        PLAIN,
        "rollout.oversample=1.0",
    )
    assert refused.returncode == 2
    assert "rollout.oversample: needs an engine that streams" in refused.stdout + refused.stderr


def test_an_objective_of_ones_own_trains_through_ray(tmp_path, assets):
    """Unlikelihood pushes the probability of the rows' responses down: after one step on the Ray
    worker their log-probs are lower, every one of them (lr 0.05 on a 2-layer model moves them by
    about 0.1-1 nats, far above float noise)."""
    cfg = load_config(write_config(tmp_path / "c.yaml", assets), RunConfig)
    start_ray(None)
    samples = load_samples([str(assets["train"])], template="{question}=")[:8]
    batch = sft_batch(samples, load_tokenizer(str(assets["model"])), "{answer}")
    group = TrainerGroup("actor_train", cfg, trainable=True)
    try:
        group.configure_optimizer(5e-2, 0)
        before = group.compute_logprobs(batch)
        metrics = group.train(batch, Unlikelihood())
        after = group.compute_logprobs(batch)
    finally:
        group.shutdown()
    assert metrics["unlikely/loss"] > 0 and metrics["unlikely/grad_norm"] > 0
    assert group.weights_version == 1
    mask = batch.response_mask
    per_row = lambda lp: (lp * mask).sum(-1)  # noqa: E731
    assert torch.all(per_row(after) < per_row(before) - 1e-3), (per_row(before), per_row(after))


def test_a_pipeline_of_ones_own_that_never_syncs_trains_on_policy(tmp_path, assets):
    path = write_config(
        tmp_path / "c.yaml",
        assets,
        pipeline=ECHO,
        total_steps=3,
        optim={"lr": 1e-2, "micro_batch_size": 16},
        logging={"tensorboard": False},
        eval={"every": 0},
    )
    run = reroll_here("train", path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [r for r in read_metrics(tmp_path / "runs" / "t") if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["echo/version_gap"] == 0.0  # the run pushed the weights before the step generated
        # the engine's sampling log-probs against the trainer's on the same tokens, before the update:
        # the same fp32 weights, the same math (KV-cached decode vs one forward: float summation order,
        # ~1e-6), so far below the ~1e-2 a step at lr 1e-2 moves them
        assert r["mismatch/logprob_abs_max"] < 1e-3, r
        assert r["actor/grad_norm"] > 0
