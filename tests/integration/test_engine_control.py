"""The hf engine beyond generate: abort, sleep/wake, metrics, LoRA adapters; and actor_infer's bucketed
weight sync and abort through Ray, with errors that name the engine."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.data.datasets import load_samples
from reroll.data.types import Rollout, SamplingParams, build_train_batch
from reroll.engines.base import EngineAborted
from reroll.engines.hf import HFEngine
from reroll.errors import RoleError
from reroll.models.loading import load_tokenizer
from reroll.pipelines.common import sft_batch
from reroll.roles.actor_infer import EngineGroup
from reroll.roles.objectives import NextToken
from reroll.roles.trainer import TrainerGroup
from reroll.runtime.actors import start_ray
from tests.conftest import (
    assert_interrupted_responses_resume,
    assert_stream_yields_groups_then_interrupt_cuts_the_rest,
    write_config,
)

pytestmark = pytest.mark.integration

PROMPTS = ["1+2=", "13+4=", "25+25="]


def _abort_after(stop, seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, stop)
    timer.start()
    return timer


def test_hf_abort_stops_generate_from_another_thread(assets):
    engine = HFEngine(str(assets["model"]), batch_size=64)
    long = SamplingParams(n=8, max_new_tokens=100)  # 4000 rows in 63 batches: minutes on this machine
    _abort_after(engine.abort, 1.0)
    start = time.monotonic()
    with pytest.raises(EngineAborted, match="aborted"):
        engine.generate(["1+1="] * 500, long)
    assert time.monotonic() - start < 15
    # an abort between calls cancels nothing: the next call runs in full
    engine.abort()
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_new_tokens=4))
    assert [len(g) for g in out] == [2, 2, 2]


def test_hf_metrics_move_with_the_work(assets):
    engine = HFEngine(str(assets["model"]), batch_size=4)
    assert engine.metrics() == {"engine/tokens_per_s": 0.0, "engine/num_running": 0.0}
    engine.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=5, seed=0))  # 9 rows: batches 4, 4, 1
    m = engine.metrics()
    assert m["engine/num_running"] == 4.0
    assert m["engine/tokens_per_s"] > 0
    assert engine.metrics()["engine/num_running"] == 0.0  # counters start over


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_hf_sleep_drops_the_weights_and_wake_needs_them_back(tmp_path):
    from reroll.data.arithmetic import ARITHMETIC_ALPHABET
    from reroll.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "m", alphabet=ARITHMETIC_ALPHABET, hidden_size=256, num_layers=4)
    engine = HFEngine(str(path))
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    before = engine.generate(PROMPTS, greedy)
    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
    param_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    storage = lambda: sum(p.untyped_storage().nbytes() for p in engine.model.parameters())  # noqa: E731

    engine.sleep(level=1)  # on CPU: nothing to move, but generate must wait for wake_up
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, greedy)
    engine.wake_up()
    assert engine.generate(PROMPTS, greedy) == before

    rss = _rss_bytes()
    engine.sleep(level=2)
    freed = rss - _rss_bytes()
    assert storage() == 0
    assert freed > 0.8 * param_bytes, (freed, param_bytes)  # ~16 MiB of weights back to the OS
    engine.wake_up()
    assert storage() == param_bytes
    with pytest.raises(RuntimeError, match="without weights"):
        engine.generate(PROMPTS, greedy)
    engine.load_weights(list(weights.items()))
    engine.finish_weight_update()
    assert engine.generate(PROMPTS, greedy) == before


def test_hf_lora_update_equals_peft_model(assets):
    """The engine with a peft adapter merged gives the peft model's log-probs; a second adapter
    replaces the first (the merge starts from the base each time)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from reroll.models.loading import load_causal_lm

    engine = HFEngine(str(assets["model"]))
    tok = load_tokenizer(str(assets["model"]))
    ids = torch.tensor([tok.encode("12+13=25", add_special_tokens=False)])
    mask = torch.ones_like(ids)
    base_scores = engine.score(ids, mask, 1.0)
    cfg = {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "up_proj"]}
    peft_model = get_peft_model(load_causal_lm(str(assets["model"]), "float32", "cpu"), LoraConfig(**cfg))
    for seed in (0, 1):
        torch.manual_seed(seed)
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(p, std=0.2)
        adapter = get_peft_model_state_dict(peft_model)
        engine.update_lora(adapter, cfg)
        with torch.no_grad():
            logits = peft_model(input_ids=ids, attention_mask=mask).logits
        reference = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        got = engine.score(ids, mask, 1.0)
        torch.testing.assert_close(got[:, 1:], reference, atol=1e-5, rtol=0)
        assert (got - base_scores).abs().max() > 1e-2  # the adapter changed the policy


@pytest.fixture(scope="module")
def ray_groups(tmp_path_factory, assets):
    path = tmp_path_factory.mktemp("control") / "c.yaml"
    start_ray(None)
    # 0.05 MiB buckets: the tiny model (~0.2 MiB) travels in several buckets
    cfg = load_config(write_config(path, assets), RunConfig, ["rollout.weight_sync_bucket_mb=0.05"])
    made = [TrainerGroup("actor_train", cfg, trainable=True), EngineGroup(cfg)]
    yield made
    for g in made:
        g.shutdown()


def test_bucketed_sync_through_ray_equals_the_trainer(assets, ray_groups):
    actor, rollout = ray_groups
    samples = load_samples([str(assets["train"])], template="{question}=")[:8]
    tok = load_tokenizer(str(assets["model"]))
    completions = rollout.generate([s.prompt for s in samples], SamplingParams(n=2, max_new_tokens=4, seed=0))
    rollouts = [Rollout(s, i, c) for i, (s, cs) in enumerate(zip(samples, completions)) for c in cs]
    batch = build_train_batch(rollouts, tok.pad_token_id)
    mask = batch.response_mask

    buckets = list(actor.handles[0].stream_weights.options(num_returns="streaming").remote(0.05))
    assert len(buckets) >= 3

    actor.configure_optimizer(1e-2, 0)
    actor.train(sft_batch(samples, tok, "{answer}"), NextToken())
    after = actor.compute_logprobs(batch)
    assert (rollout.score(batch.input_ids, batch.attention_mask, 1.0)[mask] - after[mask]).abs().max() > 1e-3
    rollout.load_weight_buckets(actor.weight_buckets(0.05))
    synced = rollout.score(batch.input_ids, batch.attention_mask, 1.0)
    torch.testing.assert_close(synced[mask], after[mask], atol=1e-6, rtol=0)


def test_group_abort_reaches_the_driver_naming_the_engine(ray_groups):
    _, rollout = ray_groups
    _abort_after(rollout.abort, 1.0)
    start = time.monotonic()
    with pytest.raises(RoleError) as e:
        rollout.generate(["1+1="] * 500, SamplingParams(n=8, max_new_tokens=100))
    assert time.monotonic() - start < 20
    assert "actor_infer[0] (hf engine) failed during generate: EngineAborted" in str(e.value)
    out = rollout.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=3))
    assert len(out) == 3  # the engine is usable after an abort


def test_hf_stream_and_interrupt_through_ray(ray_groups):
    """hf decodes a micro-batch (256 rows) in lockstep: groups arrive in prompt order; 300 prompts x 2
    samples are 3 micro-batches, so an interrupt after the first group leaves the rest unstarted. The
    interrupt that is to cut responses mid-way goes as soon as the first micro-batch runs: 0.3 s later
    it once landed between micro-batches (CI, 2026-12-05), where only unstarted rows are cut."""
    _, rollout = ray_groups
    order = assert_stream_yields_groups_then_interrupt_cuts_the_rest(rollout, prompts=300)
    assert order == sorted(order)
    assert_interrupted_responses_resume(rollout, prompts=600, after_s=0.0)


def test_hf_token_stream_through_ray_is_generate_token_by_token(ray_groups):
    """``stream_tokens`` (reroll serve's ``stream: true``) from a Ray actor: one delta per token and
    response, and the tokens, log-probs and finish reasons joined are ``generate``'s for the same seed."""
    _, rollout = ray_groups
    params = SamplingParams(n=2, max_new_tokens=6, seed=11, top_logprobs=2)
    whole = rollout.generate(PROMPTS, params)
    got: dict[tuple[int, int], list] = {}
    for d in rollout.stream_tokens(PROMPTS, params):
        assert len(d.token_ids) == len(d.logprobs) == len(d.top_logprobs) == 1
        ids, lps, reason = got.setdefault((d.prompt, d.sample), [[], [], None])
        assert reason is None  # nothing after a response's last delta
        got[d.prompt, d.sample] = [ids + d.token_ids, lps + d.logprobs, d.finish_reason]
    for i, group in enumerate(whole):
        for j, c in enumerate(group):
            ids, lps, reason = got[i, j]
            assert (ids, reason) == (c.response_ids, c.finish_reason)
            assert lps == pytest.approx(c.logprobs, abs=1e-5)
