"""The multi-domain example (math + code + instruction following) through the CLI: routing, shares, metrics."""

from __future__ import annotations

import pytest

from reroll.cli import main
from reroll.runtime.metrics import read_metrics
from tests.conftest import ROOT

pytestmark = pytest.mark.integration

EXAMPLE = ROOT / "examples" / "multi_domain" / "tiny_math_code_if.yaml"
DATA = ROOT / "examples" / "multi_domain" / "data"


def test_multi_domain_example_runs_with_shares_and_per_domain_metrics(tmp_path, assets):
    pytest.importorskip("math_verify")
    train = ",".join(str(DATA / f) for f in ("math.jsonl", "code.jsonl", "ifeval.jsonl"))
    overrides = [
        f"output_dir={tmp_path}/{{name}}",
        f"model.path={assets['model']}",
        f"data.train_files=[{train}]",
        f"data.eval_files=[{DATA / 'eval.jsonl'}]",
        "total_steps=2",
        "runtime.backend=local",
    ]
    assert main(["train", str(EXAMPLE), *overrides]) == 0
    rows = read_metrics(tmp_path / "multi_domain")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        # 8 prompts x 4 samples a step, drawn 4 / 2 / 2 by the configured shares 0.5 / 0.25 / 0.25.
        shares = {d: row[f"reward/{d}/share"] for d in ("math", "code", "instruct")}
        assert shares == {"math": 0.5, "code": 0.25, "instruct": 0.25}
        assert row["reward/errors"] == 0 and row["reward/timeouts"] == 0
        for d in shares:
            assert 0.0 <= row[f"reward/{d}/accuracy"] <= 1.0
        assert "reward/math/math_verify/parsed" in row and "reward/code/no_code" in row
    # The held-out set has 2 rows per domain, each scored by its own domain's rewards.
    assert [rows[0][f"eval/{d}/share"] for d in ("math", "code", "instruct")] == [pytest.approx(1 / 3)] * 3
