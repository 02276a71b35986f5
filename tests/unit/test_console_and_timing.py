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
