"""SFT through the CLI learns the task; checkpoints load with transformers and give the trainer's log-probs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from reroll.cli import main
from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.data.datasets import load_samples
from reroll.models.loading import load_tokenizer, sequence_logprobs
from reroll.pipelines.common import sft_batch
from reroll.pipelines.pipeline import Checkpointed
from reroll.pipelines.run_dir import save_checkpoint
from reroll.roles.objectives import NextToken
from reroll.roles.trainer import TrainerGroup
from reroll.runtime import checkpoint
from reroll.runtime.metrics import read_metrics
from tests.conftest import write_config

pytestmark = pytest.mark.integration


def test_sft_pipeline_improves_accuracy(tmp_path, assets, capsys):
    cfg = write_config(
        tmp_path / "c.yaml",
        assets,
        pipeline="sft",
        name="sft",
        sft={"steps": 60, "batch_size": 32, "lr": 3e-3},
        eval={"every": 30},
        data={"eval_limit": 64},
    )
    assert main(["train", str(cfg), "runtime.backend=local"]) == 0
    rows = read_metrics(tmp_path / "runs" / "sft")
    assert [r["step"] for r in rows] == list(range(61))  # step 0: the model before training, evaluated
    losses = [r["sft/loss"] for r in rows[1:]]
    assert losses[-1] < 0.5 * losses[0]  # next-token loss on the answers at least halves
    assert rows[0]["eval/accuracy"] == 0.0 < rows[-1]["eval/accuracy"]  # from 0 for a random model
    assert checkpoint.latest(tmp_path / "runs" / "sft").name == "step_000060"
    # the summary's model line is the directory from_pretrained loads (model and tokenizer)
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("model:")]
    printed = Path(line.split()[1])
    assert printed == checkpoint.latest(tmp_path / "runs" / "sft") / "model"
    assert AutoModelForCausalLM.from_pretrained(printed).num_parameters() > 0
    assert load_tokenizer(str(printed)).chat_template  # the chat template travels with the model


def test_checkpoint_loads_in_transformers_with_trainer_logprobs(tmp_path, assets):
    cfg = load_config(write_config(tmp_path / "c.yaml", assets), RunConfig, ["runtime.backend=local"])
    actor = TrainerGroup("actor_train", cfg, trainable=True)
    samples = load_samples([str(assets["train"])], template="{question}=")[:8]
    batch = sft_batch(samples, load_tokenizer(cfg.model.path), "{answer}")
    actor.configure_optimizer(1e-2, 0)
    actor.train(batch, NextToken())  # move away from the initial weights
    expected = actor.compute_logprobs(batch)
    ckpt = save_checkpoint(cfg, actor, 1, Checkpointed({"sampler": {"epoch": 0, "index": 0}}))

    model = AutoModelForCausalLM.from_pretrained(ckpt / "model")
    got = sequence_logprobs(model, batch.input_ids, batch.attention_mask)
    mask = batch.response_mask
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-6, rtol=0)
    assert load_tokenizer(str(ckpt / "model")).encode("12+3=", add_special_tokens=False) == load_tokenizer(
        cfg.model.path
    ).encode("12+3=", add_special_tokens=False)
