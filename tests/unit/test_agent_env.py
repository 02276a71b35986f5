"""``agent:`` environments: loading the agent function, its return values, its config and failures,
and how the chat endpoint reads a request."""

from __future__ import annotations

import json
import math
import time

import pytest

from reroll.config.schema import RunConfig
from reroll.data.types import SamplingParams
from reroll.envs.agent import is_agent, load_agent, outcome, play
from reroll.errors import UserError
from reroll.pipelines.preflight import check_inputs
from reroll.rewards.base import RewardResult
from reroll.roles.chat_server import RequestError, _messages, _params
from reroll.roles.env import EnvWorker

HERE = __name__


def agent(base_url, task, *, bonus=0.0):
    return task["seed"] / 10 + bonus


def raises(base_url, task):
    raise ConnectionError(f"cannot reach {base_url}")


def sleeps(base_url, task):
    time.sleep(3)
    return 1.0


def test_load_agent_names_what_to_fix():
    assert is_agent(f"agent:{HERE}:agent") and not is_agent("nim")
    assert load_agent(f"agent:{HERE}:agent", {"bonus": 1.0})("u", {"seed": 5}, bonus=1.0) == 1.5
    with pytest.raises(UserError, match=r"write an agent as 'agent:package\.module:function'"):
        load_agent("agent:no_colon", {})
    with pytest.raises(UserError, match=r"agent 'nowhere\.at_all:run' cannot be imported"):
        load_agent("agent:nowhere.at_all:run", {})
    with pytest.raises(UserError, match=r"does not bind .*unexpected keyword argument 'bonsu'.*\['bonsu'\]"):
        load_agent(f"agent:{HERE}:agent", {"bonsu": 1.0})


def test_outcome_of_numbers_results_and_bad_returns():
    assert (outcome(0.5).reward, outcome(0.5).success) == (0.5, True)
    assert (outcome(True).reward, outcome(0).success) == (1.0, False)
    graded = outcome(RewardResult(0.3, {"success": False, "note": "partial", "skip": [1]}))
    assert (graded.reward, graded.success, graded.info) == (0.3, False, {"success": False, "note": "partial"})
    assert "returned str; return a number or a RewardResult" in outcome("1.0").error
    assert "a reward of nan" in outcome(math.nan).error
    assert play(raises, "http://x/v1", {"seed": 1}, {}).error == "ConnectionError: cannot reach http://x/v1"


def test_env_worker_plays_agents_each_under_the_timeout():
    worker = EnvWorker(0, f"agent:{HERE}:sleeps", {}, 0.5)
    start = time.monotonic()
    [late] = worker.play_agents([(0, "http://x/v1", {"seed": 0})])
    assert time.monotonic() - start < 2
    assert late.error == "no answer within 0.5 s (agentic.agent_timeout_s)"
    worker = EnvWorker(0, f"agent:{HERE}:agent", {"bonus": 0.5}, 5.0)
    a, b = worker.play_agents([(0, "u", {"seed": 2}), (1, "u", {"seed": 0})])
    assert (a.reward, a.terminated, a.info["success"], a.error) == (pytest.approx(0.7), True, True, None)
    assert (b.episode, b.reward) == (1, 0.5)


@pytest.fixture
def agentic(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))

    def make(**agentic) -> RunConfig:
        cfg = RunConfig.model_validate(
            {
                "pipeline": "agentic",
                "output_dir": str(tmp_path / "runs" / "{name}"),
                "model": {"path": str(model)},
                "agentic": {"env": f"agent:{HERE}:agent", **agentic},
                "rollout": {"batch_size": 4, "group_size": 4},
            }
        )
        return cfg

    return make


def test_config_and_preflight_checks_of_an_agent(agentic, tmp_path):
    assert agentic().check() == [] and check_inputs(agentic()) == []
    problems = {p.path: p.message for p in agentic(system_prompt="be brief").check()}
    assert "put the system prompt in the agent" in problems["agentic.system_prompt"]
    problems = {p.path: p.message for p in agentic(streaming=True).check()}
    assert "always advance independently" in problems["agentic.streaming"]
    assert agentic(env="nim", streaming=True).check() == []
    nim = agentic(env="nim", tasks="t.jsonl")
    assert (
        "tasks are read by 'agent:' environments only"
        in {p.path: p.message for p in nim.check()}["agentic.tasks"]
    )
    bad = {
        p.path: p.message
        for p in check_inputs(agentic(env_config={"bonsu": 1}, tasks=str(tmp_path / "no.jsonl")))
    }
    assert "does not bind" in bad["agentic.env"]
    assert "no.jsonl' does not exist: fix the path in agentic.tasks" in bad["agentic.tasks"]


def test_requests_are_read_as_openai_sends_them():
    parts = {"role": "user", "content": [{"type": "text", "text": "pile "}, {"type": "text", "text": "7"}]}
    assert _messages({"messages": [parts]}) == [{"role": "user", "content": "pile 7"}]
    with pytest.raises(RequestError, match=r"messages\[0\].content must be text"):
        _messages({"messages": [{"role": "user", "content": 3}]})
    defaults = SamplingParams(temperature=0.7, max_new_tokens=9, stop=("x",))
    assert _params({}, defaults) == defaults
    asked = _params(
        {"max_completion_tokens": 3, "temperature": 0, "stop": "y", "n": 2, "top_k": 5, "seed": 1}, defaults
    )
    assert asked == SamplingParams(n=2, temperature=0.0, top_k=5, max_new_tokens=3, stop=("y",), seed=1)
    with pytest.raises(RequestError, match="not a number"):
        _params({"temperature": "hot"}, defaults)
