"""A worker that dies mid-call reaches the driver as an error naming role, rank and phase: no hang."""

from __future__ import annotations

import pytest

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.data.types import SamplingParams
from reroll.engines import engine_available
from reroll.errors import RoleError
from reroll.roles.actor_infer import EngineGroup
from reroll.runtime.actors import start_ray
from tests.conftest import assert_kill_mid_generation_is_reported, write_config

pytestmark = pytest.mark.integration


def test_engine_killed_mid_generation_is_reported(tmp_path, assets):
    cfg = load_config(write_config(tmp_path / "c.yaml", assets), RunConfig, ["runtime.call_timeout_s=120"])
    start_ray(None)
    rollout = EngineGroup(cfg)
    try:
        assert_kill_mid_generation_is_reported(rollout)
    finally:
        rollout.shutdown()


@pytest.mark.skipif(engine_available("sglang"), reason="needs an engine that is not installed here")
def test_engine_that_is_not_installed_names_the_extra(tmp_path, assets):
    """The worker's constructor fails; the driver gets its message, not only 'the worker died'."""
    cfg = load_config(write_config(tmp_path / "c.yaml", assets), RunConfig, ["rollout.engine=sglang"])
    start_ray(None)
    rollout = EngineGroup(cfg)
    try:
        with pytest.raises(RoleError, match="failed to start") as e:
            rollout.generate(["1+1="], SamplingParams(n=1, max_new_tokens=2))
        assert "pip install 'reroll[sglang]'" in str(e.value)
    finally:
        rollout.shutdown()
