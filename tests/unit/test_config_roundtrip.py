"""A run's own config.yaml (every field written, defaults included) loads back to the same config:
`reroll generate runs/NAME/config.yaml` and `reroll serve` read it."""

from __future__ import annotations

from pathlib import Path

import pytest

from reroll.config.loader import dump_config, load_config
from reroll.config.schema import RunConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = [
    "quickstart/arithmetic_grpo.yaml",
    "dpo/arithmetic_dpo.yaml",
    "agentic/nim.yaml",
    "multi_domain/tiny_math_code_if.yaml",
    "qwen2.5-0.5b-rlvr_fsdp2/config.yaml",
    "qwen3-8b-rlvr_megatron/config.yaml",
]


@pytest.mark.parametrize("example", EXAMPLES)
def test_a_dumped_config_loads_back_unchanged(tmp_path, example):
    cfg = load_config(ROOT / "examples" / example, RunConfig)
    dump_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml", RunConfig) == cfg


def test_set_but_unused_still_refused_when_it_differs_from_the_default(tmp_path):
    path = ROOT / "examples" / "quickstart" / "arithmetic_grpo.yaml"
    with pytest.raises(Exception, match=r"algorithm\.lam is set"):
        load_config(path, RunConfig, ["algorithm.lam=0.5"])
