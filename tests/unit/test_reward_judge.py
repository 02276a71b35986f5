"""llm_judge against a stub OpenAI-compatible server on 127.0.0.1."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from reroll.rewards.judge import llm_judge, parse_score


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
