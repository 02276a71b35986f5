"""The multi-GPU kit's table (tests/multigpu/kit.py), from a fake numbers file and fake outcomes: what a
machine with GPUs would print, checked on this CPU one."""

from __future__ import annotations

import json

from tests.multigpu.kit import RESULTS_ENV, Outcome, read_numbers, recorder, table


def test_recorded_numbers_and_outcomes_make_the_table(tmp_path, monkeypatch):
    path = tmp_path / "numbers.jsonl"
    monkeypatch.setenv(RESULTS_ENV, str(path))
    record = recorder("tests/multigpu/test_kit_vllm_tp2.py::test_tp2")
    record("log-prob max diff", 0.0625, "nats")
    record("sync", 1.23456, "s")
    recorder("tests/gpu/test_megatron.py::test_pp2")("loss rel diff", 3e-6)
    numbers = read_numbers(path)
    assert json.loads(path.read_text().splitlines()[0]) == {
        "test": "tests/multigpu/test_kit_vllm_tp2.py::test_tp2",
        "name": "log-prob max diff",
        "value": 0.0625,
        "unit": "nats",
    }
    outcomes = [
        Outcome("tests/multigpu/test_kit_vllm_tp2.py::test_tp2", 2, "passed", seconds=41.2),
        Outcome(
            "tests/multigpu/test_kit_examples.py::test_7b",
            2,
            "skipped",
            "needs 2 CUDA GPUs, this machine has 1",
        ),
        Outcome("tests/gpu/test_megatron.py::test_pp2", None, "failed", "AssertionError: 0.1 > 0.01"),
    ]
    for o in outcomes:
        o.numbers = numbers.get(o.test, [])
    lines = table(outcomes, ["host h: 1 CUDA GPUs (NVIDIA H100)"]).splitlines()
    assert lines[0] == "host h: 1 CUDA GPUs (NVIDIA H100)"
    [head] = [line for line in lines if line.startswith("test ")]
    assert [c.strip() for c in head.split("|")] == ["test", "GPUs", "result", "measured", "s"]
    rows = {
        line.split("|")[0].strip(): [c.strip() for c in line.split("|")[1:]] for line in lines if "::" in line
    }
    assert rows["multigpu/test_kit_vllm_tp2.py::test_tp2"] == [
        "2",
        "passed",
        "log-prob max diff 0.0625 nats; sync 1.235 s",
        "41",
    ]
    assert rows["multigpu/test_kit_examples.py::test_7b"] == [
        "2",
        "skipped: needs 2 CUDA GPUs, this machine has 1",
        "-",
        "0",
    ]
    assert rows["gpu/test_megatron.py::test_pp2"] == [
        "?",  # no gpus= on its multigpu mark
        "failed: AssertionError: 0.1 > 0.01",
        "loss rel diff 3e-06",
        "0",
    ]
    assert lines[-1] == "1 failed, 1 passed, 1 skipped"


def test_without_the_runner_a_number_is_only_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(RESULTS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("INFO", logger="tests.multigpu.kit"):
        recorder("t::x")("sync", 2.0, "s")
    assert "t::x sync = 2 s" in caplog.text
    assert not list(tmp_path.iterdir())
    assert read_numbers(tmp_path / "none.jsonl") == {}
