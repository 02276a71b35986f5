"""After a training step and a sync, actor_infer generates from the trainer's new weights."""

from __future__ import annotations

import pytest
import torch

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.data.datasets import load_samples
from reroll.data.types import Rollout, SamplingParams, build_train_batch
from reroll.models.loading import load_tokenizer
from reroll.pipelines.common import sft_batch
from reroll.roles.actor_infer import EngineGroup
from reroll.roles.objectives import NextToken
from reroll.roles.trainer import TrainerGroup
from reroll.runtime.actors import start_ray
from tests.conftest import write_config

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_engine_logprobs_equal_trainer_after_sync(tmp_path, assets, backend):
    cfg = load_config(write_config(tmp_path / "c.yaml", assets), RunConfig, [f"runtime.backend={backend}"])
    if backend == "ray":
        start_ray(None)
    actor, rollout = TrainerGroup("actor_train", cfg, trainable=True), EngineGroup(cfg)
    try:
        samples = load_samples([str(assets["train"])], template="{question}=")[:8]
        tok = load_tokenizer(cfg.model.path)
        completions = rollout.generate(
            [s.prompt for s in samples], SamplingParams(n=2, max_new_tokens=4, seed=0)
        )
        rollouts = [Rollout(s, i, c) for i, (s, cs) in enumerate(zip(samples, completions)) for c in cs]
        batch = build_train_batch(rollouts, tok.pad_token_id)
        mask = batch.response_mask

        # Before any update both hold the same initial weights, and the engine's sampling log-probs
        # agree with the trainer's forward pass.
        trainer_before = actor.compute_logprobs(batch)
        assert torch.allclose(batch.rollout_logprobs[mask], trainer_before[mask], atol=1e-5)

        actor.configure_optimizer(1e-2, 0)
        actor.train(sft_batch(samples, tok, "{answer}"), NextToken())
        trainer_after = actor.compute_logprobs(batch)
        stale = rollout.score(batch.input_ids, batch.attention_mask, 1.0)
        assert (stale[mask] - trainer_after[mask]).abs().max() > 1e-3  # the update moved the policy

        rollout.load_weight_buckets(actor.weight_buckets(0.05))  # the pipelines' path, layer by layer
        synced = rollout.score(batch.input_ids, batch.attention_mask, 1.0)
        torch.testing.assert_close(synced[mask], trainer_after[mask], atol=1e-6, rtol=0)
    finally:
        actor.shutdown()
        rollout.shutdown()
