"""llm_judge against a stub OpenAI-compatible server on 127.0.0.1; engine_judge with a scripted engine."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from reroll.config.reward import RewardConfig, check_reward
from reroll.config.schema import RunConfig
from reroll.data.types import Completion, RewardItem
from reroll.errors import UserError
from reroll.rewards.base import RewardResult
from reroll.rewards.judge import DEFAULT_TEMPLATE, engine_judge, judge_prompt, llm_judge, parse_score
from reroll.rewards.routing import RewardRouter
from reroll.roles.judge import JudgeClient, JudgeWorker
from reroll.roles.reward import OtherRoleFailed, RewardWorker
from reroll.runtime.actors import LocalHandle


@pytest.fixture
def judge_server():
    """A server that answers each request with the next reply in ``replies``; requests are kept."""
    state = {"replies": [], "requests": []}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state["requests"].append(
                {"path": self.path, "body": body, "auth": self.headers.get("Authorization")}
            )
            reply = {"choices": [{"message": {"role": "assistant", "content": state["replies"].pop(0)}}]}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}/v1"
    yield state
    server.shutdown()


def test_score_parsed_and_scaled(judge_server, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    judge_server["replies"] = ["Accurate and concise.\nScore: 8"]
    r = llm_judge(
        "What is 2+2?", "4", {"answer": "4"}, url=judge_server["url"], model="j", api_key_env="JUDGE_KEY"
    )
    assert r.score == pytest.approx(0.8) and r.details["judge_parse_error"] == 0
    req = judge_server["requests"][0]
    assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer sk-test"
    assert req["body"]["model"] == "j" and "What is 2+2?" in req["body"]["messages"][0]["content"]


def test_template_sees_row_fields(judge_server):
    judge_server["replies"] = ["7"]
    template = "Q: {prompt}\nReference: {answer}\nA: {response}\nScore 0-{max_score}:"
    r = llm_judge("q", "resp", {"answer": "ref"}, url=judge_server["url"], template=template, max_score=7)
    assert r.score == 1.0
    assert (
        judge_server["requests"][0]["body"]["messages"][0]["content"]
        == "Q: q\nReference: ref\nA: resp\nScore 0-7:"
    )


def test_parse_failure_gives_the_defined_score_and_is_counted(judge_server):
    judge_server["replies"] = ["I refuse to grade this."]
    r = llm_judge("q", "a", {}, url=judge_server["url"], parse_error_score=-1.0)
    assert r.score == -1.0 and r.details == {"judge_parse_error": 1, "judge_request_error": 0}


def test_unreachable_endpoint_is_a_counted_failure():
    r = llm_judge("q", "a", {}, url="http://127.0.0.1:9/v1", timeout_s=2)
    assert r.score == 0.0 and r.details["judge_parse_error"] == 1 and r.details["judge_request_error"] == 1


def test_parse_score():
    assert parse_score("reason... Score: 9/10", max_score=10) == pytest.approx(0.9)
    assert parse_score("score = 15", max_score=10) == 1.0  # clipped
    assert parse_score("no digits", max_score=10) is None


# engine_judge: the judge served by reroll's own engine as the `judge` role.


class ScriptedEngine:
    """The engine interface (``generate(prompts, params) -> list[list[Completion]]``) with set replies."""

    def __init__(self, replies):
        self.replies, self.prompts, self.params = list(replies), [], []

    def generate(self, prompts, params):
        if not self.replies:
            raise RuntimeError("the judge engine crashed")
        self.prompts += prompts
        self.params.append(params)
        return [[Completion([], [], self.replies.pop(0), [], "stop")] for _ in prompts]


def run_config(tmp_path, **reward):
    return RunConfig.model_validate(
        {
            "pipeline": "rlvr",
            "model": {"path": str(tmp_path / "m")},
            "data": {"train_files": [str(tmp_path / "rows.jsonl")]},
            "runtime": {"backend": "local"},
            "reward": {
                "fn": "engine_judge",
                "judge": {"model_path": str(tmp_path / "j"), "max_new_tokens": 7},
            }
            | reward,
        }
    )


def scripted_client(tmp_path, replies):
    engine = ScriptedEngine(replies)
    worker = JudgeWorker(0, run_config(tmp_path), engine=engine)
    return JudgeClient([LocalHandle(worker)], timeout_s=10), engine


def test_engine_judge_parses_like_the_endpoint_judge(tmp_path):
    client, engine = scripted_client(tmp_path, ["Accurate.\nScore: 8", "I refuse to grade this."])
    r = engine_judge("What is 2+2?", "4", {"answer": "4"}, judge=client)
    assert r == RewardResult(0.8, {"judge_parse_error": 0, "judge_request_error": 0})
    # The same prompt the endpoint judge sends, decoded greedily with reward.judge.max_new_tokens.
    assert engine.prompts == [judge_prompt(DEFAULT_TEMPLATE, "What is 2+2?", "4", {}, max_score=10.0)]
    assert (engine.params[0].temperature, engine.params[0].max_new_tokens) == (0.0, 7)
    r = engine_judge("q", "a", {}, judge=client, parse_error_score=-1.0)
    assert r == RewardResult(-1.0, {"judge_parse_error": 1, "judge_request_error": 0})


def test_a_failing_judge_fails_the_reward_call_naming_the_judge(tmp_path):
    cfg = run_config(tmp_path)
    client, _ = scripted_client(tmp_path, [])  # no replies: its engine raises
    worker = RewardWorker(0, cfg.reward, judge=client)
    with pytest.raises(
        OtherRoleFailed, match=r"judge\[0\] failed during judge: RuntimeError: the judge engine crashed"
    ) as e:
        worker.score([RewardItem("q", "a", {})])
    assert (e.value.role_error().role, e.value.role_error().rank) == ("judge", 0)  # what RewardGroup raises


def test_judge_config_is_checked(tmp_path):
    cfg = run_config(tmp_path)
    assert check_reward(cfg.reward) == []
    no_judge = RewardConfig(fn="engine_judge")
    assert check_reward(no_judge) == [
        ("reward.judge", "reward is engine_judge, which needs reward.judge: {model_path: ...}")
    ]
    unused = RewardConfig(fn="exact_match", judge={"model_path": "x"})
    assert "no reward is engine_judge" in check_reward(unused)[0][1]
    with pytest.raises(UserError, match="engine_judge needs the judge role"):
        RewardRouter(no_judge)
