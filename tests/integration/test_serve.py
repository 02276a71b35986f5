"""The OpenAI-compatible endpoint (``reroll serve``) and the agent proxy of agentic training, driven by
the official ``openai`` client against servers on free ports of this machine."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from reroll.config.schema import RunConfig
from reroll.data.types import SamplingParams
from reroll.runtime.metrics import read_metrics
from tests.conftest import QUICKSTART, quickstart_overrides, reroll_cli, reroll_here

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def game_model(tmp_path_factory) -> Path:
    from reroll.models.tiny import GAME_ALPHABET, build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("game") / "model", alphabet=GAME_ALPHABET, hidden_size=64, num_heads=2
    )


@pytest.fixture(scope="module")
def engine(game_model):
    from reroll.engines.hf import HFEngine

    return HFEngine(str(game_model))


@pytest.fixture(scope="module")
def tokenizer(game_model):
    from reroll.models.loading import load_tokenizer

    return load_tokenizer(str(game_model))


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


def test_a_two_turn_agent_is_recorded_as_the_chat_template_of_its_conversation(engine, tokenizer):
    from reroll.roles.chat_server import ChatServer

    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=0)
    with ChatServer(engine.generate, tokenizer, model_name="tiny", defaults=params) as server:
        key = server.open_episode(params, max_turns=4, max_tokens=256)
        client = _client(server.episode_url(key))
        messages = [{"role": "system", "content": "play nim"}, {"role": "user", "content": "pile 13"}]
        replies = []
        for observation in ("pile 9, your move", None):
            reply = client.chat.completions.create(model="anything", messages=messages)
            replies.append(reply)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            if observation is not None:
                messages.append({"role": "user", "content": observation})
        with pytest.raises(
            openai.BadRequestError, match="does not continue the episode"
        ):  # history rewritten
            client.chat.completions.create(
                model="m", messages=[messages[0], {"role": "user", "content": "pile 1"}]
            )
        record = server.close_episode(key)
        with pytest.raises(openai.NotFoundError, match="no open episode"):
            client.chat.completions.create(model="m", messages=messages[:2])

    traj = record.traj
    whole = tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
    assert traj.ids == whole  # token-exact: the recorded sequence is the template over the whole conversation
    assert traj.turns == 2 and record.states == ["pile 13", "pile 9, your move"]
    # the loss covers exactly the tokens the engine generated, turn by turn, and nothing else
    generated = [i for i, p in zip(traj.ids, traj.policy) if p]
    usage = [r.usage.completion_tokens for r in replies]
    assert len(generated) == sum(usage) == 12
    assert tokenizer.decode(generated) == "".join(r.choices[0].message.content for r in replies)
    assert [t for t in traj.turn if t >= 0] == [0] * usage[0] + [1] * usage[1]
    # the recorded log-probs are the engine's for those tokens in this very sequence
    ids = torch.tensor([traj.ids])
    scored = engine.score(ids, torch.ones_like(ids, dtype=torch.bool), 1.0)[0]
    mask = torch.tensor(traj.policy)
    assert torch.tensor(traj.logprobs)[mask] == pytest.approx(scored[mask], abs=1e-4)
    assert all(lp == 0.0 for lp, p in zip(traj.logprobs, traj.policy) if not p)


def _hf_server(engine, tokenizer, defaults: SamplingParams, **kw):
    """A server over the hf engine as ``reroll serve`` builds one: its spec, its token stream."""
    from reroll.config.engines import engine_spec
    from reroll.roles.chat_server import ChatServer

    return ChatServer(engine.generate, tokenizer, model_name="tiny", defaults=defaults,
                      spec=engine_spec("hf"), stream_tokens=engine.stream_tokens, **kw)  # fmt: skip


def test_the_endpoint_answers_the_openai_client_plain_streamed_and_with_errors(engine, tokenizer):
    from reroll.roles.chat_server import chat_prompt_ids

    defaults = SamplingParams(temperature=1.0, max_new_tokens=5)
    messages = [{"role": "user", "content": "pile 7"}]
    with _hf_server(engine, tokenizer, defaults) as server:
        client = _client(server.url)
        assert [m.id for m in client.models.list()] == ["tiny"]
        out = client.chat.completions.create(
            model="tiny", messages=messages, n=3, seed=5, logprobs=True, top_logprobs=3
        )
        expected = engine.generate(
            [chat_prompt_ids(tokenizer, messages)], SamplingParams(n=3, max_new_tokens=5, seed=5)
        )[0]
        assert [c.message.content for c in out.choices] == [c.text for c in expected]
        assert [c.finish_reason for c in out.choices] == [c.finish_reason for c in expected]
        assert (
            out.usage.prompt_tokens == len(chat_prompt_ids(tokenizer, messages)) == 8
        )  # <|user|> p i l e _ 7 <|assistant|>
        lps = [t.logprob for t in out.choices[0].logprobs.content]
        assert lps == pytest.approx(expected[0].logprobs, abs=1e-5)
        # the top 3 at each step are the model's 3 most likely next tokens, best first, sampled one's included
        # when it is among them; at the first step: log_softmax of the logits after the prompt
        first = out.choices[0].logprobs.content[0]
        with torch.no_grad():
            logits = engine.model(torch.tensor([chat_prompt_ids(tokenizer, messages)])).logits[0, -1]
        best = torch.log_softmax(logits.float(), -1).topk(3)
        assert [t.logprob for t in first.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-5)
        assert [t.token for t in first.top_logprobs] == [tokenizer.decode([i]) for i in best.indices.tolist()]
        single = client.chat.completions.create(model="tiny", messages=messages, seed=6).choices[0]
        streamed = client.chat.completions.create(model="tiny", messages=messages, seed=6, stream=True)
        chunks = list(streamed)
        assert single.message.content and len(chunks) >= 3  # the role, some text, the finish
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == single.message.content
        assert chunks[-1].choices[0].finish_reason == single.finish_reason
        with pytest.raises(openai.BadRequestError, match="'messages' must be a non-empty list"):
            client.chat.completions.create(model="tiny", messages=[])
        with pytest.raises(
            openai.BadRequestError, match="chat template does not write tools into the prompt"
        ):
            tool = {"type": "function", "function": {"name": "move", "parameters": {"type": "object"}}}
            client.chat.completions.create(model="tiny", messages=messages, tools=[tool])
        with pytest.raises(
            openai.BadRequestError, match="response_format needs an engine with guided decoding"
        ):
            client.chat.completions.create(
                model="tiny", messages=messages, response_format={"type": "json_object"}
            )
        with pytest.raises(openai.BadRequestError, match="temperature at least 0"):
            client.chat.completions.create(model="tiny", messages=messages, temperature=-1)


def test_stream_true_sends_each_token_as_the_engine_makes_it(engine, tokenizer):
    """Every decoding step of the engine is slowed to 0.15 s: a stream of the finished answer would
    bring all its chunks within milliseconds of each other, a token stream one about every 0.15 s."""
    slow = engine.model.register_forward_pre_hook(lambda module, args: time.sleep(0.15))
    arrivals = []
    try:
        with _hf_server(engine, tokenizer, SamplingParams(temperature=1.0, max_new_tokens=8)) as server:
            stream = _client(server.url).completions.create(
                model="tiny", prompt="pile 7", seed=3, stream=True, max_tokens=8
            )
            for chunk in stream:
                arrivals.append((time.monotonic(), chunk.choices[0].text))
    finally:
        slow.remove()
    times = [t for t, text in arrivals if text]
    assert len(times) >= 4, arrivals  # the answer has tokens to stream
    # 0.15 s of decoding between each token and the next: the span can shrink only by how late the
    # first one was delivered (a scheduling delay), never to a finished answer's few milliseconds
    span = times[-1] - times[0]
    assert span > 0.1 * (len(times) - 1), arrivals
    print(f"streamed {len(times)} tokens over {span:.2f} s")


def _agent_config(tmp_path: Path, model: Path, **agentic) -> RunConfig:
    return RunConfig.model_validate(
        {
            "pipeline": "agentic",
            "output_dir": str(tmp_path / "runs"),
            "model": {"path": str(model)},
            "agentic": {"env": "agent:tests.integration.agents:two_turns", **agentic},
            "rollout": {"batch_size": 4, "group_size": 4, "max_new_tokens": 4},
            "runtime": {"backend": "local"},
        }
    )


def test_concurrent_agents_share_engine_calls_and_limits_end_episodes_as_truncated(
    tmp_path, game_model, engine, tokenizer
):
    from reroll.roles.agent_proxy import run_agent_episodes
    from reroll.roles.chat_server import ChatServer
    from reroll.roles.env import EnvGroup

    batches: list[int] = []

    def generate(prompts, params):  # the engine, slowed so that requests queue behind a running call
        batches.append(len(prompts))
        time.sleep(0.3)
        return engine.generate(prompts, params)

    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=1)
    starts, tasks = [(s, 0) for s in range(6)], [{"pile": 9, "seed": s} for s in range(6)]
    envs = EnvGroup(_agent_config(tmp_path, game_model))
    with ChatServer(generate, tokenizer, model_name="t", defaults=params) as server:
        played = run_agent_episodes(server, envs, starts, tasks, params, max_turns=4, max_tokens=256)
        assert [(e.finish, e.traj.turns, e.error) for e in played] == [("terminated", 2, None)] * 6
        assert sum(batches) == 12 and max(batches) > 1 and len(batches) < 12  # 12 calls, fewer engine calls
        # a second call past max_turns=1, or past the token budget, is refused; the agent raises on it
        # and the episode ends as the environment runner's would: truncated by the limit, reward 0
        for limits, finish in (({"max_turns": 1, "max_tokens": 256}, "turn_limit"),
                               ({"max_turns": 4, "max_tokens": 30}, "token_budget")):  # fmt: skip
            [ep] = run_agent_episodes(server, envs, starts[:1], tasks[:1], params, **limits)
            assert (ep.finish, ep.traj.turns, ep.rewards, ep.error) == (finish, 1, [0.0], None)
    assert not server.episodes  # every episode endpoint was closed


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """A quickstart checkpoint: the quickstart config (raw prompts: ``data.chat_template: false``) cut to
    one small GRPO step without the SFT warm start (each warm-start step costs about a second here, and
    what is checked is that serve and generate agree, not what the model knows), in one process; and
    the overrides that point the quickstart config at it."""
    tmp = tmp_path_factory.mktemp("quickstart")
    overrides = [*quickstart_overrides(tmp, total_steps=1), "sft.steps=0", "rollout.batch_size=16", "optim.micro_batch_size=16", "data.eval_limit=8",
                 "runtime.backend=local"]  # fmt: skip
    result = reroll_here("train", QUICKSTART, *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp, overrides


def test_the_served_quickstart_checkpoint_answers_as_reroll_generate(quickstart_run):
    """Issue 39: ``serve`` wrapped every request in the chat template though the run trained on raw
    prompts, and answered otherwise than ``generate``. Now both routes answer each held-out prompt
    with exactly ``reroll generate``'s greedy response, and ``serve`` says at start how it reads chats."""
    from reroll.data.chat import render_chat
    from reroll.engines.hf import HFEngine
    from reroll.runtime import checkpoint as checkpoints

    tmp, overrides = quickstart_run
    run, out = tmp / "quickstart", tmp / "greedy.jsonl"
    greedy = ["rollout.temperature=0"]
    made = reroll_here(
        "generate", QUICKSTART, *overrides, *greedy, "--checkpoint", run, "--limit", "8", "--out", out
    )
    assert made.returncode == 0, made.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 8 and all(r["responses"][0] for r in records)
    assert all(len(set(r["responses"])) == 1 for r in records)  # greedy: the group's responses agree
    proc = subprocess.Popen(
        [sys.executable, "-m", "reroll.cli", "serve", str(QUICKSTART), *overrides, *greedy,
         "--checkpoint", str(run), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = (
            proc.stdout.readline()
        )  # "serving quickstart at http://127.0.0.1:PORT/v1 (...)" once it listens
        assert line.startswith("serving quickstart at http://127.0.0.1:"), line + proc.stderr.read()
        assert "chat requests: raw prompts (no chat template)" in line
        client = _client(line.split()[3])
        for r in records:
            text = client.completions.create(model="quickstart", prompt=r["prompt"], temperature=0).choices[0]
            chat = client.chat.completions.create(
                model="quickstart", messages=[{"role": "user", "content": r["prompt"]}], temperature=0
            ).choices[0]
            stream = client.completions.create(
                model="quickstart", prompt=r["prompt"], temperature=0, stream=True
            )
            streamed = "".join(c.choices[0].text for c in stream)
            assert text.text == chat.message.content == streamed == r["responses"][0], r
            assert text.finish_reason == chat.finish_reason == r["finish_reasons"][0]
    finally:
        proc.send_signal(signal.SIGTERM)  # as `kill` does; Ctrl-C (SIGINT) takes the same way out
        code = proc.wait(timeout=60)
    assert code == 0
    # what the old serve did, the chat template around the prompt, answers otherwise: the test can fail
    engine = HFEngine(str(checkpoints.model_dir(run)))
    tok = engine.tokenizer
    wrapped = [
        render_chat(tok, [{"role": "user", "content": r["prompt"]}], generation_prompt=True) for r in records
    ]
    answers = engine.generate(wrapped, SamplingParams(temperature=0, max_new_tokens=5))
    assert [g[0].text for g in answers] != [r["responses"][0] for r in records]


def test_agentic_training_through_the_agent_proxy(tmp_path, game_model):
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"pile": n}) + "\n" for n in range(5, 13)))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"pile": n}) + "\n" for n in (20, 21)))
    cfg = {
        "pipeline": "agentic",
        "name": "proxy",
        "output_dir": str(tmp_path / "runs" / "{name}"),
        "total_steps": 2,
        "model": {"path": str(game_model)},
        "agentic": {"env": "agent:tests.integration.agents:two_turns", "env_config": {"wanted": "abcdefghijklm"},
                    "tasks": str(tmp_path / "tasks.jsonl"), "eval_tasks": str(tmp_path / "eval.jsonl"),
                    "eval_episodes": 2, "max_turns": 4, "agent_timeout_s": 120},
        "rollout": {"batch_size": 8, "group_size": 4, "max_new_tokens": 4},
        "optim": {"lr": 1e-3, "micro_batch_size": 8},
        "roles": {r: {"torch_threads": 1} for r in ("actor_train", "actor_infer", "env")},
        "logging": {"tensorboard": False, "sample_every": 0},
        "eval": {"every": 2},
    }  # fmt: skip
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    start = time.monotonic()
    result = reroll_here("train", path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {r["step"]: r for r in read_metrics(tmp_path / "runs" / "proxy")}
    assert sorted(rows) == [0, 1, 2]
    for step in (1, 2):
        row = rows[step]
        assert row["rollout/turns"] == 2 and row["env/errors"] == 0  # every agent made its two calls
        assert row["env/finish_terminated"] == 1
        # each episode: 12-13 prompt tokens ("pile N"), 4 + 4 generated, the second user turn and ends
        assert 40 <= row["rollout/episode_tokens"] <= 45
        assert (
            0 < row["rollout/reward_mean"] < 1 and row["actor/grad_norm"] > 0
        )  # the agent's rewards trained
    assert rows[2]["eval/turns"] == 2 and "eval/success" in rows[2]
    print(f"agent-proxy training, 2 steps through the CLI: {time.monotonic() - start:.1f} s")


def _rewards(run_dir: Path) -> tuple[list[float], list[float]]:
    rows = [r for r in read_metrics(run_dir) if r["step"] > 0]
    return [r["rollout/reward_mean"] for r in rows], [r["env/errors"] for r in rows]


@pytest.mark.long
def test_agent_proxy_training_raises_the_agents_reward(tmp_path, game_model):
    """30 steps of 32 agent episodes (two calls each) through the CLI: the agent rewards replies made of
    the letters a-m; the policy learns them. Measured 2026-12-03 (2 cores, load average about 20, local
    backend): reward 0.38 over the first 5 steps, 0.72 over the last 5; 331 s."""
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"pile": n}) + "\n" for n in range(5, 13)))
    cfg = {
        "pipeline": "agentic",
        "name": "learn",
        "output_dir": str(tmp_path / "runs" / "{name}"),
        "total_steps": 30,
        "model": {"path": str(game_model)},
        "agentic": {"env": "agent:tests.integration.agents:two_turns", "env_config": {"wanted": "abcdefghijklm"},
                    "tasks": str(tmp_path / "tasks.jsonl"), "eval_episodes": 0, "max_turns": 4},
        "rollout": {"batch_size": 32, "group_size": 8, "max_new_tokens": 4},
        "optim": {"lr": 1e-3, "micro_batch_size": 32},
        "roles": {r: {"torch_threads": 1} for r in ("actor_train", "actor_infer", "env")},
        "logging": {"tensorboard": False, "sample_every": 0},
        "runtime": {"backend": "local"},
    }  # fmt: skip
    path = tmp_path / "learn.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = reroll_cli("train", path, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    rewards, errors = _rewards(tmp_path / "runs" / "learn")
    assert len(rewards) == 30 and max(errors) == 0  # every agent reached the endpoint
    assert sum(rewards[-5:]) / 5 >= sum(rewards[:5]) / 5 + 0.15
