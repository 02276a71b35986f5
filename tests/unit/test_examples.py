"""Every example config loads strictly; every per-size example passes `reroll validate` and `reroll plan` on
its stated hardware, or both refuse it with the same reasons (reroll.config.startable)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.pipelines import preflight
from reroll.pipelines.preflight import check_inputs
from reroll.pipelines.preflight_machine import Machine
from reroll.plan import plan
from tests.conftest import reroll_here

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "examples").rglob("*.yaml"))
SIZED = sorted(
    p
    for p in CONFIGS
    if re.match(r"(qwen[\d.]+-[\w.-]+)-(rlvr|sft|agentic)_(fsdp2|megatron|deepspeed)", p.parent.name)
)


def test_the_per_size_examples_exist():
    names = {p.parent.name for p in SIZED}
    for size in ("qwen2.5-0.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen3-8b", "qwen3-30b-a3b", "qwen3-235b-a22b"):
        assert any(n.startswith(size + "-") for n in names), size
    assert {n.rsplit("_", 1)[1] for n in names} >= {"fsdp2", "megatron"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_example_config_is_valid(path, request):
    # an example that starts from another example's checkpoint (reward_model/arithmetic_rm.yaml starts
    # from sft_start.yaml's) is checked with a model that exists in its place
    starts_from_a_run = "/checkpoints/" in str(load_config_yaml(path)["model"]["path"])
    overrides = [f"model.path={request.getfixturevalue('assets')['model']}"] if starts_from_a_run else []
    load_config(path, RunConfig, overrides)


def load_config_yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def _hardware(path: Path) -> tuple[int, float]:
    text = path.read_text()
    gpus = int(re.search(r"# hardware: (\d+)x", text).group(1))
    memory = float(re.search(r"--gpu-memory (\d+)", text).group(1))
    return gpus, memory


def _validate_and_plan(path: Path, tmp_path: Path, *overrides: str) -> tuple[list[str], str, bool]:
    """``reroll validate``'s problems (data pointed at a small local file, the run directory at tmp) and
    ``reroll plan``'s text and verdict on the example's stated hardware, its packages installed (vLLM is
    not, on most machines that run this); nothing is started."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "1+1?", "answer": "2"}\n')
    args = [
        f"data.train_files=[{rows}]",
        f"data.eval_files=[{rows}]",
        f"output_dir={tmp_path}/run",
        *overrides,
    ]
    cfg = load_config(path, RunConfig, args)
    gpus, memory = _hardware(path)
    machine = Machine(cpus=16.0 * gpus, gpus=gpus)  # the hardware it names, not the machine running the test
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(preflight, "package_problems", lambda cfg, **kw: [])
        problems = [f"{p.path}: {p.message}" for p in check_inputs(cfg, machine)]
    report, fits = plan(cfg, gpus=gpus, gpu_memory_gib=memory)
    return problems, report, fits


@pytest.mark.parametrize("path", SIZED, ids=lambda p: p.parent.name)
def test_validate_and_plan_agree_on_every_sized_example(path, tmp_path):
    """Each per-size example either passes both `reroll validate` and `reroll plan` on the hardware its
    header names (so it starts there), or is refused by both with the same reasons and says so in its
    header. The model's shape and type come from the known-families table (hub ids, offline)."""
    problems, report, fits = _validate_and_plan(path, tmp_path)
    refused = report.partition("\ncannot start:")[2].splitlines()[1:]
    assert sorted(line.strip() for line in refused) == sorted(problems), report
    if problems:
        assert not fits and "DOES NOT START WITH THIS VERSION" in path.read_text(), problems
    else:
        assert fits, report


def test_no_sized_example_is_refused():
    """Every per-size example starts on paper, the 235B one on 64 GPUs included (Megatron pipeline
    stages and experts at tensor_parallel 1)."""
    refused = {p.parent.name for p in SIZED if "DOES NOT START" in p.read_text()}
    assert refused == set()


def test_a_local_moe_config_is_checked_for_megatron_by_both(tmp_path):
    """model.path a local directory: validate and plan read its config.json (plan's shape on the meta
    device, the model type for the Megatron check). A mixture of experts converts; at the example's
    tensor_parallel 2 with sequence parallelism neither refuses it, without sequence parallelism both
    do (Megatron-Core trains a MoE under TP with it only), naming the fix."""
    from transformers import Qwen3MoeConfig

    model = tmp_path / "moe"
    Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=8192,
    ).save_pretrained(model)
    path = ROOT / "examples" / "qwen3-8b-rlvr_megatron" / "config.yaml"
    problems, report, _ = _validate_and_plan(path, tmp_path, f"model.path={model}")
    assert not [p for p in problems if p.startswith(("strategy.megatron", "model.path"))], problems
    assert "strategy.megatron" not in report
    off = "strategy.megatron.sequence_parallel=false"
    problems, report, fits = _validate_and_plan(path, tmp_path, f"model.path={model}", off)
    assert not fits
    refused = [p for p in problems if p.startswith("strategy.megatron")]
    assert refused == [
        "strategy.megatron: strategy.megatron.tensor_parallel=2 with a mixture-of-experts model needs "
        "strategy.megatron.sequence_parallel=true (Megatron-Core trains a mixture of experts at "
        "tensor_parallel > 1 only with sequence parallelism): set sequence_parallel=true, or "
        "tensor_parallel=1 and spread the experts with expert_parallel"
    ]
    assert refused[0] in report and "B parameters" in report


def test_start_refuses_what_validate_refuses(tmp_path):
    """The run's start (ResourceManager, with the device type known) raises the same message: here the
    device-dependent one that validate leaves until the device is known (vLLM sleep mode on CPUs)."""
    from reroll.errors import UserError
    from reroll.runtime.placement import ResourceManager

    path = ROOT / "examples" / "qwen2.5-0.5b-rlvr_fsdp2" / "config.yaml"
    rows = tmp_path / "rows.jsonl"  # not the hub dataset the example names: nothing to look up
    rows.write_text('{"question": "1+1?", "answer": "2"}\n')
    data = [f"data.train_files=[{rows}]", f"data.eval_files=[{rows}]", f"output_dir={tmp_path}/run"]
    cfg = load_config(path, RunConfig, ["runtime.backend=local", "placement.device_type=cpu", *data])
    problems = [f"{p.path}: {p.message}" for p in check_inputs(cfg) if p.path.startswith("rollout.vllm")]
    assert problems and "enable_sleep_mode needs CUDA" in problems[0]
    with pytest.raises(UserError) as e:
        ResourceManager(cfg)
    assert str(e.value) == problems[0]


def test_plan_refuses_an_impossible_config_with_the_fix():
    path = ROOT / "examples" / "qwen2.5-7b-rlvr_fsdp2" / "config.yaml"
    out = reroll_here(
        "plan",
        path,
        "--gpus",
        "1",
        "--gpu-memory",
        "24",
        "placement.devices=1",
        "roles.actor_train.world_size=1",
        "roles.actor_infer.world_size=1",
        "roles.reference.world_size=1",
        # the engine's share holds the 7B's start on 24 GiB (0.6 would not: the check of its own)
        "rollout.vllm.gpu_memory_utilization=0.7",
    )
    assert out.returncode == 2
    assert "the plan does not fit" in out.stderr and "<- does not fit" in out.stderr
    assert "to fit:" in out.stderr and "Traceback" not in out.stderr
