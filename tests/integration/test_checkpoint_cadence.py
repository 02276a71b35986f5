"""When a run saves: every ``checkpoint.every`` steps, and at its last step unless ``checkpoint.at_end``
is off (a benchmark or a throwaway try that needs no final save)."""

from __future__ import annotations

import pytest

from reroll.cli import main
from reroll.runtime import checkpoint
from tests.conftest import write_config

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("at_end", "saved"), [(True, [2, 3]), (False, [2])])
def test_the_last_step_saves_unless_at_end_is_off(tmp_path, assets, capsys, at_end, saved):
    cfg = write_config(
        tmp_path / "c.yaml",
        assets,
        total_steps=3,
        checkpoint={"every": 2, "keep_last": 3, "at_end": at_end},
    )
    assert main(["train", str(cfg), "runtime.backend=local", "eval.every=0", "data.eval_files=[]"]) == 0
    run_dir = tmp_path / "runs" / "t"
    steps = sorted(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").iterdir())
    assert steps == saved
    assert checkpoint.latest(run_dir).name == f"step_{saved[-1]:06d}"
    assert f"step_{saved[-1]:06d}" in capsys.readouterr().out  # the summary names the newest save
