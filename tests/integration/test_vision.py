"""A vision-language policy through the roles: the hf engine's log-probs for image prompts equal the
trainers' (torch and fsdp2), the model's 3D positions are what makes them equal, and a trained vision
tower reaches the engine through weight sync (a frozen one is sent once).

Tolerance: both sides run the same fp32 model on the same tokens and pixels; they differ in padding side
(the engine pads left, the trainer right), batch composition and so summation order. A log-prob is a
log-softmax of logits that ~10 fp32 reductions over 64-128 terms produced, each rounding at float32's
eps (1.2e-7) relative to values of order 1-10: differences of order 1e-6 (2.4e-7 measured). ATOL = 1e-5
holds that with a margin; a wrong position scheme (1D positions on image tokens) moves them by ~1e-3,
which the test checks it would catch.
"""

from __future__ import annotations

import json

import pytest
import torch

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.data.chat import PromptFormat
from reroll.data.datasets import load_samples
from reroll.data.shapes import SHAPES_ALPHABET, make_shapes_rows
from reroll.data.types import Rollout, SamplingParams, build_train_batch
from reroll.models.loading import load_causal_lm, load_tokenizer, position_ids_from
from reroll.models.tiny_vision import build_tiny_vl_model
from reroll.models.vision import VisionProcessor
from reroll.pipelines.common import sft_batch, with_images
from reroll.roles.actor_infer import EngineGroup
from reroll.roles.objectives import NextToken
from reroll.roles.trainer import TrainerGroup

pytestmark = pytest.mark.integration

ATOL = 1e-5


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl")
    model = build_tiny_vl_model(root / "model", alphabet=SHAPES_ALPHABET)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_shapes_rows(6, seed=3)))
    cfg = {
        "pipeline": "rlvr",
        "output_dir": str(root / "runs" / "{name}"),
        "model": {"path": str(model), "train_vision": True},
        "data": {"train_files": [str(root / "train.jsonl")], "prompt_template": "{question}"},
        "rollout": {"batch_size": 12, "group_size": 2, "max_new_tokens": 3, "generate_batch_size": 5},
        "optim": {"lr": 1e-2, "micro_batch_size": 5},
        "runtime": {"backend": "local"},
        "logging": {"tensorboard": False},
    }
    (root / "c.yaml").write_text(json.dumps(cfg))
    tok = load_tokenizer(str(model))
    samples = load_samples(
        [str(root / "train.jsonl")],
        template="{question}",
        render=PromptFormat(tok).prompt,
        image_field="images",
    )
    return root / "c.yaml", samples, VisionProcessor(str(model), tok)


def _rollout_batch(engine, samples, vision, seed=0):
    groups = engine.generate(
        [s.engine_prompt for s in samples], SamplingParams(n=2, max_new_tokens=3, seed=seed)
    )
    rollouts = [Rollout(s, i, c) for i, (s, g) in enumerate(zip(samples, groups)) for c in g]
    batch = build_train_batch(rollouts, vision.tokenizer.pad_token_id)
    return with_images(batch, [r.sample for r in rollouts], vision, "float32")


def test_engine_logprobs_of_image_prompts_equal_the_trainers(vl):
    path, samples, vision = vl
    cfg = load_config(path, RunConfig)
    engine = EngineGroup(cfg)
    trainers = {
        s: TrainerGroup("actor_train", load_config(path, RunConfig, [f"strategy.name={s}"]), trainable=True)
        for s in ("torch", "fsdp2")
    }
    try:
        batch = _rollout_batch(engine, samples, vision)
        mask = batch.response_mask
        assert int((batch.input_ids == vision.image_token_id).sum()) == 12 * 16  # every row's image, expanded
        assert not (batch.input_ids[mask] == vision.image_token_id).any()  # never sampled
        for name, trainer in trainers.items():
            ours = trainer.compute_logprobs(batch)
            torch.testing.assert_close(ours[mask], batch.rollout_logprobs[mask], atol=ATOL, rtol=0, msg=name)

        # the 3D positions are what makes them equal: 1D positions on the image tokens move them past ATOL
        model = load_causal_lm(cfg.model.path)
        images = batch.images()
        flat = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=position_ids_from(batch.attention_mask),
            pixel_values=images.pixel_values,
            image_grid_thw=images.image_grid_thw,
        ).logits
        wrong = torch.log_softmax(flat[:, :-1].float(), -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
        assert (wrong[mask[:, 1:]] - batch.rollout_logprobs[mask]).abs().max() > 20 * ATOL
    finally:
        engine.shutdown()
        for t in trainers.values():
            t.shutdown()


@pytest.mark.parametrize("train_vision", [True, False])
def test_weight_sync_carries_the_vision_tower_when_it_trains(vl, train_vision):
    path, samples, vision = vl
    cfg = load_config(path, RunConfig, [f"model.train_vision={str(train_vision).lower()}"])
    engine, actor = EngineGroup(cfg), TrainerGroup("actor_train", cfg, trainable=True)
    try:
        first = actor.weight_buckets(0.05).tensors()  # everything at the first sync
        assert any(".visual." in n for n in first)
        actor.configure_optimizer(1e-2, 0)
        actor.train(sft_batch(samples, PromptFormat(vision.tokenizer), "{answer}", vision), NextToken())
        engine.load_weight_buckets(actor.weight_buckets(0.05))
        sent = actor.weight_buckets(0.05).tensors()
        assert any(".visual." in n for n in sent) == train_vision  # a frozen tower is not sent again
        batch = _rollout_batch(engine, samples, vision, seed=1)
        mask = batch.response_mask
        torch.testing.assert_close(
            actor.compute_logprobs(batch)[mask], batch.rollout_logprobs[mask], atol=ATOL, rtol=0
        )
    finally:
        engine.shutdown()
        actor.shutdown()
