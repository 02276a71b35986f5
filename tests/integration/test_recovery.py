"""Dead workers are restarted and their step retried (every sample counted once); a hung call leaves
every worker's stack in the run directory."""

from __future__ import annotations

import pytest

from reroll.cli import main
from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.data.datasets import PromptSampler
from reroll.errors import RoleError
from reroll.pipelines import run as run_module
from reroll.pipelines.rlvr import RLVR
from reroll.runtime import stacks
from reroll.runtime.actors import WorkerGroup, start_ray
from reroll.runtime.metrics import read_metrics
from tests.conftest import write_config
from tests.integration.hang_workers import Sleeper

pytestmark = pytest.mark.integration

STEPS = 8
# step -> the role whose workers are killed as that step begins (its first attempt only)
KILLS = {2: "actor_infer", 3: "reward", 5: "reference", 6: "actor_train"}


def _recovery_config(tmp_path, assets):
    data = {"train_files": [str(assets["train"])], "eval_files": [str(assets["test"])], "eval_limit": 64}
    sections = {
        "algorithm": {"kl_coef": 0.01},  # a reference role, to kill
        # the quickstart's shape, smaller: SFT to ~0.6 held-out accuracy (measured), then GRPO
        "sft": {"steps": 800, "batch_size": 64, "lr": 3e-3, "warmup_steps": 10},
        "data": {**data, "prompt_template": "{question}="},
        "rollout": {"batch_size": 64, "group_size": 8, "max_new_tokens": 4},
        "optim": {"lr": 3e-4, "micro_batch_size": 64},
        "checkpoint": {"every": 3, "keep_last": 2},
        "eval": {"every": 4},
        "runtime": {"max_restarts": len(KILLS)},
    }
    return write_config(tmp_path / "c.yaml", assets, total_steps=STEPS, **sections)


def _run(cfg_path, name, monkeypatch, kills):
    """Run RLVR in this process; kill ``kills``' roles as their steps begin. Returns each completed
    step's prompt uids (a redone step's last attempt) and the metrics."""
    import ray

    cfg = load_config(cfg_path, RunConfig, [f"name={name}"])
    started, drawn, completed = [], [], {}
    real_start, real_step, real_draw = run_module.Roles.start, RLVR.step, PromptSampler.next_batch

    def start(cls, cfg, **kw):
        started.append(real_start(cfg, **kw))
        return started[-1]

    def draw(self):
        batch = real_draw(self)
        drawn.append([s.uid for s in batch])
        return batch

    def step(self, roles, step):
        role = kills.pop(step, None)
        if role is not None:
            group = {"actor_infer": roles.actor_infer, "actor_train": roles.actor_train}.get(role) or getattr(
                roles, role
            )
            for handle in group._handles:
                ray.kill(handle, no_restart=True)
        metrics = real_step(self, roles, step)
        completed[step] = drawn[-1]
        return metrics

    monkeypatch.setattr(run_module.Roles, "start", classmethod(start))
    monkeypatch.setattr(RLVR, "step", step)
    monkeypatch.setattr(PromptSampler, "next_batch", draw)
    run_module.run(RLVR, cfg)
    monkeypatch.undo()
    return completed, read_metrics(cfg.run_dir)


@pytest.mark.long  # 109 s in CI; the restart bound, env worker and judge kills stay there
def test_killed_roles_are_restarted_and_the_run_matches_an_uninterrupted_one(tmp_path, assets, monkeypatch):
    cfg = _recovery_config(tmp_path, assets)
    straight, straight_metrics = _run(cfg, "straight", monkeypatch, {})
    killed, metrics = _run(cfg, "killed", monkeypatch, dict(KILLS))

    assert [m["step"] for m in metrics] == list(range(STEPS + 1))  # redone steps logged once
    assert metrics[-1]["recovery/restarts"] == len(KILLS)
    # every completed step drew the prompts an uninterrupted run draws, each prompt once
    assert killed == straight
    uids = [u for step in sorted(killed) for u in killed[step]]
    assert len(uids) == len(set(uids))
    acc, straight_acc = metrics[-1]["eval/accuracy"], straight_metrics[-1]["eval/accuracy"]
    assert acc >= straight_acc - 0.1, (acc, straight_acc)


def test_restarts_past_max_restarts_stop_the_run(tmp_path, assets, monkeypatch, capsys):
    """A worker that dies on every attempt: the run stops with its error and the restarts it used,
    exit code 1."""
    import ray

    real_step = RLVR.step

    def dying_step(self, roles, step):
        ray.kill(roles.actor_infer._handles[0], no_restart=True)
        return real_step(self, roles, step)

    cfg = write_config(tmp_path / "c.yaml", assets, name="dies", total_steps=3, eval={"every": 0})
    monkeypatch.setattr(RLVR, "step", dying_step)
    assert main(["train", str(cfg), "runtime.max_restarts=2"]) == 1
    err = capsys.readouterr().err
    assert "actor_infer[0] (hf engine) failed during generate at step 1: the worker process died" in err
    assert "runtime.max_restarts=2 restarts were used (actor_infer at step 1, actor_infer at step 1)" in err


def test_a_dead_rank_is_reported_as_died_and_restarted(tmp_path, assets):
    import ray

    cfg = load_config(write_config(tmp_path / "c.yaml", assets), RunConfig, ["roles.env.world_size=2"])
    start_ray(None)
    group = WorkerGroup("env", Sleeper, lambda rank: (rank,), cfg)
    try:
        ray.kill(group._handles[1], no_restart=True)
        with pytest.raises(RoleError, match=r"env\[1\] failed during ping: the worker process died") as e:
            group._wait([h.ping.remote() for h in group.handles], "ping")
        assert e.value.died
        group.restart()
        assert group._wait([h.ping.remote() for h in group.handles], "ping") == [0, 1]
    finally:
        group.shutdown()


def test_a_call_past_its_bound_writes_every_workers_stack(tmp_path, assets):
    """reward hangs: the error names the role, rank and phase and the stacks directory, which has a
    stack per worker of every role (the hung function's name in the hung ones) and the driver's."""
    overrides = ["runtime.call_timeout_s=3", "roles.reward.world_size=2"]
    cfg = load_config(write_config(tmp_path / "c.yaml", assets), RunConfig, overrides)
    start_ray(None)
    stacks.configure(tmp_path / "run")
    hung = WorkerGroup("reward", Sleeper, lambda rank: (rank,), cfg)
    idle = WorkerGroup("env", Sleeper, lambda rank: (rank,), cfg)
    try:
        for group in (hung, idle):
            group._wait([h.ping.remote() for h in group.handles], "ping")
        with pytest.raises(RoleError) as e:
            hung._wait([h.hang_in_a_named_function.remote(60) for h in hung.handles], "score")
        message = str(e.value)
        assert message.startswith("reward[0] failed during score: no answer within 3 s")
        assert str(tmp_path / "run" / "stacks") in message
        written = {p.name: p.read_text() for p in (tmp_path / "run" / "stacks").iterdir()}
        assert set(written) == {"reward-0.txt", "reward-1.txt", "env-0.txt", "driver.txt"}
        assert "hang_in_a_named_function" in written["reward-0.txt"]
        assert "hang_in_a_named_function" in written["reward-1.txt"]
        assert "hang_in_a_named_function" not in written["env-0.txt"]
        assert "gather" in written["driver.txt"]
    finally:
        hung.shutdown()
        idle.shutdown()
        stacks.configure(None)


def _kill_once(monkeypatch, pipeline_cls, role: str, at: int) -> None:
    """``role``'s workers are killed as step ``at`` begins (its first attempt only)."""
    import ray

    real_step, pending = pipeline_cls.step, [at]

    def step(self, roles, step):
        if step in pending:
            pending.remove(step)
            for handle in getattr(roles, role)._handles:
                ray.kill(handle, no_restart=True)
        return real_step(self, roles, step)

    monkeypatch.setattr(pipeline_cls, "step", step)


@pytest.mark.long  # 24 s on 2 cores; CI keeps the four-role kill test and the environment one
def test_a_killed_critic_is_restarted_from_its_checkpoint(tmp_path, assets, monkeypatch):
    """PPO's critic dies at step 3: it comes back from the step-2 checkpoint with actor_train (the run
    goes back to it) and the run finishes every step, each logged once."""
    sections = {
        "algorithm": {"preset": "ppo"},
        "critic": {"lr": 1e-3},
        "checkpoint": {"every": 2},
        "runtime": {"max_restarts": 1},
    }
    path = write_config(tmp_path / "c.yaml", assets, name="critic", total_steps=4, **sections)
    cfg = load_config(path, RunConfig)
    _kill_once(monkeypatch, RLVR, "critic", at=3)
    run_module.run(RLVR, cfg)
    metrics = read_metrics(cfg.run_dir)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
    assert metrics[-1]["recovery/restarts"] == 1 and "critic/vf_loss" in metrics[-1]


@pytest.mark.parametrize("streaming", [False, True], ids=["lockstep", "streaming"])
def test_a_killed_environment_worker_is_restarted_and_its_episodes_replayed(tmp_path, monkeypatch, streaming):
    from reroll.models.tiny import GAME_ALPHABET, build_tiny_model
    from reroll.pipelines.agentic import Agentic

    model = build_tiny_model(tmp_path / "game", alphabet=GAME_ALPHABET, hidden_size=64, num_heads=2)
    raw = {
        "pipeline": "agentic",
        "name": "env",
        "output_dir": str(tmp_path / "{name}"),
        "total_steps": 3,
        "model": {"path": str(model)},
        "agentic": {"env": "nim", "eval_episodes": 0, "max_turns": 4, "streaming": streaming},
        "rollout": {"batch_size": 8, "group_size": 2, "max_new_tokens": 2},
        "optim": {"lr": 1e-3, "micro_batch_size": 8},
        "logging": {"tensorboard": False, "sample_every": 0},
        "runtime": {"max_restarts": 1},
    }
    cfg = RunConfig.model_validate(raw)
    if streaming:  # killed mid-step, while other episodes' calls are in flight on the workers
        _kill_at_first_env_step(monkeypatch, Agentic, at=2)
    else:
        _kill_once(monkeypatch, Agentic, "env", at=2)
    run_module.run(Agentic, cfg)
    metrics = read_metrics(cfg.run_dir)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    assert metrics[-1]["recovery/restarts"] == 1
    assert all(m.get("env/errors", 0) == 0 for m in metrics)  # replayed, not scored as broken episodes


def _kill_at_first_env_step(monkeypatch, pipeline_cls, at: int) -> None:
    """The env workers are killed at the first environment step of step ``at`` (after the resets)."""
    import threading

    import ray

    from reroll.roles.env import EnvGroup

    real_step, real_step_each = pipeline_cls.step, EnvGroup.step_each
    state, lock = {"step": 0, "armed": True}, threading.Lock()

    def step(self, roles, step):
        state["step"] = step
        return real_step(self, roles, step)

    def step_each(self, rank, actions):
        with lock:
            if state["step"] == at and state["armed"]:
                state["armed"] = False
                for handle in self._handles:
                    ray.kill(handle, no_restart=True)
        yield from real_step_each(self, rank, actions)

    monkeypatch.setattr(pipeline_cls, "step", step)
    monkeypatch.setattr(EnvGroup, "step_each", step_each)
