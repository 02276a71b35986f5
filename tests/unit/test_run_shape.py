"""One shape for every run: the roles a run starts are one registry's (what `reroll plan` budgets is what
starts), each pipeline's config has the sections it reads and refuses another's, engines are asked what
they can do, generation on stale weights is refused, and the data path is one for every pipeline."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from reroll.config.loader import ConfigError, load_config
from reroll.config.memory import KNOWN
from reroll.config.placement import run_roles
from reroll.config.roles import ROLES
from reroll.config.schema import RunConfig, pipeline_names
from reroll.plan import estimate
from tests.conftest import write_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").rglob("*.yaml"))
SHAPE = KNOWN["qwen2.5-0.5b"]


class _Group:
    """A started role that holds nothing: records that it was started, and shuts down."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.role, self.log = name, log
        log.append(name)

    def shutdown(self) -> None:
        pass


def _started(cfg: RunConfig, monkeypatch, **kw: Any) -> list[str]:
    """The groups ``Roles.start`` builds for ``cfg`` (every group a recorder; the local backend, the
    pool's devices taken as GPUs as `reroll plan` takes them; start-time refusals are another test's)."""
    from reroll.pipelines import roles as roles_module
    from reroll.runtime import placement

    started: list[str] = []
    fakes = {
        name: (None if build is None else (lambda c, n=name: _Group(n, started)))
        for name, build in roles_module.GROUPS.items()
    }
    monkeypatch.setattr(roles_module, "GROUPS", fakes)
    monkeypatch.setattr(placement, "start_problems", lambda cfg, device_type=None: [])
    update = {"runtime": cfg.runtime.model_copy(update={"backend": "local"})}
    update["placement"] = cfg.placement.model_copy(update={"device_type": "cuda"})
    roles = roles_module.Roles.start(cfg.model_copy(update=update), **kw)
    roles.shutdown()
    return started


def _example(path: Path, tmp_path: Path, assets: dict[str, Path]) -> RunConfig:
    raw = yaml.safe_load(path.read_text())
    over = [f"output_dir={tmp_path}/run"]
    if "/checkpoints/" in raw["model"]["path"]:
        over.append(f"model.path={assets['model']}")
    return load_config(path, RunConfig, over)


def test_every_role_has_a_group_and_a_config_section():
    from reroll.config.roles import RolesConfig
    from reroll.pipelines.roles import GROUPS

    assert list(GROUPS) == list(ROLES) == list(RolesConfig.model_fields)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_plan_budgets_exactly_the_roles_the_run_starts(path, tmp_path, assets, monkeypatch):
    cfg = _example(path, tmp_path, assets)
    planned = {p.role for p in estimate(cfg, SHAPE, prompt_tokens=64)}
    started = set(_started(cfg, monkeypatch))
    assert planned == {r for r in started if ROLES[r].holds != "workers"}
    # the reward workers start the judge
    assert started == {r for r in run_roles(cfg, "cuda") if r != "judge"}


def _pipeline_cfg(tmp_path: Path, assets: dict[str, Path], pipeline: str, **sections: Any) -> RunConfig:
    prefs = tmp_path / "pairs.jsonl"
    prefs.write_text(json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3"}) + "\n")
    base: dict[str, Any] = {
        "rlvr": {},
        "sft": {"sft": {"steps": 2}},
        "agentic": {"data": None, "agentic": {"env": "nim"}},
        "reward_model": {"data": None, "preference": {"train_files": [str(prefs)]}},
        "dpo": {"preference": {"train_files": [str(prefs)]}},
        "distill": {"distill": {"teachers": {"t": {"model_path": str(assets["model"])}}}},
    }[pipeline]
    path = write_config(tmp_path / f"{pipeline}.yaml", assets, pipeline=pipeline, **{**base, **sections})
    return load_config(path, RunConfig)


CASES = [  # (pipeline, sections, the roles the run starts)
    ("rlvr", {}, {"actor_train", "actor_infer", "reward"}),
    ("rlvr", {"algorithm": {"kl_coef": 0.1}}, {"actor_train", "actor_infer", "reward", "reference"}),
    # with LoRA the reference is actor_train's base model: no second copy (plan used to budget one)
    (
        "rlvr",
        {"algorithm": {"kl_coef": 0.1}, "strategy": {"lora": {"rank": 4}}},
        {"actor_train", "actor_infer", "reward"},
    ),
    ("sft", {}, {"actor_train", "actor_infer", "reward"}),
    ("sft", {"data": {"eval_files": []}}, {"actor_train"}),  # nothing to generate for
    ("agentic", {"algorithm": {"kl_coef": 0.1}}, {"actor_train", "actor_infer", "env", "reference"}),
    ("reward_model", {}, {"actor_train"}),  # no engine (plan used to budget one on device 0)
    ("dpo", {}, {"actor_train", "actor_infer", "reward", "reference"}),
    ("dpo", {"data": None}, {"actor_train", "reference"}),  # no held-out generation: no engine
    ("distill", {}, {"actor_train", "actor_infer", "reward", "teacher"}),
    (
        "distill",
        {
            "distill": {"mode": "offline", "teachers": {"t": {"model_path": "x/y"}}},
            "data": {"eval_files": []},
        },
        {"actor_train", "teacher"},
    ),
]


@pytest.mark.parametrize(
    "pipeline, sections, expected", CASES, ids=lambda v: v if isinstance(v, str) else None
)
def test_every_pipeline_plans_what_it_starts(pipeline, sections, expected, tmp_path, assets, monkeypatch):
    cfg = _pipeline_cfg(tmp_path, assets, pipeline, **sections)
    assert set(run_roles(cfg)) == expected
    assert set(_started(cfg, monkeypatch)) == expected
    planned = {p.role for p in estimate(cfg, SHAPE, prompt_tokens=64)}
    assert planned == expected - {"reward", "env"}


def test_generate_starts_the_engine_and_the_rewards_only(tmp_path, assets, monkeypatch):
    cfg = _pipeline_cfg(tmp_path, assets, "rlvr", algorithm={"kl_coef": 0.1}, placement={"devices": 1})
    assert set(_started(cfg, monkeypatch, generate_only=True)) == {"actor_infer", "reward"}
    # alone on the pool, the engine takes its device whole (a training run shares it with the trainers)
    from reroll.runtime import placement

    monkeypatch.setattr(
        placement, "_STARTED", {placement._pg_name(cfg): run_roles(cfg, "cuda", generate_only=True)}
    )
    assert set(run_roles(cfg, "cuda", generate_only=True)) == {"actor_infer", "reward"}


def test_pipelines_are_registered_with_their_config_models():
    from reroll.pipelines import pipeline_class

    for name in pipeline_names():
        assert pipeline_class(name).name == name


def _problems(tmp_path: Path, data: dict[str, Any]) -> dict[str, str]:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as e:
        load_config(path, RunConfig)
    return {p.path: p.message for p in e.value.problems}


def test_a_section_of_another_pipeline_is_an_error_naming_its_pipelines(tmp_path):
    """Only the pipelines reroll ships are named, and the config reference lists only them, whichever
    pipelines of one's own the process has imported (a test module's did, once the suite collected it)."""
    import tests.integration.extensions  # noqa: F401  (registers the pipeline 'tests.integration.extensions:Echo')
    from reroll.config.schema import config_docs

    assert "extensions:Echo" not in config_docs()
    data = {
        "pipeline": "sft",
        "model": {"path": "org/model"},
        "data": {"train_files": ["x.jsonl"]},
        "sft": {"steps": 1},
        "algorithm": {"kl_coef": 0.1},
        "distill": {"teachers": {"t": {"model_path": "org/t"}}},
        "critic": None,  # null is unset: an older version's resolved config wrote every section
    }
    assert _problems(tmp_path, data) == {
        "algorithm": "is read by pipelines 'rlvr' and 'agentic', not 'sft': remove it",
        "distill": "is read by pipeline 'distill', not 'sft': remove it",
    }
    typo = {"pipeline": "sft", "model": {"path": "org/model"}, "dat": {}}
    assert "did you mean 'data'" in _problems(tmp_path, typo)["dat"]
    assert (
        "did you mean 'rlvr'"
        in _problems(tmp_path, {"pipeline": "rlv", "model": {"path": "a/b"}})["pipeline"]
    )


@pytest.mark.parametrize("pipeline", ["rlvr", "sft", "agentic", "reward_model", "dpo", "distill"])
def test_a_runs_resolved_config_loads_back_as_its_pipelines(pipeline, tmp_path, assets):
    from reroll.config.loader import dump_config

    cfg = _pipeline_cfg(tmp_path, assets, pipeline)
    dump_config(cfg, tmp_path / "resolved.yaml")
    again = load_config(tmp_path / "resolved.yaml", RunConfig)
    assert type(again) is type(cfg) and again == cfg
    assert set(yaml.safe_load((tmp_path / "resolved.yaml").read_text())) == set(type(cfg).model_fields)


def test_rollout_source_problems_all_come_at_once(tmp_path, assets):
    """max_staleness without async used to return early and drop the tail-batching problem."""
    cfg = _pipeline_cfg(tmp_path, assets, "rlvr")
    r = cfg.rollout.model_copy(update={"max_staleness": 2, "tail_threshold": 99})
    paths = [p.path for p in cfg.model_copy(update={"rollout": r}).check()]
    assert "rollout.max_staleness" in paths and "rollout.tail_threshold" in paths


def test_the_rollout_source_options_are_refused_with_the_reason_where_there_is_none(tmp_path, assets):
    with pytest.raises(ConfigError, match=r"rollout\.async_steps: .*episodes play turn by turn"):
        _pipeline_cfg(tmp_path, assets, "agentic", rollout={"async_steps": 1})
    offline = {"mode": "offline", "teachers": {"t": {"model_path": str(assets["model"])}}}
    with pytest.raises(ConfigError, match=r"rollout\.tail_threshold: .*generates only for the held-out"):
        _pipeline_cfg(tmp_path, assets, "distill", distill=offline, rollout={"tail_threshold": 2})
    # on-policy distillation generates through the source: tail batching and async are its options too
    cfg = _pipeline_cfg(tmp_path, assets, "distill", rollout={"tail_threshold": 2})
    assert cfg.rollout_source and cfg.rollout.tail_threshold == 2
    assert _pipeline_cfg(tmp_path, assets, "distill", rollout={"async_steps": 1}).rollout.async_steps == 1


def test_a_generation_on_stale_weights_is_refused_naming_both_versions():
    from reroll.roles.actor_infer import EngineGroup, StaleWeights

    group = EngineGroup.__new__(EngineGroup)  # the check alone: no workers
    group.weights_version, trainer = 3, {"version": 3}
    group.policy_version = lambda: trainer["version"]
    group.check_fresh()  # in step
    trainer["version"] = 5
    with pytest.raises(StaleWeights, match="holds policy version 3 but actor_train is at version 5"):
        group.check_fresh()
    group.check_fresh(stale_ok=True)  # the async rollout source bounds staleness itself
    group.policy_version = None  # reroll generate: no trainer
    group.check_fresh()


@contextmanager
def _no_roles():
    yield


def test_the_run_syncs_before_a_step_that_generates_and_not_otherwise():
    from reroll.pipelines.run import _step

    class Roles:
        engine_stale, synced = True, 0

        def sync_if_stale(self):
            self.synced += 1
            return {"sync/bytes": 1.0}

        def phase(self, *a):
            return _no_roles()

    class Step:
        cfg = RunConfig.model_validate(
            {"pipeline": "rlvr", "model": {"path": "a/b"}, "data": {"train_files": ["x"]}}
        )
        total_steps, evaluate_uses, step_generates = 10, (), True

        def step(self, roles, step):
            return {"step": float(step)}

    roles, pipeline = Roles(), Step()
    pipeline.cfg = pipeline.cfg.model_copy(update={"eval": pipeline.cfg.eval.model_copy(update={"every": 0})})
    metrics, _ = _step(pipeline, roles, 1, None)
    assert roles.synced == 1 and metrics == {"sync/bytes": 1.0, "step": 1.0}
    pipeline.step_generates = False
    metrics, _ = _step(pipeline, roles, 2, None)
    assert roles.synced == 1 and metrics == {"step": 2.0}


def test_engines_are_asked_what_they_can_do():
    from reroll.config.engines import ENGINES, EngineSpec, engine_spec
    from reroll.config.rollout import RolloutConfig

    assert engine_spec("vllm").span(RolloutConfig(vllm={"tensor_parallel_size": 2})) == 2
    assert engine_spec("hf").span(RolloutConfig()) == 1
    assert engine_spec("hf").streams and not engine_spec("sglang").streams
    spec = engine_spec("tests.integration.extensions:PlainEngine")
    assert isinstance(spec, EngineSpec) and spec.name == "plain" and not spec.streams
    assert "plain" not in ENGINES  # found by its path, registered nowhere in reroll
    with pytest.raises(ValueError, match="unknown engine 'vlm'; did you mean 'vllm'"):
        RolloutConfig(engine="vlm")


def test_a_gpu_machine_with_no_pool_shares_one_gpu_and_picks_vllm_where_installed():
    """The quickstart as shipped (no placement, rollout.engine auto): on a CPU machine every role stays on
    the CPU with the hf engine, as the measured numbers were taken; on a GPU machine the model roles share
    GPU 0 (a pool of 1) and the engine is vLLM where it is installed."""
    import importlib.util

    from reroll.runtime.placement import resolved

    cfg = load_config(ROOT / "examples" / "quickstart" / "arithmetic_grpo.yaml", RunConfig)
    assert cfg.placement.devices is None and cfg.rollout.engine == "auto"
    cpu = resolved(cfg, "cpu")
    assert cpu.placement.devices is None and cpu.rollout.engine == "hf"
    gpu = resolved(cfg, "cuda")
    assert gpu.placement.devices == 1
    assert gpu.rollout.engine == ("vllm" if importlib.util.find_spec("vllm") else "hf")
    assert {s.name for s in run_roles(gpu, "cuda").values() if s.on_pool} == {"actor_train", "actor_infer"}
    # a config that places its roles itself is left as it is
    own = cfg.model_copy(
        update={
            "roles": cfg.roles.model_copy(
                update={"actor_train": cfg.roles.actor_train.model_copy(update={"num_gpus_per_worker": 1.0})}
            )
        }
    )
    assert resolved(own, "cuda").placement.devices is None
