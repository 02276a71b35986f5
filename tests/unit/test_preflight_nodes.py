"""What each node of a joined Ray cluster is asked before any role starts (``reroll.pipelines.preflight_nodes``):
the node-side answer on this machine's own directories, and the driver's reading of the answers. A cluster
whose second node does not share the driver's filesystem is in tests/integration/test_cluster_node_check.py."""

from __future__ import annotations

from pathlib import Path

import pytest

import reroll
from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.pipelines.preflight_machine import package_problems
from reroll.pipelines.preflight_nodes import (
    PROBE,
    NodeAnswer,
    asks_nodes,
    installed_versions,
    node_answer,
    node_problems,
)
from tests.conftest import ROOT, small_config


def _run_dir(tmp_path: Path, token: str | None) -> RunConfig:
    cfg = small_config(tmp_path, f"output_dir={tmp_path / 'runs' / '{name}'}").absolute_paths()
    cfg.run_dir.mkdir(parents=True)
    if token is not None:
        (cfg.run_dir / PROBE).write_text(token)
    return cfg


def _paths(answer: NodeAnswer) -> list[str]:
    return [path for path, _ in answer.problems]


def test_a_node_that_reads_the_drivers_token_and_models_has_no_problem(tmp_path, monkeypatch):
    monkeypatch.setattr("reroll.pipelines.preflight_machine.package_problems", lambda cfg, **kw: [])
    cfg = _run_dir(tmp_path, "abc")
    answer = node_answer(cfg, "abc", "pool", {"model.path": cfg.model.path})
    assert answer.version == reroll.__version__
    assert answer.problems == []


def test_another_run_directory_and_a_missing_model_are_named(tmp_path, monkeypatch):
    """What a node with a disk of its own at the same path finds: the driver's token is not there (another
    directory, or none at all), and a model directory the driver has is not."""
    monkeypatch.setattr("reroll.pipelines.preflight_machine.package_problems", lambda cfg, **kw: [])
    cfg = _run_dir(tmp_path, "another run's token")
    gone = str(tmp_path / "models" / "tiny")
    answer = node_answer(cfg, "abc", "pool", {"model.path": gone})
    assert _paths(answer) == ["output_dir", "model.path"]
    run_dir, model = (m for _, m in answer.problems)
    assert "is another directory than the driver's" in run_dir and "filesystem every node mounts" in run_dir
    assert repr(gone) in model and "does not exist here" in model

    missing = small_config(tmp_path, f"output_dir={tmp_path / 'elsewhere' / '{name}'}").absolute_paths()
    [(path, message)] = node_answer(missing, "abc", "pool", {}).problems
    assert path == "output_dir" and "is missing here" in message


def test_a_node_outside_the_pool_is_asked_only_for_the_packages_of_the_roles_that_need_no_device(
    tmp_path, monkeypatch
):
    """Off the pool only reward and environment workers land: no run directory, model, engine or strategy."""
    monkeypatch.setattr("reroll.engines.engine_missing", lambda name: f"{name} is not installed")
    monkeypatch.setattr("reroll.strategies.strategy_missing", lambda name: f"{name} is not installed")
    cfg = _run_dir(tmp_path, None)
    pool = [p.path for p in package_problems(cfg, on="pool")]
    assert pool == ["rollout.engine", "strategy.name"]
    assert package_problems(cfg, on="node") == []
    assert node_answer(cfg, "abc", "node", {"model.path": str(tmp_path / "gone")}).problems == []
    # the driver needs the trackers too; a node never logs to them
    monkeypatch.setattr("reroll.runtime.metrics.tracker_missing", lambda **kw: [("logging.wandb", "missing")])
    assert [p.path for p in package_problems(cfg)] == ["rollout.engine", "strategy.name", "logging.wandb"]
    assert [p.path for p in package_problems(cfg, on="pool")] == ["rollout.engine", "strategy.name"]


def test_the_answers_become_one_problem_a_finding_naming_its_nodes(tmp_path):
    same = ("output_dir", "the run directory '/r' is missing here")
    here = {"torch": "2.13.0", "vllm": "0.32.0"}
    answers = {
        "node 10.0.0.2 (aaaaaaaa)": NodeAnswer(reroll.__version__, [same], {"torch": "2.13.0"}),
        "node 10.0.0.3 (bbbbbbbb)": NodeAnswer("0.0.1", [same, ("rollout.engine", "vllm is not installed")]),
        "node 10.0.0.4 (cccccccc)": "reroll could not run there (ModuleNotFoundError: No module named 'reroll')",
        # another torch than the driver's; a package the driver lacks is not compared
        "node 10.0.0.5 (dddddddd)": NodeAnswer(
            reroll.__version__, [], {"torch": "2.12.1", "sglang": "0.5.2"}
        ),
    }
    problems = [str(p) for p in node_problems(answers, here)]
    assert problems == [
        "output_dir: on node 10.0.0.2 (aaaaaaaa), node 10.0.0.3 (bbbbbbbb): the run directory '/r' is missing here",
        f"runtime: on node 10.0.0.3 (bbbbbbbb): reroll 0.0.1 is installed, the driver runs {reroll.__version__}: "
        "the same version on every node",
        "rollout.engine: on node 10.0.0.3 (bbbbbbbb): vllm is not installed",
        "runtime: on node 10.0.0.4 (cccccccc): reroll could not run there (ModuleNotFoundError: No module named "
        "'reroll')",
        "runtime: on node 10.0.0.5 (dddddddd): torch 2.12.1 is installed, the driver runs 2.13.0: the same version "
        "on every node",
    ]
    assert node_problems({"node x": NodeAnswer(reroll.__version__, [], dict(here))}, here) == []
    # what a node answers: this machine's versions, the driver's by construction
    assert node_answer(small_config(tmp_path), None, "node", {}).packages == installed_versions()


@pytest.mark.parametrize(
    ("backend", "address", "env", "alive", "asked"),
    [
        ("ray", None, None, 1, False),  # the cluster `reroll train` starts on its own machine
        ("ray", None, None, 3, True),  # a cluster of several nodes this process is connected to
        ("ray", "10.0.0.1:6379", None, 1, True),  # joined, even of one node: started from another environment
        ("ray", None, "10.0.0.1:6379", 1, True),  # `ray job submit` hands its driver RAY_ADDRESS
        ("local", None, "10.0.0.1:6379", 3, False),
    ],
)
def test_which_runs_ask_their_nodes(tmp_path, monkeypatch, backend, address, env, alive, asked):
    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    overrides = [f"runtime.backend={backend}"] + ([f"runtime.ray_address={address}"] if address else [])
    assert asks_nodes(small_config(tmp_path, *overrides), alive) is asked


def test_every_model_path_a_worker_loads_is_listed_and_made_absolute(tmp_path, monkeypatch):
    """One list (``RunConfig.model_paths``) for what ``absolute_paths`` resolves and what the nodes are
    asked for: a distillation run's teachers too, by their keys (a teacher's name may hold a dot)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "t").mkdir(parents=True)
    cfg = load_config(
        ROOT / "examples" / "distill" / "on_policy.yaml",
        RunConfig,
        ["distill.teachers={v1.5: {model_path: models/t}}", "model.path=Qwen/Qwen2.5-0.5B"],
    )
    before = "runs/distill-teacher/checkpoints/step_000800/model"  # the example's own teacher, not made yet
    assert cfg.model_paths() == {
        ("model", "path"): "Qwen/Qwen2.5-0.5B",
        ("distill", "teachers", "arithmetic", "model_path"): before,
        ("distill", "teachers", "v1.5", "model_path"): "models/t",
    }
    out = cfg.absolute_paths()
    assert out.distill.teachers["v1.5"].model_path == str(tmp_path / "models" / "t")
    assert out.distill.teachers["arithmetic"].model_path == before  # not here: left as given
    assert out.model.path == "Qwen/Qwen2.5-0.5B"  # a hub id stays one
    assert out.model_paths()[("distill", "teachers", "v1.5", "model_path")] == str(tmp_path / "models" / "t")


def test_a_node_is_asked_for_the_users_own_reward_modules_which_the_driver_imports_itself(tmp_path):
    """A ``module:function`` reward the reward workers import: asked of every node, not of the driver
    (its checks call the reward where it runs, with their own message)."""

    def reward_problems(cfg: RunConfig, on: str) -> list[str]:
        return [p.message for p in package_problems(cfg, on=on) if p.path == "reward.fn"]

    cfg = small_config(tmp_path, "reward.fn=no_such_pkg.rewards:score")
    [message] = reward_problems(cfg, "node")
    assert "module 'no_such_pkg.rewards' is not importable here" in message and "--working-dir" in message
    assert reward_problems(cfg, "pool") == [message]
    assert reward_problems(cfg, "driver") == []
    here = small_config(tmp_path, "reward.fn=tests.integration.shaped_rewards:sevens")
    assert reward_problems(here, "node") == []
