"""One dead rank of a multi-rank role: only that role's group is rebuilt (a fresh process group, its
state from the last checkpoint) while every other role keeps its actors and what they hold; the engine
gets the rebuilt trainer's weights, and the run ends where an uninterrupted one ends."""

from __future__ import annotations

import pytest

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.pipelines import run as run_module
from reroll.pipelines.rlvr import RLVR
from reroll.runtime.metrics import read_metrics
from tests.conftest import step_metrics, write_config

pytestmark = pytest.mark.integration

STEPS = 4


def _config(tmp_path, assets):
    sections = {
        "algorithm": {"kl_coef": 0.01},  # a reference role, which must keep its actor
        # a warm start, so that rewards and weights move: a trainer resumed wrong shows in the metrics
        "sft": {"steps": 150, "batch_size": 64, "lr": 3e-3, "warmup_steps": 10},
        "rollout": {"batch_size": 32, "group_size": 8, "max_new_tokens": 4},
        "optim": {"lr": 3e-4, "micro_batch_size": 32},
        "strategy": {"name": "fsdp2"},
        "roles": {
            "actor_train": {"world_size": 2, "torch_threads": 1},
            **{r: {"torch_threads": 1} for r in ("actor_infer", "reference", "reward")},
        },
        "checkpoint": {"every": 2, "keep_last": 2},
        "eval": {"every": STEPS},
        "runtime": {"max_restarts": 1},
    }
    return write_config(tmp_path / "c.yaml", assets, total_steps=STEPS, **sections)


def _actor_ids(roles) -> dict[str, list[str]]:
    return {name: [h._actor_id.hex() for h in group._handles] for name, group in roles.groups.items()}


def _run(path, name, monkeypatch, kill: tuple[int, str, int] | None):
    """RLVR in this process; ``kill`` = (step, role, rank): that rank is killed as the step begins (its
    first attempt). Returns the run directory and each attempted step's actor ids, in order."""
    import ray

    cfg = load_config(path, RunConfig, [f"name={name}"])
    seen: list[tuple[int, dict[str, list[str]]]] = []
    real_step = RLVR.step

    def step(self, roles, step):
        nonlocal kill
        seen.append((step, _actor_ids(roles)))
        if kill is not None and kill[0] == step:
            _, role, rank = kill
            kill = None
            ray.kill(roles.groups[role]._handles[rank], no_restart=True)
        return real_step(self, roles, step)

    monkeypatch.setattr(RLVR, "step", step)
    run_module.run(RLVR, cfg)
    monkeypatch.undo()
    return cfg.run_dir, seen


@pytest.mark.long  # 77 s on 2 cores (204 s shared): two runs of 2 FSDP2 ranks; CI keeps test_recover
def test_a_dead_fsdp2_rank_rebuilds_its_group_alone_and_the_run_matches_an_uninterrupted_one(
    tmp_path, assets, monkeypatch
):
    path = _config(tmp_path, assets)
    straight, _ = _run(path, "straight", monkeypatch, None)
    killed, seen = _run(path, "killed", monkeypatch, (3, "actor_train", 1))

    metrics = read_metrics(killed)
    assert [m["step"] for m in metrics] == list(range(STEPS + 1))  # step 3 redone from the step-2 checkpoint
    assert metrics[-1]["recovery/restarts"] == 1
    # the steps attempted: 3 twice (the kill, then the redo)
    assert [s for s, _ in seen] == [1, 2, 3, 3, 4]
    before, after = seen[2][1], seen[3][1]
    assert set(before) == {"actor_train", "actor_infer", "reference", "reward"}
    for role in ("actor_infer", "reference", "reward"):  # the same actors, from the first step to the last
        assert {tuple(ids[role]) for _, ids in seen} == {tuple(before[role])}, role
    assert set(after["actor_train"]).isdisjoint(before["actor_train"])  # both ranks are new
    assert len(after["actor_train"]) == 2
    # the engine generated with the rebuilt trainer's weights and the trainer resumed exactly: every
    # step from the redone one on is the uninterrupted run's
    for n in (3, 4):
        redone = {k: v for k, v in step_metrics(killed, n).items() if not k.startswith("recovery/")}
        assert redone == pytest.approx(step_metrics(straight, n), rel=1e-5), n
    assert read_metrics(straight)[-1]["rollout/reward_mean"] > 0  # the warm start left rewards to move
