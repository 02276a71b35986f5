"""The SGLang engine: sampled log-probs equal the hf forward pass, before and after a weight update.

SGLang has no CPU build, so this skips on CPU-only machines; it has not been run yet (README).
"""

from __future__ import annotations

import pytest
import torch

from reroll.data.types import Rollout, Sample, SamplingParams, build_train_batch
from reroll.engines import engine_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not engine_available("sglang") or not torch.cuda.is_available(),
        reason="SGLang cannot be installed on CPU-only machines (needs CUDA and pip install 'reroll[sglang]')",
    ),
]


def test_sglang_logprobs_equal_hf_after_update(assets):
    from reroll.engines.hf import HFEngine
    from reroll.engines.sglang import SGLangEngine

    hf = HFEngine(str(assets["model"]), device="cuda")
    engine = SGLangEngine(str(assets["model"]))
    weights = {k: v + 0.01 * torch.randn_like(v) for k, v in hf.model.state_dict().items()}
    hf.load_weights(list(weights.items()))
    hf.finish_weight_update()
    engine.load_weights([(k, v.cpu()) for k, v in weights.items()])
    engine.finish_weight_update()

    prompts = ["12+7=", "3+45=", "20+20="]
    groups = engine.generate(prompts, SamplingParams(n=4, temperature=0.8, max_new_tokens=4, seed=0))
    rollouts = [
        Rollout(Sample(str(i), p, {}), i, c) for i, (p, g) in enumerate(zip(prompts, groups)) for c in g
    ]
    batch = build_train_batch(rollouts, hf.tokenizer.pad_token_id)
    reference = hf.score(batch.input_ids, batch.attention_mask, 0.8).cpu()
    m = batch.response_mask
    torch.testing.assert_close(batch.rollout_logprobs[m], reference[m], atol=1e-3, rtol=0)
