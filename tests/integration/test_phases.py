"""Phases own their devices: with every model role on one device and offloading always, no call into
a role finds that role offloaded, in any pipeline; and a phase that forgets a role is refused.

The workers run in this process (``runtime.backend=local``), each wrapped so that every call records
the role, the method and whether the worker was offloaded at that moment; the record is the workers'
own, not the driver's bookkeeping.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path

import pytest
import yaml

from reroll.cli import main
from reroll.roles.actor_infer import EngineWorker
from reroll.roles.critic import CriticWorker
from reroll.roles.learned_reward import LearnedRewardWorker
from reroll.roles.teacher import TeacherWorker
from reroll.roles.trainer import TrainerWorker
from reroll.runtime.metrics import read_metrics
from tests.conftest import write_config

pytestmark = pytest.mark.integration

COLOCATED = ["runtime.backend=local", "placement.devices=1", "placement.offload=always"]


@pytest.fixture
def calls(monkeypatch) -> list[tuple[str, str, bool]]:
    """(role, method, offloaded at the call) for every call into a model role's worker."""
    record: list[tuple[str, str, bool]] = []

    def wrap(cls: type, name: str, fn):
        @functools.wraps(fn)
        def recorded(self, *args, **kwargs):
            role = getattr(self, "role", "actor_infer")
            offloaded = getattr(self, "_test_offloaded", False)
            record.append((role, name, offloaded))
            if name in ("offload", "reload"):
                self._test_offloaded = name == "offload"
            return fn(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, recorded)

    for cls in (TrainerWorker, EngineWorker, CriticWorker, TeacherWorker, LearnedRewardWorker):
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            if not name.startswith("_"):
                wrap(cls, name, fn)
    return record


def _assert_never_offloaded(record: list[tuple[str, str, bool]], roles: set[str]) -> None:
    bad = [(role, name) for role, name, off in record if off and name not in ("reload", "offload")]
    assert not bad, f"calls into offloaded roles: {bad}"
    for role in roles:  # the property is only worth something if the roles did take turns
        assert (role, "offload", False) in record and (role, "reload", True) in record, role


def test_rlvr_with_reference_critic_and_warm_start(tmp_path, assets, calls):
    cfg = write_config(
        tmp_path / "c.yaml",
        assets,
        total_steps=2,
        algorithm={"preset": "ppo", "kl_coef": 0.01},
        critic={"lr": 1e-4},
        sft={"steps": 2, "batch_size": 8},
        optim={"lr": 1e-3, "micro_batch_size": 16, "ppo_epochs": 2},
        eval={"every": 1},
    )
    assert main(["train", str(cfg), *COLOCATED]) == 0
    _assert_never_offloaded(calls, {"actor_train", "actor_infer", "reference", "critic"})
    # every step reports the bytes its moves carried: none on CPU, where 'always' only exercises the path
    moved = [r for r in read_metrics(next((tmp_path / "runs").iterdir())) if "timing/offload" in r]
    assert moved and all(r["offload/bytes"] == 0.0 == r["reload/bytes"] for r in moved)
    called = {(role, name) for role, name, _ in calls}
    expected = {
        ("actor_infer", "generate"),
        ("actor_infer", "load_weights"),
        ("actor_train", "train"),  # the SFT warm start and the RL steps
        ("actor_train", "compute_logprobs"),  # old log-probs: two PPO epochs
        ("actor_train", "stream_weights"),
        ("actor_train", "save"),
        ("reference", "compute_logprobs"),
        ("critic", "compute_values"),
        ("critic", "train"),
    }
    assert expected <= called, expected - called


def test_agentic_with_reference_and_warm_start(tmp_path, calls):
    model = tmp_path / "game"
    cfg = tmp_path / "a.yaml"
    nim = yaml.safe_load((Path(__file__).parents[2] / "examples" / "agentic" / "nim.yaml").read_text())
    nim |= {
        "output_dir": str(tmp_path / "runs" / "{name}"),
        "total_steps": 2,
        "model": {"path": str(model), "build_tiny": {"alphabet": "game", "hidden_size": 64, "num_heads": 2}},
        "sft": {"steps": 2, "batch_size": 8, "lr": 1e-3},
        "rollout": {**nim["rollout"], "batch_size": 8, "group_size": 4},
        "algorithm": {"preset": "grpo", "kl_coef": 0.01},
        "agentic": {**nim["agentic"], "eval_episodes": 4},
        "eval": {"every": 1},
        "roles": {"env": {"world_size": 1}, "actor_train": {"torch_threads": 1}},
    }
    cfg.write_text(yaml.safe_dump(nim))
    assert main(["train", str(cfg), *COLOCATED]) == 0
    _assert_never_offloaded(calls, {"actor_train", "actor_infer", "reference"})
    called = {(role, name) for role, name, _ in calls}
    assert {
        ("reference", "compute_logprobs"),
        ("actor_train", "train"),
        ("actor_infer", "generate"),
    } <= called


@pytest.mark.parametrize("mode", ["on_policy", "offline"])
def test_distill(tmp_path, assets, calls, mode):
    teachers = {"arithmetic": {"model_path": str(assets["model"])}}
    cfg = write_config(
        tmp_path / "c.yaml", assets, pipeline="distill", distill={"mode": mode, "teachers": teachers},
        sft={"steps": 2, "batch_size": 8}, eval={"every": 1},
    )  # fmt: skip
    assert main(["train", str(cfg), *COLOCATED]) == 0
    _assert_never_offloaded(calls, {"actor_train", "actor_infer", "teacher"})
    called = {(role, name) for role, name, _ in calls}
    scored = ("teacher", "compute_logprobs" if mode == "on_policy" else "compute_topk")
    assert {scored, ("actor_train", "train")} <= called


def test_rlhf_reward_model(tmp_path, assets, calls):
    from transformers import AutoModelForSequenceClassification

    rm = tmp_path / "rm"  # the tiny policy as a one-label classifier (a new head): enough for the phases
    AutoModelForSequenceClassification.from_pretrained(assets["model"], num_labels=1).save_pretrained(rm)
    for f in assets["model"].glob("*token*"):
        (rm / f.name).write_bytes(f.read_bytes())
    cfg = write_config(tmp_path / "c.yaml", assets, total_steps=2, reward={"model": {"path": str(rm)}})
    assert main(["train", str(cfg), *COLOCATED]) == 0
    _assert_never_offloaded(calls, {"actor_train", "actor_infer", "learned_reward"})
    assert ("learned_reward", "score", False) in calls


def test_sft(tmp_path, assets, calls):
    cfg = write_config(tmp_path / "c.yaml", assets, pipeline="sft", sft={"steps": 3, "batch_size": 8})
    assert main(["train", str(cfg), *COLOCATED, "eval.every=2"]) == 0
    _assert_never_offloaded(calls, {"actor_train", "actor_infer"})
    called = [(role, name) for role, name, _ in calls]
    # the engine is synced before each evaluation after training (steps 2 and 3), not after every step
    assert called.count(("actor_train", "stream_weights")) == 2
    assert called.count(("actor_infer", "generate")) == 3  # steps 0, 2 and 3


def test_a_phase_that_forgets_a_role_is_refused(tmp_path, assets):
    from reroll.config.loader import load_config
    from reroll.config.schema import RunConfig
    from reroll.pipelines.common import sft_batch
    from reroll.pipelines.rlvr import RLVR
    from reroll.pipelines.roles import Roles
    from reroll.pipelines.run import run

    class Forgetful(RLVR):
        def step(self, roles: Roles, step: int) -> dict[str, float]:
            batch = sft_batch(self.rows.train[:2], self.tokenizer, "{answer}")
            with roles.phase("generate", "actor_infer"):  # actor_train is not named: it is offloaded
                roles.actor_train.compute_logprobs(batch)
            return {}

    cfg = load_config(write_config(tmp_path / "c.yaml", assets), RunConfig, COLOCATED)
    with pytest.raises(RuntimeError, match=r"actor_train was called in phase 'generate' while offloaded"):
        run(Forgetful, cfg)
