"""reroll serve's request handling without a model: prompts rendered as the run rendered them, tool
calls read in the Hermes and Llama 3 formats (whole and streamed), the engine's abilities asked of its
spec, the API key. The engine is a script: it answers every prompt with a fixed text, whose token ids
the tests know, so what the server makes of an answer is checked exactly."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from reroll.config.engines import engine_spec
from reroll.data.chat import ChatTemplateError, PromptFormat
from reroll.data.types import Completion, SamplingParams, TokenDelta
from reroll.models.tiny import ASCII_ALPHABET, char_tokenizer
from reroll.roles.chat_server import ChatServer
from reroll.roles.tool_calls import forced_schema, held_from, parse_answer, tool_format
from tests.chat_tools import ADD, HERMES_TEMPLATE

openai = pytest.importorskip("openai")


class Scripted:
    """An engine that answers every prompt with ``answer`` (one token per character), and records the
    prompts it was given."""

    def __init__(self, tokenizer, answer: str) -> None:
        self.tokenizer, self.answer, self.prompts = tokenizer, answer, []

    def _ids(self) -> list[int]:
        return self.tokenizer.encode(self.answer, add_special_tokens=False)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        self.prompts += prompts
        ids = self._ids()
        return [[Completion(p, ids, self.answer, [-0.5] * len(ids), "stop")] * params.n for p in prompts]

    def stream_tokens(self, prompts: list[list[int]], params: SamplingParams) -> Iterator[TokenDelta]:
        self.prompts += prompts
        ids = self._ids()
        for k, token in enumerate(ids):
            for i in range(len(prompts)):
                for j in range(params.n):
                    yield TokenDelta(i, j, [token], [-0.5], [], "stop" if k == len(ids) - 1 else None)


@pytest.fixture
def tokenizer():
    tok = char_tokenizer(ASCII_ALPHABET)
    tok.chat_template = HERMES_TEMPLATE
    return tok


def _serve(engine: Scripted, tokenizer, **kw) -> ChatServer:
    return ChatServer(
        engine.generate,
        tokenizer,
        model_name="m",
        defaults=SamplingParams(max_new_tokens=64),
        spec=kw.pop("spec", engine_spec("hf")),
        stream_tokens=engine.stream_tokens,
        **kw,
    )


def _client(server: ChatServer, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=30)


def test_a_chat_request_is_the_runs_prompt_format():
    tok = char_tokenizer(ASCII_ALPHABET)  # the tiny template: <|role|>content
    user = [{"role": "user", "content": "12+30="}]
    raw = PromptFormat(tok, chat_template=False)
    assert raw.conversation(user) == "12+30=" == raw.prompt("12+30=")  # as the run's prompts
    with pytest.raises(ChatTemplateError, match=r"one user message.*roles \['system', 'user'\]"):
        raw.conversation([{"role": "system", "content": "add"}, *user])
    with pytest.raises(ChatTemplateError, match="send no tools"):
        raw.conversation(user, tools=[ADD])
    chat = PromptFormat(tok, chat_template=True, system_prompt="add.")
    assert chat.conversation(user) == "<|system|>add.<|user|>12+30=<|assistant|>" == chat.prompt("12+30=")
    # a request's own system message replaces the run's
    own = [{"role": "system", "content": "sum."}, *user]
    assert chat.conversation(own) == "<|system|>sum.<|user|>12+30=<|assistant|>"


def test_tool_calls_are_read_in_the_hermes_and_llama3_formats():
    assert tool_format(HERMES_TEMPLATE) == "hermes" and tool_format("{{ '<|python_tag|>' }}") == "llama3"
    assert tool_format("{{ messages }}") is None
    text = 'let me add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    content, [call] = parse_answer(text, "hermes")
    assert (content, call.name, call.arguments) == ("let me add. ", "add", {"a": 1, "b": 2})
    assert parse_answer("<tool_call>{bad json</tool_call>", "hermes") == (
        "<tool_call>{bad json</tool_call>",
        [],
    )
    two = '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "arguments": {"a": 3, "b": 4}}'
    content, calls = parse_answer(two, "llama3")
    assert content == "" and [c.arguments for c in calls] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert parse_answer("the sum is 3", "llama3") == ("the sum is 3", [])
    assert parse_answer('{"a": 1}', "llama3") == ('{"a": 1}', [])  # JSON, but not a call
    # streaming holds back from where a call may begin, a tag cut between tokens included
    assert held_from("sure <tool_call>{", "hermes") == 5 and held_from("sure <tool", "hermes") == 5
    assert held_from("sure <b>", "hermes") == 8 and held_from("  {", "llama3") == 0
    assert held_from("the sum", "llama3") == 7


def test_a_forced_tool_choice_is_a_json_schema():
    required = forced_schema([ADD], "required")
    schema = json.loads(required.schema)
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["add"]
    [call] = required.calls('[{"name": "add", "parameters": {"a": 1, "b": 2}}]')
    assert (call.name, call.arguments) == ("add", {"a": 1, "b": 2})
    named = forced_schema([ADD], {"type": "function", "function": {"name": "add"}})
    assert json.loads(named.schema) == ADD["function"]["parameters"]
    assert named.calls('{"a": 5, "b": 6}')[0].arguments == {"a": 5, "b": 6}
    assert forced_schema([ADD], "auto") is None and forced_schema([ADD], "none") is None
    with pytest.raises(ValueError, match="naming one of the tools"):
        forced_schema([ADD], {"type": "function", "function": {"name": "mul"}})


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_returns_tool_calls_and_renders_them_back(tokenizer, stream):
    answer = 'adding <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    engine = Scripted(tokenizer, answer)
    messages = [{"role": "user", "content": "1+2?"}]
    with _serve(engine, tokenizer) as server:
        out = _client(server).chat.completions.create(
            model="m", messages=messages, tools=[ADD], stream=stream
        )
        if stream:
            chunks = list(out)
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
            finish = chunks[-1].choices[0].finish_reason
            # nothing of the call's text was streamed as content
            assert all("<tool" not in (c.choices[0].delta.content or "") for c in chunks)
        else:
            message = out.choices[0].message
            content, calls, finish = message.content, message.tool_calls, out.choices[0].finish_reason
    assert content == "adding " and finish == "tool_calls"  # the text before the call, streamed or not
    [call] = calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    # the tools went into the prompt through the template
    assert '<tools>{"type": "function"' in tokenizer.decode(engine.prompts[0])
    # the call and its result come back in the next request: rendered by the template, as the model wrote it
    follow = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "3"},
    ]
    engine.answer = "it is 3"
    with _serve(engine, tokenizer) as server:
        reply = _client(server).chat.completions.create(model="m", messages=follow, tools=[ADD])
    assert reply.choices[0].message.content == "it is 3" and not reply.choices[0].message.tool_calls
    prompt = tokenizer.decode(engine.prompts[-1])
    assert prompt.endswith(
        '<|assistant|><tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><eos>'
        "<|user|><tool_response>3</tool_response><|assistant|>"
    )


def test_llama3_calls_with_the_parser_named(tokenizer):
    engine = Scripted(tokenizer, '{"name": "add", "parameters": {"a": 4, "b": 5}}')
    with _serve(engine, tokenizer, tool_parser="llama3") as server:
        out = _client(server).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "4+5?"}], tools=[ADD]
        )
    [call] = out.choices[0].message.tool_calls
    assert out.choices[0].message.content is None and json.loads(call.function.arguments) == {"a": 4, "b": 5}


def test_what_the_engine_cannot_do_is_refused_naming_the_field_and_the_fix(tokenizer):
    engine = Scripted(tokenizer, "ok")
    messages = [{"role": "user", "content": "hi"}]
    with _serve(engine, tokenizer, spec=engine_spec("sglang")) as server:
        client = _client(server)
        with pytest.raises(openai.BadRequestError, match=r"response_format needs an engine with guided "
                           r"decoding \(vllm\), and this server's engine is sglang: serve with rollout.engine=vllm"):  # fmt: skip
            client.chat.completions.create(
                model="m", messages=messages, response_format={"type": "json_object"}
            )
        with pytest.raises(
            openai.BadRequestError, match=r"top_logprobs needs an engine with top log-probs \(hf, vllm\)"
        ):
            client.chat.completions.create(model="m", messages=messages, logprobs=True, top_logprobs=2)
        with pytest.raises(
            openai.BadRequestError, match=r"tool_choice 'required' needs an engine with guided"
        ):
            client.chat.completions.create(model="m", messages=messages, tools=[ADD], tool_choice="required")
        with pytest.raises(openai.BadRequestError, match="logit_bias: not supported"):
            client.chat.completions.create(model="m", messages=messages, logit_bias={"5": 1})
        with pytest.raises(openai.BadRequestError, match="echo: not supported"):
            client.completions.create(model="m", prompt="hi", echo=True)
        assert client.chat.completions.create(model="m", messages=messages).choices[0].message.content == "ok"
    assert len(engine.prompts) == 1  # the refused requests never reached the engine


def test_an_api_key_guards_every_route_but_health(tokenizer):
    engine = Scripted(tokenizer, "ok")
    with _serve(engine, tokenizer, api_key="s3cret") as server:
        with pytest.raises(openai.AuthenticationError, match="a valid API key is needed"):
            _client(server, "wrong").completions.create(model="m", prompt="hi")
        with pytest.raises(openai.AuthenticationError):
            _client(server, "wrong").models.list()
        assert _client(server, "s3cret").completions.create(model="m", prompt="hi").choices[0].text == "ok"
        import urllib.request

        assert json.load(urllib.request.urlopen(f"http://{server.host}:{server.port}/health")) == {
            "status": "ok"
        }
    assert len(engine.prompts) == 1
