import time

from reroll.runtime.console import step_line
from reroll.runtime.timing import PhaseTimer


def test_phase_timer_accumulates_and_resets():
    timer = PhaseTimer()
    with timer("generate"):
        time.sleep(0.01)
    with timer("generate"):
        pass
    out = timer.pop()
    assert out["timing/generate"] >= 0.01
    assert set(out) == {"timing/generate"}
    assert timer.pop() == {}


def test_step_line_shows_metrics_and_phases():
    line = step_line(
        3,
        10,
        {"rollout/reward_mean": 0.5, "rollout/accuracy": 0.25, "timing/generate": 1.25, "timing/step": 2.0},
    )
    assert line == "step 3/10 | reward 0.500 | acc 0.250 | gen 1.2s | 2.0s"


def test_step_line_shows_cut_responses_and_failed_reward_calls_only_when_not_zero():
    quiet = {"rollout/accuracy": 0.5, "rollout/truncated": 0.0, "reward/errors": 0.0, "reward/timeouts": 0.0}
    assert step_line(1, 2, quiet) == "step 1/2 | acc 0.500"
    loud = quiet | {
        "rollout/truncated": 0.338,
        "reward/errors": 3.0,
        "eval/truncated": 0.25,
        "eval/errors": 1.0,
    }
    assert (
        step_line(1, 2, loud) == "step 1/2 | acc 0.500 | cut 0.338 | eval_cut 0.250 | rew_err 3 | eval_err 1"
    )
