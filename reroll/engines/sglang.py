"""The SGLang engine: SGLang's offline ``Engine`` behind the ``Engine`` interface.

Not run yet: SGLang has no CPU build, so this module has only been written against SGLang's documented
offline API (``Engine.generate`` with ``input_ids`` and ``return_logprob``,
``update_weights_from_tensor``, ``release_memory_occupation`` / ``resume_memory_occupation``); its
tests skip where ``sglang`` cannot be imported. ``sglang`` is imported when the engine is built.

Log-probs are SGLang's ``output_token_logprobs``, which SGLang computes after temperature scaling (as
the trainer's ``token_logprobs(..., temperature)`` does) unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from reroll.data.types import Completion, SamplingParams


class SGLangEngine:
    """``sglang.Engine`` in the worker's process; weights updated in place, KV cache flushed after."""

    def __init__(self, model_path: str, *, dtype: str = "float32", memory_saver: bool = False):
        import sglang

        self.engine = sglang.Engine(
            model_path=model_path,
            dtype=dtype,
            enable_memory_saver=memory_saver,
            skip_tokenizer_init=False,
        )
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._tokens, self._seconds = 0, 0.0

    @staticmethod
    def _sampling_params(params: SamplingParams, seed: int | None) -> dict[str, Any]:
        greedy = params.temperature == 0
        out: dict[str, Any] = {
            "temperature": params.temperature,
            "top_p": 1.0 if greedy else params.top_p,
            "top_k": -1 if greedy or params.top_k == 0 else params.top_k,
            "max_new_tokens": params.max_new_tokens,
            "stop": list(params.stop) or None,
            "no_stop_trim": True,  # keep the stop string in the text, as the token ids do
            "skip_special_tokens": True,
        }
        if seed is not None:
            out["sampling_seed"] = seed
        return out

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions per prompt; each sample is its own request (row ``i`` gets ``seed + i``)."""
        encoded = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        rows = [ids for ids in encoded for _ in range(params.n)]
        sampling = [
            self._sampling_params(params, None if params.seed is None else params.seed + i)
            for i in range(len(rows))
        ]
        start = time.perf_counter()
        outputs = self.engine.generate(input_ids=rows, sampling_params=sampling, return_logprob=True)
        self._seconds += time.perf_counter() - start
        flat = [self._completion(ids, o) for ids, o in zip(rows, outputs)]
        self._tokens += sum(len(c.response_ids) for c in flat)
        return [flat[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    @staticmethod
    def _completion(prompt_ids: list[int], out: dict[str, Any]) -> Completion:
        meta = out["meta_info"]
        pairs = meta["output_token_logprobs"]  # [(logprob, token_id, text-or-None), ...]
        ids = [int(tok) for _, tok, *_ in pairs]
        logprobs = [float(lp) for lp, *_ in pairs]
        reason = "length" if meta["finish_reason"]["type"] == "length" else "stop"
        return Completion(list(prompt_ids), ids, out["text"], logprobs, reason)

    def load_weights(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of the trainer's weights (Hugging Face names) in place."""
        self.engine.update_weights_from_tensor(named_tensors=list(bucket), flush_cache=False)

    def finish_weight_update(self) -> None:
        """Drop the cache computed with the old weights."""
        self.engine.flush_cache()

    def sleep(self) -> None:
        """Free GPU memory (weights and KV cache); needs the engine built with ``memory_saver``."""
        self.engine.release_memory_occupation()

    def wake_up(self) -> None:
        self.engine.resume_memory_occupation()

    def metrics(self) -> dict[str, float]:
        tps = self._tokens / self._seconds if self._seconds else 0.0
        self._tokens, self._seconds = 0, 0.0
        return {"engine/tokens_per_s": tps}
