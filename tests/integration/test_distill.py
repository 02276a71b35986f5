"""Distillation through the CLI: a student learns from a larger SFT-trained teacher, on-policy and offline.

The short tests use the session's tiny assets (a teacher SFT-trained for a minute) and check the direction
of the effect; the long one runs examples/distill/ as shipped and checks the acceptance bar: on-policy
distillation closes at least half of the teacher-student held-out accuracy gap.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reroll.cli import main
from reroll.runtime import checkpoint
from reroll.runtime.metrics import read_metrics
from tests.conftest import ROOT, reroll_cli, reroll_here, write_config

pytestmark = pytest.mark.integration
EXAMPLES = ROOT / "examples" / "distill"


# teacher and student learn from scratch on raw text (no chat format to match), as the examples do
RAW_PROMPTS = {"chat_template": False}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, assets) -> Path:
    """A teacher larger than the student (hidden 128, 2 layers vs 64), SFT-trained on the assets' rows."""
    tmp = tmp_path_factory.mktemp("teacher")
    cfg = write_config(
        tmp / "t.yaml",
        assets,
        pipeline="sft",
        name="teacher",
        model={
            "path": str(tmp / "model"),
            "build_tiny": {"hidden_size": 128, "num_layers": 2, "num_heads": 4},
        },
        sft={"steps": 120, "batch_size": 32, "lr": 3e-3},
        eval={"every": 0},
        data=RAW_PROMPTS,
    )
    assert main(["train", str(cfg), "runtime.backend=local"]) == 0
    return tmp / "runs" / "teacher" / "checkpoints" / "step_000120" / "model"


def _distill(tmp_path, assets, teacher, **sections) -> Path:
    base = {
        "pipeline": "distill",
        "name": "d",
        "total_steps": 15,
        "distill": {"teachers": {"arithmetic": {"model_path": str(teacher)}}},
        "optim": {"lr": 3e-3, "micro_batch_size": 64},
        "rollout": {"batch_size": 64, "group_size": 4, "max_new_tokens": 4},
        "eval": {"every": 0},
    }
    for key, value in sections.items():
        base[key] = {**base[key], **value} if isinstance(base.get(key), dict) else value
    base["data"] = {**RAW_PROMPTS, **base.get("data", {})}
    return write_config(tmp_path / "d.yaml", assets, **base)


def test_on_policy_distillation_moves_the_student_to_the_teacher(tmp_path, assets, teacher):
    # the student from its random init: far from the teacher, so the fall of the KL is well above its noise
    cfg = _distill(tmp_path, assets, teacher, total_steps=20, distill={"on_policy_loss": "topk"})
    out = reroll_here("train", cfg)  # the real path: Ray actors for student, engine, teacher and reward
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path / "runs" / "d")
    kl = [r["distill/reverse_kl"] for r in rows[1:]]
    assert sum(kl[-3:]) < 0.7 * sum(kl[:3]), kl  # the per-token reverse KL to the teacher falls
    assert rows[-1]["eval/accuracy"] >= rows[0]["eval/accuracy"], (rows[0], rows[-1])
    assert rows[-1]["timing/teacher"] > 0


def test_offline_distillation_caches_the_teacher_and_resumes(tmp_path, assets, teacher):
    distill = {"mode": "offline", "top_k": 8, "ce_weight": 0.1, "batch_size": 32}
    cfg = _distill(
        tmp_path,
        assets,
        teacher,
        total_steps=60,
        distill=distill,
        checkpoint={"every": 30},
        data={"eval_limit": 64},
    )
    local = "runtime.backend=local"
    assert main(["train", str(cfg), local, "total_steps=30"]) == 0
    cache = tmp_path / "runs" / "d" / "teacher_cache.pt"
    made = cache.stat().st_mtime_ns
    assert main(["train", str(cfg), local, "--resume"]) == 0
    assert cache.stat().st_mtime_ns == made  # read back, not recomputed
    rows = read_metrics(tmp_path / "runs" / "d")
    assert [r["step"] for r in rows] == list(range(61))
    fkl = [r["distill/forward_kl"] for r in rows[1:]]
    assert fkl[-1] < 0.6 * fkl[0], fkl
    # the random student never ends an answer (every held-out response cut at the cap); the distilled one
    # ends them as the teacher does. Not held-out accuracy: 60 steps leave it at 0-3 of the 64 rows, which
    # the CPU's kernels decide (0.047 at step 30 and 0.000 at step 60 with ATEN_CPU_CAPABILITY=avx2)
    assert rows[0]["eval/truncated"] == 1.0
    assert rows[-1]["eval/truncated"] < 0.5, rows[-1]


def test_rows_go_to_their_teacher_by_domain(tmp_path, assets, teacher):
    rows = [json.loads(line) for line in assets["train"].read_text().splitlines()]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(
        "".join(json.dumps({**r, "domain": "easy" if i % 2 else "hard"}) + "\n" for i, r in enumerate(rows))
    )
    teachers = {
        "trained": {"model_path": str(teacher), "tags": ["hard"]},
        "untrained": {"model_path": str(assets["model"]), "tags": ["easy", "arithmetic"]},
    }
    cfg = _distill(
        tmp_path,
        assets,
        teacher,
        total_steps=2,
        distill={"teachers": teachers},
        data={"train_files": [str(mixed)]},
    )
    assert main(["train", str(cfg), "runtime.backend=local"]) == 0
    last = read_metrics(tmp_path / "runs" / "d")[-1]
    # the student is the untrained model itself: its KL to that teacher is 0 on its own samples at step 1;
    # to the trained teacher it is large
    assert last["distill/trained/reverse_kl"] > 0.5
    assert last["distill/trained/reverse_kl"] > 5 * abs(last["distill/untrained/reverse_kl"])


@pytest.mark.long
def test_examples_on_policy_distillation_closes_half_the_gap(tmp_path):
    """examples/distill as shipped: the teacher by SFT, then the student's warm start and on-policy
    distillation. Measured on the 2-core dev machine: see README (Distillation)."""
    assets = tmp_path / "assets"
    data = [f"data.train_files=[{assets}/train.jsonl]", f"data.eval_files=[{assets}/test.jsonl]"]
    common = [f"output_dir={tmp_path}/{{name}}", *data, "runtime.backend=local"]
    out = reroll_cli(
        "train", EXAMPLES / "teacher_sft.yaml", *common, f"model.path={assets}/teacher", timeout=3000
    )
    assert out.returncode == 0, out.stderr[-3000:]
    teacher_acc = read_metrics(tmp_path / "distill-teacher")[-1]["eval/accuracy"]
    teacher = checkpoint.latest(tmp_path / "distill-teacher") / "model"
    out = reroll_cli(
        "train", EXAMPLES / "on_policy.yaml", *common, f"model.path={assets}/student",
        f"distill.teachers.arithmetic.model_path={teacher}", timeout=3000,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path / "distill-on-policy")
    start, end = rows[0]["eval/accuracy"], rows[-1]["eval/accuracy"]
    # the teacher must be good for the gap to mean something: it read 0.905 / 0.965 (seeds 0 / 1) and
    # 0.89 on seed 0 after a float-rounding change (the student then closed 75 % of the gap)
    assert teacher_acc >= 0.85, teacher_acc
    assert (end - start) >= 0.5 * (teacher_acc - start), (teacher_acc, start, end)
