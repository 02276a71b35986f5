"""The Hugging Face engine: ``transformers`` ``generate``, no extra dependency. The fallback engine."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from reroll.data.types import Completion, SamplingParams
from reroll.models.loading import load_causal_lm, load_tokenizer


class HFEngine:
    """Batched sampling with ``model.generate``; log-probs of the sampled tokens at the sampling temperature."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        batch_size: int = 256,
        static_cache: bool = False,
    ):
        """``static_cache``: a fixed-shape KV cache, which lets transformers compile the decode step
        (``torch.compile``; worth it on GPUs, where it removes per-token Python overhead)."""
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_causal_lm(model_path, dtype, device).eval()
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.static_cache = static_cache
        self._tokens, self._seconds = 0, 0.0

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions per prompt; rows are generated ``batch_size`` at a time."""
        if params.seed is not None:
            torch.manual_seed(params.seed)
        encoded = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        flat = [ids for ids in encoded for _ in range(params.n)]
        out: list[Completion] = []
        start = time.perf_counter()
        for i in range(0, len(flat), self.batch_size):
            out.extend(self._generate_batch(flat[i : i + self.batch_size], params))
        self._seconds += time.perf_counter() - start
        self._tokens += sum(len(c.response_ids) for c in out)
        return [out[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    @torch.no_grad()
    def _generate_batch(self, rows: list[list[int]], params: SamplingParams) -> list[Completion]:
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=self.device)
        attention_mask = torch.tensor(
            [[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device
        )
        greedy = params.temperature == 0
        extra = {"stop_strings": list(params.stop), "tokenizer": self.tokenizer} if params.stop else {}
        if self.static_cache:
            extra["cache_implementation"] = "static"
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=None if greedy or params.top_k == 0 else params.top_k,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            output_logits=True,
            return_dict_in_generate=True,
            **extra,
        )
        new = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).float()  # (N, new, V), before any processing
        temp = 1.0 if greedy else params.temperature
        logprobs = torch.log_softmax(logits / temp, dim=-1).gather(-1, new[..., None]).squeeze(-1)
        return [self._completion(rows[i], new[i], logprobs[i], params) for i in range(len(rows))]

    def _completion(
        self, prompt: list[int], new: torch.Tensor, logprobs: torch.Tensor, params: SamplingParams
    ) -> Completion:
        eos = self.tokenizer.eos_token_id
        ids = new.tolist()
        length, reason = len(ids), "length"
        if eos in ids:
            length, reason = ids.index(eos) + 1, "stop"
        elif params.stop:  # the shortest prefix whose text holds a stop string (the rest is padding)
            for k in range(1, len(ids) + 1):
                if any(s in self.tokenizer.decode(ids[:k]) for s in params.stop):
                    length, reason = k, "stop"
                    break
        ids = ids[:length]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Completion(prompt, ids, text, logprobs[:length].tolist(), reason)

    def update_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy new values into the live parameters (names as in the Hugging Face state dict)."""
        live = self.model.state_dict(keep_vars=True)  # tied weights appear under every name
        with torch.no_grad():
            for name, value in weights.items():
                target = live.get(name)
                if target is None:
                    raise KeyError(f"engine has no parameter {name!r} to update")
                target.copy_(value.to(target.device, target.dtype))

    @torch.no_grad()
    def score(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
    ) -> torch.Tensor:
        """``(B, T)`` token log-probs of given right-padded sequences under the engine's weights."""
        from reroll.models.loading import sequence_logprobs

        return sequence_logprobs(
            self.model, input_ids.to(self.device), attention_mask.to(self.device), temperature
        )

    def metrics(self) -> dict[str, float]:
        tps = self._tokens / self._seconds if self._seconds else 0.0
        self._tokens, self._seconds = 0, 0.0
        return {"engine/tokens_per_s": tps}
