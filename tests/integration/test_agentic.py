"""The agentic pipeline end to end on tiny models: failing environments, resume, and learning Nim."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.runtime.metrics import read_metrics

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


class Countdown:
    """Four turns, any answer. Seeds 4k crash on the third step, 4k+1 hang on the second, 4k+2 win, 4k+3 lose."""

    def reset(self, seed=None):
        self.seed, self.turn = seed, 0
        return "pile 4", {}

    def step(self, action):
        self.turn += 1
        if self.seed % 4 == 0 and self.turn == 3:
            raise RuntimeError("the environment broke on step 3")
        if self.seed % 4 == 1 and self.turn == 2:
            time.sleep(30)
        won = self.turn == 4 and self.seed % 4 == 2
        return f"pile {4 - self.turn}", float(won), self.turn == 4, False, {"success": won}


@pytest.fixture(scope="module")
def game_model(tmp_path_factory):
    from reroll.models.tiny import GAME_ALPHABET, build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("game") / "model", alphabet=GAME_ALPHABET, hidden_size=64, num_heads=2
    )


def _config(tmp_path: Path, model: Path, **over) -> RunConfig:
    cfg = {
        "pipeline": "agentic",
        "name": "a",
        "output_dir": str(tmp_path / "{name}"),
        "total_steps": 1,
        "model": {"path": str(model)},
        "agentic": {"env": "tests.integration.test_agentic:Countdown", "step_timeout_s": 1.0,
                    "eval_episodes": 0, "max_turns": 6},
        "algorithm": {"adv_estimator": "reinforce_pp"},  # whitened over the batch: seed 6 vs seed 7
        "rollout": {"batch_size": 8, "group_size": 2, "max_new_tokens": 2},
        "optim": {"lr": 1e-3, "micro_batch_size": 8},
        "roles": {r: {"torch_threads": 1} for r in ("actor_train", "actor_infer")},
        "logging": {"tensorboard": False, "sample_every": 0},
        "runtime": {"backend": "local"},
    }  # fmt: skip
    for key, value in over.items():
        cfg[key] = {**cfg[key], **value} if isinstance(cfg.get(key), dict) else value
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_config(path, RunConfig, [])


def test_crashing_and_hanging_envs_end_their_episodes_and_the_step_completes(tmp_path, game_model, caplog):
    from reroll.pipelines.agentic import Agentic
    from reroll.pipelines.run import run

    start = time.monotonic()
    result = run(Agentic, _config(tmp_path, game_model))
    assert time.monotonic() - start < 60
    [row] = [r for r in read_metrics(result.run_dir) if r["step"] == 1]
    # step 1 plays seeds 4..7, two episodes each: seed 4 crashes, seed 5 hangs, 6 wins and 7 loses
    assert row["env/errors"] == pytest.approx(0.5) and row["env/timeouts"] == pytest.approx(0.25)
    assert row["env/finish_terminated"] == pytest.approx(0.5)
    assert row["rollout/success"] == pytest.approx(0.25)
    assert "train/skipped" not in row and row["actor/grad_norm"] > 0  # the update ran on the other four
    assert row["filter/kept_samples"] == 4
    errors = [r.getMessage() for r in caplog.records if "environment error" in r.getMessage()]
    assert sum("RuntimeError: the environment broke on step 3" in m for m in errors) == 2
    assert sum("no answer within 1 s" in m for m in errors) == 2
    assert result.checkpoint is not None and (result.checkpoint / "model" / "config.json").exists()


def test_resume_continues_from_the_last_checkpoint(tmp_path, game_model):
    from reroll.pipelines.agentic import Agentic
    from reroll.pipelines.run import run

    over = {"agentic": {"env": "nim", "eval_episodes": 4}, "algorithm": {"adv_estimator": "gigpo"}}
    first = run(Agentic, _config(tmp_path, game_model, **over))
    assert first.checkpoint is not None and first.checkpoint.name == "step_000001"
    second = run(Agentic, _config(tmp_path, game_model, total_steps=2, **over), resume=True)
    assert second.checkpoint is not None and second.checkpoint.name == "step_000002"
    steps = [r["step"] for r in read_metrics(second.run_dir)]
    assert steps == [0, 1, 2]  # no second step-0 evaluation: the run continued
