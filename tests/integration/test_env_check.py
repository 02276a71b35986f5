"""`reroll env-check` through the CLI, and the tool math env (math-verify and the Python sandbox load here)."""

from __future__ import annotations

import pytest

from reroll.cli import main
from reroll.envs.check import check_env

pytestmark = pytest.mark.integration


def test_tool_math_scripted_calls_calculator_and_wins():
    report = check_env("tool_math", {"tools": ["calculator"]}, policy="scripted", episodes=5)
    assert report.success_rate == 1.0 and report.total_turns == 10
    assert '"name": "calculator"' in report.transcript[1]


def test_env_check_command(capsys):
    assert main(["env-check", "frozenlake", "--episodes", "5"]) == 0
    assert "frozenlake: 5 episodes with the random policy" in capsys.readouterr().out
    assert main(["env-check", "sokoban", "num_boxes=2", "--episodes", "5"]) == 0
    assert "sokoban: 5 episodes" in capsys.readouterr().out
    assert main(["env-check", "nim", "--policy", "scripted", "--episodes", "50", "--show-turns", "0"]) == 0
    assert main(["env-check", "nope"]) == 2
    assert "unknown environment 'nope'" in capsys.readouterr().err
