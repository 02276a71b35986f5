"""Every example config loads strictly, and every per-size example fits its stated hardware by `reroll plan`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.plan import plan

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


@pytest.mark.parametrize("path", SIZED, ids=lambda p: p.parent.name)
def test_sized_example_fits_its_stated_hardware(path):
    text = path.read_text()
    gpus = int(re.search(r"# hardware: (\d+)x", text).group(1))
    memory = float(re.search(r"--gpu-memory (\d+)", text).group(1))
    report, fits = plan(load_config(path, RunConfig), gpus=gpus, gpu_memory_gib=memory)
    assert fits, report


def test_plan_refuses_an_impossible_config_with_the_fix():
    path = ROOT / "examples" / "qwen2.5-7b-rlvr_fsdp2" / "config.yaml"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "reroll.cli",
            "plan",
            str(path),
            "--gpus",
            "1",
            "--gpu-memory",
            "24",
            "placement.devices=1",
            "roles.actor_train.world_size=1",
            "roles.actor_infer.world_size=1",
            "roles.reference.world_size=1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "the plan does not fit" in out.stderr and "<- does not fit" in out.stderr
    assert "to fit:" in out.stderr and "Traceback" not in out.stderr
