"""The SGLang engine on a GPU: sampled and scored log-probs equal the hf forward pass after a weight
update, sleep(2) frees memory and wants the weights again, abort() stops a running generate.

SGLang has no CPU build, so this skips on CPU-only machines; it has not been run yet (README). The
same calls are checked against a fake ``sglang.Engine`` on CPU in ``tests/unit/test_sglang_engine_fake.py``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from reroll.data.types import Rollout, Sample, SamplingParams, build_train_batch
from reroll.engines import engine_available
from reroll.engines.base import EngineAborted

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not engine_available("sglang") or not torch.cuda.is_available(),
        reason="SGLang cannot be installed on CPU-only machines (needs CUDA and pip install 'reroll[sglang]')",
    ),
]

PROMPTS = ["12+7=", "3+45=", "20+20="]


@pytest.fixture(scope="module")
def engines(assets):
    """The hf engine and an SGLang engine over the same tiny model, both on the GPU."""
    from reroll.engines.hf import HFEngine
    from reroll.engines.sglang import SGLangEngine

    hf = HFEngine(str(assets["model"]), device="cuda")
    engine = SGLangEngine(str(assets["model"]), mem_fraction_static=0.3)
    yield hf, engine
    engine.engine.shutdown()


def _sync(hf, engine, seed: int) -> None:
    """Perturb hf's weights and load the same values into the SGLang engine."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    weights = {
        k: v + 0.01 * torch.randn(v.shape, generator=g, device=v.device, dtype=v.dtype)
        for k, v in hf.model.state_dict().items()
    }
    hf.load_weights(list(weights.items()))
    hf.finish_weight_update()
    engine.load_weights([(k, v.cpu()) for k, v in weights.items()])
    engine.finish_weight_update()


def _assert_logprobs_match(hf, engine, temperature: float) -> None:
    params = SamplingParams(n=4, temperature=temperature, max_new_tokens=4, seed=0)
    groups = engine.generate(PROMPTS, params)
    rollouts = [
        Rollout(Sample(str(i), p, {}), i, c) for i, (p, g) in enumerate(zip(PROMPTS, groups)) for c in g
    ]
    batch = build_train_batch(rollouts, hf.tokenizer.pad_token_id)
    reference = hf.score(batch.input_ids, batch.attention_mask, temperature).cpu()
    m = batch.response_mask
    torch.testing.assert_close(batch.rollout_logprobs[m], reference[m], atol=1e-3, rtol=0)


def test_sglang_logprobs_equal_hf_after_update(engines):
    hf, engine = engines
    _sync(hf, engine, seed=0)
    _assert_logprobs_match(hf, engine, temperature=0.8)


def test_sglang_score_equals_hf(engines):
    hf, engine = engines
    _sync(hf, engine, seed=1)
    rows = [hf.tokenizer.encode(p + "19", add_special_tokens=False) for p in PROMPTS]
    width = max(map(len, rows))
    input_ids = torch.tensor([r + [hf.tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    ours = engine.score(input_ids, mask)
    reference = hf.score(input_ids, mask, 1.0).cpu()
    assert (ours[:, 0] == 0).all()
    torch.testing.assert_close(ours[mask.bool()], reference[mask.bool()], atol=1e-3, rtol=0)


def test_sleep_level_2_frees_memory_and_wants_the_weights_again(engines):
    hf, engine = engines
    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep(2)
    free_asleep = torch.cuda.mem_get_info()[0]
    assert free_asleep - free_awake > 256 * 2**20, (free_awake, free_asleep)  # at least the KV cache
    engine.wake_up()
    with pytest.raises(RuntimeError, match="without weights"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    _sync(hf, engine, seed=2)
    _assert_logprobs_match(hf, engine, temperature=1.0)


def test_abort_stops_a_running_generate(engines):
    _, engine = engines
    outcome: list[object] = []

    def run() -> None:
        try:
            # the tiny model's context is 128 tokens: many rows keep SGLang busy for seconds
            outcome.append(engine.generate(PROMPTS * 1000, SamplingParams(n=8, max_new_tokens=100)))
        except EngineAborted as e:
            outcome.append(e)

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(0.5)
    start = time.monotonic()
    engine.abort()
    worker.join(30)
    assert not worker.is_alive() and time.monotonic() - start < 30
    [result] = outcome
    assert isinstance(result, EngineAborted)
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))  # the engine still works
