"""PPO with a critic: the ppo preset runs end to end and resumes exactly, the critic learns, and is required."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from reroll.algorithms import aggregate, value_loss
from reroll.cli import main
from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.data.datasets import load_samples
from reroll.data.types import TrainBatch
from reroll.models.loading import load_tokenizer
from reroll.pipelines.common import sft_batch
from reroll.rewards.base import RewardResult
from reroll.roles.critic import CriticGroup
from reroll.runtime.metrics import read_metrics
from tests.conftest import step_metrics, write_config
from tests.same_step import RTOL, use_sgd_steps

pytestmark = pytest.mark.integration

CRITIC_METRICS = ("critic/vf_loss", "critic/value_mean", "critic/explained_variance", "critic/vf_clipfrac")


def starts_with_digit(prompt: str, response: str, sample: Mapping[str, Any]) -> RewardResult:
    """1 when the response starts with a digit: an untrained model gets a mix of 0s and 1s."""
    return RewardResult(score=float(response[:1].isdigit()))


def _ppo_config(tmp_path, assets, **sections):
    defaults = {
        "total_steps": 3,
        "algorithm": {"preset": "ppo"},
        "critic": {"lr": 1e-3},
        "reward": {"fn": f"{__name__}:starts_with_digit"},
        "roles": {"critic": {"torch_threads": 1}},
        "eval": {"every": 0},
    }
    return write_config(tmp_path / "c.yaml", assets, **{**defaults, **sections})


@pytest.mark.long  # 45 s in CI; the critic as a Ray actor and test_phases' PPO stay there
def test_ppo_runs_and_resumes_with_the_critic(tmp_path, assets):
    cfg = _ppo_config(tmp_path, assets, checkpoint={"every": 1, "keep_last": 3})
    local = "runtime.backend=local"
    assert main(["train", str(cfg), local, "name=straight"]) == 0
    assert main(["train", str(cfg), local, "name=stopped", "total_steps=2"]) == 0
    assert main(["train", str(cfg), local, "name=stopped", "--resume"]) == 0

    run_dir = tmp_path / "runs" / "straight"
    steps = [m for m in read_metrics(run_dir) if m["step"] > 0]
    assert len(steps) == 3
    for m in steps:
        for key in (*CRITIC_METRICS, "timing/values", "timing/critic", "returns/mean"):
            assert key in m and math.isfinite(m[key]), (m["step"], key)
    # the critic starts at V = 0 and the rewards are not all 0, so it has something to fit
    assert steps[0]["critic/value_mean"] == 0.0
    assert steps[0]["critic/vf_loss"] > 0
    assert steps[-1]["critic/value_mean"] != 0.0
    assert (run_dir / "checkpoints" / "step_000003" / "critic" / "model" / "config.json").exists()

    # the resumed run's step 3 (critic weights and optimizer loaded) is the straight run's
    straight, resumed = step_metrics(run_dir, 3), step_metrics(tmp_path / "runs" / "stopped", 3)
    assert straight.keys() == resumed.keys()
    for key in straight:
        assert resumed[key] == pytest.approx(straight[key], rel=1e-5, abs=1e-6), key


def _fixed_batch(cfg: RunConfig) -> tuple[TrainBatch, torch.Tensor]:
    """32 prompt + answer rows, and returns of +1 on every response token of an odd answer, -1 of an even one."""
    samples = load_samples(cfg.data.train_files, template="{question}=", required=["answer"], limit=32)
    batch = sft_batch(samples, load_tokenizer(cfg.model.path), "{answer}")
    target = torch.tensor([1.0 if int(s.row["answer"]) % 2 else -1.0 for s in samples])
    return batch, torch.where(batch.response_mask, target[:, None], 0.0)


def test_critic_fits_returns_on_a_fixed_batch(tmp_path, assets):
    cfg = load_config(_ppo_config(tmp_path, assets), RunConfig, ["runtime.backend=local"])
    batch, returns = _fixed_batch(cfg)
    critic = CriticGroup(cfg)

    def loss_and_values() -> tuple[float, torch.Tensor]:
        values = critic.compute_values(batch)
        token_loss, _ = value_loss(values, values, returns, batch.response_mask, clip=None)
        return float(aggregate(token_loss, batch.response_mask, mode="token-mean")), values

    before, values = loss_and_values()
    assert before == pytest.approx(0.5)  # V = 0 everywhere: 0.5 * 1^2
    for _ in range(10):  # PPO-style: each step's old values are the critic's values before it
        batch.values, batch.returns = values, returns
        assert math.isfinite(critic.train(batch)["critic/vf_loss"])
        after, values = loss_and_values()
    assert after < 0.7 * before, (before, after)
    critic.shutdown()


def test_micro_batches_add_up_to_the_full_batchstep_metrics(tmp_path, assets):
    # one step over 32 rows in one micro-batch of 32 and in 4 of 8 (each trimmed to its own width):
    # the same loss and the same weights after the step, because each piece divides by the step's tokens.
    # The step is SGD's (tests/same_step.py: Adam's would turn summation noise into lr-sized steps).
    cfg = load_config(_ppo_config(tmp_path, assets), RunConfig, ["runtime.backend=local"])
    batch, returns = _fixed_batch(cfg)
    old_values = 0.3 * torch.randn(returns.shape, generator=torch.Generator().manual_seed(0))
    batch.values, batch.returns = old_values, returns  # V = 0 is outside 0.2 of some: they clip
    results = []
    for size in (32, 8):
        critic = CriticGroup(
            cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"micro_batch_size": size})})
        )
        use_sgd_steps(critic, 0.1)
        results.append((critic.train(batch), critic.compute_values(batch)))
        critic.shutdown()
    (full, full_values), (micro, micro_values) = results
    assert full["critic/vf_clipfrac"] > 0
    assert micro["critic/vf_loss"] == pytest.approx(full["critic/vf_loss"], rel=1e-5)
    assert micro["critic/grad_norm"] == pytest.approx(full["critic/grad_norm"], rel=1e-4)
    mask = batch.attention_mask.bool()  # padding columns are never read (a trimmed micro-batch has fewer)
    moved = float(full_values[mask].abs().max())  # from V = 0: a new head starts at zero
    assert moved > 1e-3
    # the same weights give values within 1e-5; the two steps differ by at most RTOL of their size
    torch.testing.assert_close(micro_values[mask], full_values[mask], rtol=0, atol=1e-5 + RTOL * moved)


def test_ppo_without_a_critic_is_rejected(tmp_path, assets, capsys):
    cfg = write_config(tmp_path / "c.yaml", assets, algorithm={"preset": "ppo"})
    assert main(["validate", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "'gae' needs a critic" in err and "add a critic section" in err

    cfg = write_config(tmp_path / "c.yaml", assets, algorithm={"preset": "grpo"}, critic={})
    assert main(["validate", str(cfg)]) == 2
    assert "a critic is configured but algorithm.adv_estimator 'grpo'" in capsys.readouterr().err


def test_critic_runs_as_a_ray_actor(tmp_path, assets):
    # one step on Ray (no reference: kl_coef 0) with the default reward, which Ray's workers can import
    cfg = _ppo_config(tmp_path, assets, total_steps=1, reward={"fn": "exact_match"})
    assert main(["train", str(cfg), "algorithm.kl_coef=0", "runtime.backend=ray"]) == 0
    [row] = [m for m in read_metrics(tmp_path / "runs" / "t") if m["step"] == 1]
    for key in CRITIC_METRICS:
        assert math.isfinite(row[key]), key
    assert (tmp_path / "runs" / "t" / "checkpoints" / "step_000001" / "critic" / "model").is_dir()
