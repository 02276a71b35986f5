"""The hf engine's optional static KV cache (``rollout.hf_static_cache``) changes nothing but speed."""

from __future__ import annotations

import pytest

from reroll.data.types import SamplingParams
from reroll.engines.hf import HFEngine

pytestmark = pytest.mark.integration


def test_hf_static_cache_gives_the_same_greedy_tokens_and_logprobs(assets):
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=6)
    prompts = ["1+2=", "13+4=", "25+25="]
    dynamic = HFEngine(str(assets["model"])).generate(prompts, params)
    static = HFEngine(str(assets["model"]), static_cache=True).generate(prompts, params)
    for a, b in zip(dynamic, static):
        for x, y in zip(a, b):
            assert x.response_ids == y.response_ids
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


def test_hf_engine_leaves_log_probs_out_when_not_asked(assets):
    engine = HFEngine(str(assets["model"]))
    prompts = ["1+2=", "13+4="]
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=5)
    with_lp = engine.generate(prompts, params)
    without = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=5, logprobs=False))
    for [a], [b] in zip(with_lp, without):
        assert a.response_ids == b.response_ids and a.text == b.text
        assert len(a.logprobs) == len(a.response_ids) and b.logprobs == []
