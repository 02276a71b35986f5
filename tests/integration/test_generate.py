"""``reroll generate`` through the CLI: a checkpoint of a real run, scored responses in JSONL, pass@k,
a rerun that continues the file; and the runs print none of the third-party notices hidden by default."""

from __future__ import annotations

import importlib.util
import json

import pytest

from reroll.pipelines.generate import pass_at_k
from tests.conftest import reroll_cli, reroll_here, write_config
from tests.integration.generate_rewards import odd_first_digit

pytestmark = pytest.mark.integration

REWARD = "reward.fn=tests.integration.generate_rewards:odd_first_digit"
NOISE = (
    "Setting accelerator to CPU",  # DeepSpeed, imported by save_pretrained through accelerate
    "Token authentication is enabled",  # Ray
    "Writing model shards",  # the tiny kit's save_pretrained
    "Loading safetensors checkpoint shards",  # vLLM's loading bar
    "(MainProcess pid=",  # vLLM's log lines in a worker
    "Triton is installed",  # vLLM on CPU, before its logging is set up
    "NUMA binding",  # torch's C++ warning under vLLM on CPU
)


def _summary_row(stdout: str) -> list[float]:
    [row] = [ln.split() for ln in stdout.splitlines() if ln.strip().startswith("all ")]
    return [float(x) for x in row[1:]]


def test_generate_from_a_run_checkpoint_scores_and_resumes(tmp_path, assets):
    # a one-step run whose model the tiny kit builds at start, checkpointed at the end
    cfg = write_config(
        tmp_path / "c.yaml",
        assets,
        total_steps=1,
        model={"path": str(tmp_path / "tiny"), "build_tiny": {"hidden_size": 64, "num_heads": 2}},
        eval={"every": 0},
        data={"eval_limit": 6},
        logging={"tensorboard": False, "sample_every": 0},
    )
    train = reroll_cli("train", cfg, "runtime.backend=local")  # the checkpoint, quickly: generate runs on Ray
    assert train.returncode == 0, train.stderr
    run_dir = tmp_path / "runs" / "t"
    assert (run_dir / "checkpoints" / "step_000001" / "model" / "config.json").exists()
    for noise in NOISE:
        assert noise not in train.stdout + train.stderr

    # the run directory stands for its newest checkpoint; vLLM as the engine where it is installed
    engine = "vllm" if importlib.util.find_spec("vllm") else "hf"
    out = tmp_path / "gen.jsonl"
    args = ["generate", cfg, "--checkpoint", run_dir, "--out", out, REWARD, "rollout.temperature=1.5"]
    first = reroll_cli(*args, f"rollout.engine={engine}")
    assert first.returncode == 0, first.stderr
    for noise in NOISE:
        assert noise not in first.stdout + first.stderr
    records = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(6))  # data.eval_limit held-out prompts
    model_dir = str(run_dir / "checkpoints" / "step_000001" / "model")
    for r in records:
        assert r["model"] == model_dir and len(r["responses"]) == 4  # rollout.group_size
        for response, score, correct, details in zip(r["responses"], r["scores"], r["correct"], r["details"]):
            expected = odd_first_digit(r["prompt"], response, {})
            assert score == expected.score and correct == (score == 1.0) and details == expected.details
    correct = [sum(r["correct"]) for r in records]
    assert 0 < sum(correct) < 24  # the reward separates responses: the numbers below are not all 0 or 1
    expected = [
        len(records),
        sum(s for r in records for s in r["scores"]) / 24,  # reward
        sum(correct) / 24,  # accuracy
        *(sum(pass_at_k(4, c, k) for c in correct) / 6 for k in (1, 2, 4)),
    ]
    assert _summary_row(first.stdout) == pytest.approx(expected, abs=1e-3)
    assert "pass@1   pass@2   pass@4" in first.stdout and "6 new, 0 already in the file" in first.stdout

    # a rerun skips what the file holds; the prompts it lost are generated again, the rest kept as they were
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:2]) + "\n")
    again = reroll_here(*args, "runtime.backend=local")
    assert again.returncode == 0, again.stderr
    redone = out.read_text().splitlines()
    assert redone[:2] == lines[:2] and len(redone) == 6
    assert sorted(json.loads(ln)["index"] for ln in redone) == list(range(6))
    assert "4 new, 2 already in the file" in again.stdout

    # one response per prompt: no group, which GRPO would need to train, and none needed to sample
    single = reroll_here(
        *args[:5], tmp_path / "one.jsonl", *args[6:], "runtime.backend=local", "rollout.group_size=1"
    )
    assert single.returncode == 0, single.stderr
    assert [len(json.loads(ln)["responses"]) for ln in (tmp_path / "one.jsonl").read_text().splitlines()] == [
        1
    ] * 6
    assert "6 prompts x 1 responses" in single.stdout and "pass@1" in single.stdout

    # a file written with another n is refused, not mixed
    other = reroll_here(*args, "runtime.backend=local", "rollout.group_size=2", "rollout.batch_size=16")
    assert other.returncode == 2
    assert (
        "holds 4 responses" in other.stderr
        and "asks for 2" in other.stderr
        and "Traceback" not in other.stderr
    )
