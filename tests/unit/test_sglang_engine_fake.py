"""The SGLang engine against a fake ``sglang.Engine`` that records every call (SGLang has no CPU build).

The fake follows SGLang 0.5.x's offline API: ``generate(input_ids=..., sampling_params=[...],
return_logprob=True)`` returns one dict per row with ``text`` and ``meta_info``
(``output_token_logprobs`` as ``(logprob, token_id, text)``, ``finish_reason`` as ``{"type": ...}``,
``input_token_logprobs`` with ``None`` first); control calls run on ``engine.loop`` like SGLang's.
Its outputs encode the row's seed and prompt so that order and seeding can be checked exactly.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import types

import pytest
import torch
from safetensors.torch import save_file

from reroll.data.types import SamplingParams
from reroll.engines.base import EngineAborted
from reroll.errors import UserError


class FakeTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        return [ord(c) for c in text]


class FakeTokenizerManager:
    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.aborts: list[tuple[str, bool, int]] = []  # (rid, abort_all, calling thread)

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborts.append((rid, abort_all, threading.get_ident()))


def fake_tokens(prompt: list[int], seed: int, n_new: int) -> tuple[list[int], list[float]]:
    """The fake's completion of ``prompt`` with ``seed``: ids and log-probs a test can recompute."""
    ids = [1000 * seed + 10 * len(prompt) + k for k in range(n_new)]
    return ids, [-0.5 * (k + 1) - seed / 100 for k in range(n_new)]


class FakeEngine:
    """Records ``(method, kwargs)``; ``hold``: ``generate`` waits (up to 5 s) for an abort."""

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple[str, dict]] = []
        self.tokenizer_manager = FakeTokenizerManager()
        self.loop = asyncio.new_event_loop()
        self.hold = False
        self.raise_on_abort = False  # some SGLang versions raise instead of returning aborted outputs
        self.started = threading.Event()
        self.update_result: tuple[bool, str] = (True, "Succeeded to update model weights.")

    def generate(self, **kw):
        self.calls.append(("generate", kw))
        return self.loop.run_until_complete(self._generate(**kw))

    async def _generate(self, input_ids, sampling_params, return_logprob=False, logprob_start_len=None):
        if self.hold:
            self.started.set()
            deadline = time.monotonic() + 5
            while not self.tokenizer_manager.aborts and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
        if self.tokenizer_manager.aborts and self.raise_on_abort:
            raise ValueError("Abort request")
        if isinstance(sampling_params, dict):
            sampling_params = [sampling_params] * len(input_ids)
        return [self._output(row, sp) for row, sp in zip(input_ids, sampling_params)]

    def _output(self, row: list[int], sp: dict) -> dict:
        if self.tokenizer_manager.aborts:
            return {
                "text": "",
                "meta_info": {"finish_reason": {"type": "abort"}, "output_token_logprobs": []},
            }
        if sp["max_new_tokens"] == 0:  # a scoring request
            scored = [(None, row[0], None)] + [
                (-t / 10 - row[t] / 1000, row[t], None) for t in range(1, len(row))
            ]
            return {
                "text": "",
                "meta_info": {"finish_reason": {"type": "length"}, "input_token_logprobs": scored},
            }
        seed = sp.get("sampling_seed", 0)
        stops = seed % 2 == 1  # odd seeds stop after one token (eos), even ones run to the length
        ids, logprobs = fake_tokens(row, seed, 1 if stops else sp["max_new_tokens"])
        finish = {"type": "stop", "matched": 2} if stops else {"type": "length", "length": len(ids)}
        meta = {
            "finish_reason": finish,
            "output_token_logprobs": [(lp, i, None) for lp, i in zip(logprobs, ids)],
        }
        return {"text": f"t{seed}", "meta_info": meta}

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(
            ("update_weights_from_tensor", {"named_tensors": named_tensors, "flush_cache": flush_cache})
        )
        return self.update_result

    def flush_cache(self):
        self.calls.append(("flush_cache", {}))
        return types.SimpleNamespace(success=True)

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release_memory_occupation", {"tags": tags}))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume_memory_occupation", {"tags": tags}))

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


@pytest.fixture
def make(monkeypatch):
    """Builds an ``SGLangEngine`` over the fake ``sglang`` module; returns ``(engine, fake)``."""
    module = types.ModuleType("sglang")
    module.Engine = FakeEngine
    monkeypatch.setitem(sys.modules, "sglang", module)
    from reroll.engines.sglang import SGLangEngine

    built = []

    def build(model_path: str = "/models/tiny", **kwargs):
        engine = SGLangEngine(model_path, **kwargs)
        built.append(engine.engine)
        return engine, engine.engine

    yield build
    for fake in built:
        fake.loop.close()


def test_engine_is_built_with_memory_saver_and_cpu_backup(make):
    _, fake = make(dtype="bfloat16", mem_fraction_static=0.4)
    assert fake.kwargs == {
        "model_path": "/models/tiny",
        "dtype": "bfloat16",
        "random_seed": 0,
        "enable_memory_saver": True,
        "enable_weights_cpu_backup": True,
        "enable_deterministic_inference": False,
        "mem_fraction_static": 0.4,
    }


def test_generate_gives_n_samples_per_prompt_in_order_with_a_seed_per_row(make):
    engine, fake = make(deterministic=True)
    prompts = ["ab", [7, 8, 9]]  # text (encoded by SGLang's tokenizer) or token ids as given
    params = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=4, stop=("\n",), seed=10)
    groups = engine.generate(prompts, params)

    [(name, kw)] = fake.calls
    assert name == "generate" and kw["return_logprob"] is True
    assert kw["input_ids"] == [[97, 98]] * 3 + [[7, 8, 9]] * 3  # prompt-major rows
    assert [sp["sampling_seed"] for sp in kw["sampling_params"]] == [10, 11, 12, 13, 14, 15]
    assert kw["sampling_params"][0] == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,  # SGLang's "off"
        "max_new_tokens": 4,
        "stop": ["\n"],
        "no_stop_trim": True,
        "skip_special_tokens": True,
        "sampling_seed": 10,
    }
    assert [len(g) for g in groups] == [3, 3]
    for i, (prompt_ids, group) in enumerate(zip([[97, 98], [7, 8, 9]], groups)):
        for j, c in enumerate(group):
            seed = 10 + 3 * i + j
            stops = seed % 2 == 1
            ids, logprobs = fake_tokens(prompt_ids, seed, 1 if stops else 4)
            assert (c.prompt_ids, c.response_ids, c.logprobs) == (prompt_ids, ids, logprobs)
            assert (c.text, c.finish_reason) == (f"t{seed}", "stop" if stops else "length")

    metrics = engine.metrics()
    assert metrics["engine/num_running"] == 6.0 and metrics["engine/requests"] == 6.0
    assert metrics["engine/tokens_per_s"] > 0
    assert engine.metrics()["engine/requests"] == 0.0  # counters start over


def test_greedy_and_unseeded_requests(make, caplog):
    engine, fake = make()
    engine.generate([[1, 2]], SamplingParams(n=2, temperature=0.0, top_p=0.5, top_k=5, max_new_tokens=2))
    sampling = fake.calls[-1][1]["sampling_params"]
    assert all("sampling_seed" not in sp for sp in sampling)
    assert (sampling[0]["temperature"], sampling[0]["top_p"], sampling[0]["top_k"]) == (0.0, 1.0, -1)

    with caplog.at_level(logging.WARNING, logger="reroll.engines.sglang"):  # seeds need deterministic mode
        engine.generate([[1]], SamplingParams(seed=1, max_new_tokens=1))
        engine.generate([[1]], SamplingParams(seed=2, max_new_tokens=1))
    assert [r.message.count("enable_deterministic_inference") for r in caplog.records] == [1]


def test_an_abort_by_sglang_itself_is_an_error(make):
    engine, fake = make()
    fake.tokenizer_manager.aborts.append(("x", False, 0))  # e.g. SGLang refused a too-long prompt
    with pytest.raises(RuntimeError, match="sglang aborted a request"):
        engine.generate([[1]], SamplingParams(max_new_tokens=1))


def test_weight_buckets_load_without_flush_and_the_update_flushes_once(make):
    engine, fake = make()
    b1 = [("model.embed_tokens.weight", torch.ones(4, 2))]
    b2 = [("model.layers.0.self_attn.q_proj.weight", torch.ones(2, 2)), ("model.norm.weight", torch.ones(2))]
    engine.load_weights(b1)
    engine.load_weights(b2)
    engine.finish_weight_update()
    assert fake.names() == ["update_weights_from_tensor", "update_weights_from_tensor", "flush_cache"]
    for (_, kw), bucket in zip(fake.calls, [b1, b2]):
        assert kw["flush_cache"] is False
        assert [(n, t) for n, t in kw["named_tensors"]] == bucket  # the trainer's tensors themselves

    fake.update_result = (False, "Failed to update weights: no parameter model.foo.weight")
    with pytest.raises(RuntimeError, match=r"no parameter model\.foo\.weight"):
        engine.load_weights([("model.foo.weight", torch.ones(1))])


def test_update_lora_merges_into_the_checkpoint_base_and_loads_it(make, tmp_path):
    w0 = torch.arange(12.0).reshape(3, 4)
    save_file(
        {"model.layers.0.self_attn.q_proj.weight": w0, "model.norm.weight": torch.ones(4)},
        tmp_path / "model.safetensors",
    )
    engine, fake = make(str(tmp_path))
    a, b = torch.randn(2, 4), torch.randn(3, 2)
    adapter = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b,
    }
    engine.update_lora(adapter, {"r": 2, "lora_alpha": 6})
    assert fake.names() == ["update_weights_from_tensor", "flush_cache"]
    [(name, merged)] = fake.calls[0][1]["named_tensors"]
    assert name == "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(merged, w0 + 3.0 * b @ a)  # scale = lora_alpha / r = 3

    (tmp_path / "model.safetensors").unlink()  # the base was read once: the next adapter needs no checkpoint
    engine.update_lora({k: 2 * v for k, v in adapter.items()}, {"r": 2, "lora_alpha": 6})
    [(_, merged)] = fake.calls[2][1]["named_tensors"]
    torch.testing.assert_close(merged, w0 + 3.0 * (2 * b) @ (2 * a))


def test_update_lora_reads_the_base_ahead_when_told_the_targets(make, tmp_path):
    """Built with ``lora_targets``, the engine reads the adapted weights' base from the start: the
    first update needs the checkpoint no more."""
    w0 = torch.arange(12.0).reshape(3, 4)
    save_file({"model.layers.0.self_attn.q_proj.weight": w0}, tmp_path / "model.safetensors")
    engine, fake = make(str(tmp_path), lora_targets=["q_proj"])
    engine._lora_base._ahead.result()  # the read ahead has ended
    (tmp_path / "model.safetensors").unlink()
    a, b = torch.randn(2, 4), torch.randn(3, 2)
    adapter = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b,
    }
    engine.update_lora(adapter, {"r": 2, "lora_alpha": 6})
    [(_, merged)] = fake.calls[0][1]["named_tensors"]
    torch.testing.assert_close(merged, w0 + 3.0 * b @ a)


def test_sleep_releases_every_tag_and_the_guard_refuses_work_while_asleep(make):
    engine, fake = make()
    params = SamplingParams(max_new_tokens=1)
    engine.sleep()
    engine.sleep()  # already asleep: nothing more is released
    assert fake.calls == [("release_memory_occupation", {"tags": ["weights", "kv_cache", "cuda_graph"]})]
    with pytest.raises(RuntimeError, match=r"asleep \(level 1\); call wake_up"):
        engine.generate([[1]], params)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.score(torch.tensor([[1, 2]]), torch.ones(1, 2))
    with pytest.raises(RuntimeError, match="asleep"):
        engine.load_weights([("model.norm.weight", torch.ones(1))])
    engine.wake_up()
    assert fake.calls[-1] == ("resume_memory_occupation", {"tags": ["weights", "kv_cache", "cuda_graph"]})
    engine.generate([[1]], params)  # level 1 kept the weights

    engine.sleep(2)
    engine.wake_up()
    with pytest.raises(RuntimeError, match="without weights"):
        engine.generate([[1]], params)
    engine.load_weights([("model.norm.weight", torch.ones(1))])
    engine.finish_weight_update()
    engine.generate([[1]], params)
    with pytest.raises(ValueError, match="1 or 2"):
        engine.sleep(3)


def test_sleep_needs_the_memory_saver_and_level_1_the_cpu_backup(make):
    engine, _ = make(memory_saver=False)
    with pytest.raises(UserError, match="memory_saver=False"):
        engine.sleep()
    engine, fake = make(weights_cpu_backup=False)
    assert fake.kwargs["enable_weights_cpu_backup"] is False
    with pytest.raises(UserError, match="weights_cpu_backup=False; use sleep\\(level=2\\)"):
        engine.sleep(1)
    engine.sleep(2)
    assert fake.names() == ["release_memory_occupation"]


@pytest.mark.parametrize("raise_on_abort", [False, True])
def test_abort_from_another_thread_makes_generate_raise(make, raise_on_abort):
    engine, fake = make()
    fake.hold, fake.raise_on_abort = True, raise_on_abort
    outcome: list[BaseException | object] = []

    def run() -> None:
        try:
            outcome.append(engine.generate([[1, 2], [3]], SamplingParams(n=2, max_new_tokens=3)))
        except BaseException as e:  # the test inspects it
            outcome.append(e)

    worker = threading.Thread(target=run)
    worker.start()
    assert fake.started.wait(5)
    engine.abort()
    worker.join(5)
    [error] = outcome
    assert isinstance(error, EngineAborted)
    # SGLang's abort_request ran on the engine's event loop (the generating thread), for every request
    assert fake.tokenizer_manager.aborts == [("", True, worker.ident)]


def test_abort_between_calls_cancels_nothing(make):
    engine, fake = make()
    engine.abort()  # nothing in flight
    [group] = engine.generate([[1]], SamplingParams(max_new_tokens=2))
    assert len(group[0].response_ids) == 2 and fake.tokenizer_manager.aborts == []


def test_score_reads_input_logprobs_with_column_0_zero(make):
    engine, fake = make()
    input_ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    out = engine.score(input_ids, mask)
    [(_, kw)] = fake.calls
    assert kw["input_ids"] == [[5, 6, 7, 8], [9, 10]]
    assert kw["sampling_params"]["max_new_tokens"] == 0
    assert (kw["return_logprob"], kw["logprob_start_len"]) == (True, 0)
    expected = torch.tensor([[0.0, -0.1 - 0.006, -0.2 - 0.007, -0.3 - 0.008], [0.0, -0.1 - 0.010, 0.0, 0.0]])
    assert out.shape == (2, 4)
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match=r"temperature 1\.0 only"):
        engine.score(input_ids, mask, temperature=0.8)
