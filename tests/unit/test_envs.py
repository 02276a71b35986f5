"""Environments, tools, the registry and env-check: no model involved."""

from __future__ import annotations

import pytest

from reroll.envs import make_env
from reroll.envs.frozenlake import FrozenLake
from reroll.envs.nim import Nim
from reroll.envs.sokoban import Sokoban
from reroll.envs.tools import Calculator, ToolCall, ToolEnv, parse_tool_calls, run_tool_call
from reroll.errors import UserError


def _play(env, seed: int, policy: str, max_turns: int = 100) -> tuple[float, int]:
    env.reset(seed)
    for turn in range(1, max_turns + 1):
        action = env.sample_random_action() if policy == "random" else env.scripted_action()
        _obs, reward, terminated, truncated, _info = env.step(action)
        if terminated or truncated:
            return reward, turn
    return 0.0, max_turns


def test_nim_rules_and_policies():
    env = Nim(min_pile=5, max_pile=5)
    assert env.reset(0) == ("pile 5", {"pile": 5})
    # take 1 leaves 4: the opponent must leave 1..3, which we then take
    obs, reward, done, _, _ = env.step("1")
    assert not done and obs in ("pile 1", "pile 2", "pile 3")
    obs, reward, done, _, info = env.step(obs.split()[1])
    assert (obs, reward, done, info) == ("you win", 1.0, True, {"success": True})
    env.reset(0)
    assert env.step("4")[1:4] == (0.0, True, False)  # more than max_take: invalid, episode lost
    wins = {p: sum(_play(Nim(), s, p)[0] for s in range(400)) / 400 for p in ("random", "scripted")}
    assert 0.4 < wins["random"] < 0.6 and wins["scripted"] > 0.9, wins  # measured 0.50 / 0.98


def test_nim_seeded():
    a, b = Nim(), Nim()
    assert [a.reset(s) for s in range(20)] == [b.reset(s) for s in range(20)]
    assert [_play(Nim(), s, "random") for s in range(20)] == [_play(Nim(), s, "random") for s in range(20)]


def test_sokoban_levels_are_solvable_by_their_solution():
    for seed in range(100):
        env = Sokoban(width=7, height=7, num_boxes=1 + seed % 2)
        obs, _ = env.reset(seed)
        assert obs.count("@") + obs.count("+") == 1 and obs.count("$") >= 1  # some box is off its goal
        assert obs.count("$") + obs.count("*") == env.num_boxes
        assert _play(env, seed, "scripted")[0] == 1.0


def test_sokoban_push_rules():
    env = Sokoban()
    env.reset(3)  # ######/#__._#/#___##/#_#$@#/#____#/######: box left of the player
    env.step("left")  # pushes the box into (3, 2)? no: (3, 2) is a wall, so nothing moves
    assert env.player == (3, 4) and env.boxes == {(3, 3)}
    env.step("up")
    assert env.player == (2, 4) or (2, 4) in env.walls


def test_frozenlake_path_and_holes():
    for seed in range(50):
        env = FrozenLake(size=5, hole_prob=0.3)
        env.reset(seed)
        assert env._path((0, 0)) is not None
        assert _play(env, seed, "scripted")[0] == 1.0
    env = FrozenLake(size=2, hole_prob=0.0)
    env.reset(0)
    assert env.step("go right please")[1:3] == (0.0, False)
    assert env.step("down")[1:3] == (1.0, True)


def test_parse_tool_calls_formats():
    text = (
        'a <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call> b '
        '<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>'
        "<tool_call>{oops}</tool_call>"
    )
    calls = parse_tool_calls(text, "hermes")
    assert calls[0] == ToolCall("calculator", {"expression": "1+2"})
    assert calls[1] == ToolCall("python", {"code": "print(1)"})  # arguments given as a JSON string
    assert calls[2].error is not None and "not valid JSON" in calls[2].error
    tagged = '<act>{"name": "calculator", "parameters": {"expression": "2*3"}}</act>'
    assert parse_tool_calls(tagged, "json_tags", tag="act") == [ToolCall("calculator", {"expression": "2*3"})]
    assert parse_tool_calls(tagged, "hermes") == []


def test_calculator_and_tool_errors():
    calc = Calculator()
    assert calc("(3 + 4) * 12 / 5") == "84/5" and calc("2**10 - 24") == "1000" and calc("1.5 * 2") == "3.0"
    tools = {"calculator": calc}
    assert run_tool_call(tools, ToolCall("calculator", {"expression": "7/2"})) == "7/2"
    assert "no tool named 'search'" in run_tool_call(tools, ToolCall("search", {}))
    assert "missing argument 'expression'" in run_tool_call(tools, ToolCall("calculator", {}))
    assert "must be a string" in run_tool_call(tools, ToolCall("calculator", {"expression": 3}))
    assert "failed: ValueError" in run_tool_call(
        tools, ToolCall("calculator", {"expression": "__import__('os')"})
    )


def test_tool_env_limits_calls_per_episode():
    env = ToolEnv(Nim(), [Calculator()], max_calls=2)
    env.reset(0)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    assert env.step(call)[0] == "<tool_response>\n2\n</tool_response>"
    obs = env.step(call + call)[0]  # the second call of this turn is over the limit
    assert obs.count("<tool_response>") == 2 and "limit of 2 tool calls" in obs
    assert env.step("1")[0].startswith(("pile", "you"))  # no call: the inner game steps
    env.reset(1)
    assert env.calls == 0


def test_registry_is_strict():
    with pytest.raises(
        UserError, match=r"unknown environment 'sokobam' \(did you mean 'sokoban'\?\).*frozenlake"
    ):
        make_env("sokobam")
    with pytest.raises(UserError, match=r"no option 'boxes'; its options are width=6, height=6, num_boxes=1"):
        make_env("sokoban", {"boxes": 2})
    with pytest.raises(UserError, match="num_boxes is 0"):
        make_env("sokoban", {"num_boxes": 0})
