"""``logging.profile_steps``: the trainer roles' ranks write a trace and an operator table for exactly the
steps asked for."""

from __future__ import annotations

import gzip
import json

import pytest

from reroll.cli import main
from tests.conftest import write_config

pytestmark = pytest.mark.integration


def test_profiled_step_writes_a_trace_and_a_table_per_trainer_rank(tmp_path, assets, capsys):
    cfg = write_config(
        tmp_path / "c.yaml",
        assets,
        total_steps=2,
        algorithm={"preset": "grpo", "kl_coef": 0.01},
        logging={"tensorboard": False, "profile_steps": [2]},
    )
    assert main(["train", str(cfg), "runtime.backend=local"]) == 0
    profile = tmp_path / "runs" / "t" / "profile"
    # in one process (backend local) the two ranks share one recording, written once under both names
    base = "actor_train-0+reference-0-step2"
    assert sorted(p.name for p in profile.iterdir()) == [f"{base}.json.gz", f"{base}.txt"]
    table = (profile / f"{base}.txt").read_text()
    assert "by self host time" in table and "aten::" in table
    # the actor's step ran forward, backward and the optimizer inside the recording
    trace = json.loads(gzip.decompress((profile / f"{base}.json.gz").read_bytes()))
    ops = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("backward" in op.lower() for op in ops), sorted(ops)[:20]
    assert any(op.startswith("Optimizer.step") for op in ops), sorted(ops)[:20]
    assert "profile of step 2: 2 files" in capsys.readouterr().out


def test_a_profile_step_past_the_end_is_refused_before_anything_runs(tmp_path, assets, capsys):
    cfg = write_config(tmp_path / "c.yaml", assets, total_steps=2, logging={"profile_steps": [3]})
    assert main(["train", str(cfg), "runtime.backend=local"]) == 2
    err = capsys.readouterr().err
    assert "logging.profile_steps: [3] past the run's last step (2)" in err
    assert "Traceback" not in err
    assert not (tmp_path / "runs" / "t").exists()
