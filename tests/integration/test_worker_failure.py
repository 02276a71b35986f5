"""A worker that dies mid-call reaches the driver as an error naming role, rank and phase: no hang."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.data.types import SamplingParams
from reroll.engines import engine_available
from reroll.errors import RoleError
from reroll.roles.rollout import RolloutGroup
from reroll.runtime.actors import start_ray
from tests.conftest import write_config

pytestmark = pytest.mark.integration


def test_engine_killed_mid_generation_is_reported(tmp_path, assets):
    cfg = load_config(write_config(tmp_path / "c.yaml", assets), RunConfig, ["runtime.call_timeout_s=120"])
    start_ray(None)
    rollout = RolloutGroup(cfg)
    try:
        rollout.generate(["1+1="], SamplingParams(n=1, max_new_tokens=2))  # the worker is up
        killer = threading.Timer(1.0, lambda: ray.kill(rollout.handles[0]))
        killer.start()
        start = time.monotonic()
        with pytest.raises(RoleError) as e:
            # long enough that the kill lands mid-call: 2000 prompts x 16 samples
            rollout.generate(["1+1="] * 2000, SamplingParams(n=16, max_new_tokens=64))
        assert time.monotonic() - start < 60
        assert "actor_infer[0] failed during generate" in str(e.value)
        assert "died" in str(e.value)
    finally:
        rollout.shutdown()


@pytest.mark.skipif(engine_available("sglang"), reason="needs an engine that is not installed here")
def test_engine_that_is_not_installed_names_the_extra(tmp_path, assets):
    """The worker's constructor fails; the driver gets its message, not only 'the worker died'."""
    cfg = load_config(write_config(tmp_path / "c.yaml", assets), RunConfig, ["rollout.engine=sglang"])
    start_ray(None)
    rollout = RolloutGroup(cfg)
    try:
        with pytest.raises(RoleError, match="failed to start") as e:
            rollout.generate(["1+1="], SamplingParams(n=1, max_new_tokens=2))
        assert "pip install 'reroll[sglang]'" in str(e.value)
    finally:
        rollout.shutdown()
