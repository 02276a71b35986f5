"""A colocated engine's offload: the vLLM CPU build has no sleep mode and holds no device memory, so on
CPUs it stays as it is; other engines take the path (which moves nothing on CPUs)."""

from __future__ import annotations

import pytest
import yaml

import reroll.roles.actor_infer as rollout_module
from reroll.config.loader import load_config
from reroll.config.schema import RunConfig


class RecordingEngine:
    def __init__(self, *args, **kwargs) -> None:
        self.calls: list[str] = []

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep {level}")

    def wake_up(self) -> None:
        self.calls.append("wake_up")


@pytest.mark.parametrize("engine, calls", [("vllm", []), ("hf", ["sleep 1", "wake_up"])])
def test_an_engine_on_cpus_sleeps_only_where_it_can(tmp_path, monkeypatch, engine, calls):
    raw = {"pipeline": "rlvr", "model": {"path": str(tmp_path)}, "data": {"train_files": ["x.jsonl"]}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    overrides = [f"rollout.engine={engine}", "placement.devices=1", "placement.device_type=cpu"]
    cfg = load_config(tmp_path / "run.yaml", RunConfig, [*overrides, "placement.offload=always"])
    monkeypatch.setattr(rollout_module, "make_engine", RecordingEngine)
    worker = rollout_module.EngineWorker(0, cfg)
    worker.offload()
    worker.reload()
    assert worker.engine.calls == calls
