"""The SGLang engine: SGLang's offline ``sglang.Engine`` in the worker's process, weights updated in place.

Not run on a GPU yet. SGLang has no CPU build, so this module is written against the offline API of
SGLang 0.5.x (``python/sglang/srt/entrypoints/engine.py``) and tested on CPU with a fake ``Engine``
that records calls (``tests/unit/test_sglang_engine_fake.py``); ``tests/gpu/test_sglang_engine.py``
checks it against the hf engine on a GPU with SGLang installed. ``sglang`` is imported when an engine
is built, never at module import.

Generation. Each of the ``n`` samples of a prompt is its own request (``input_ids`` rows, prompt-major),
so each carries its own seed: row ``r`` of a call gets ``sampling_seed = seed + r``, the same seeds the
vllm engine gives. (SGLang's ``n`` copies one sampling-params dict, seed included, into every sample;
the radix cache shares the prompt's KV between the rows anyway.) SGLang honours ``sampling_seed`` only
when the engine runs with ``enable_deterministic_inference`` (``deterministic=True`` here); without it
a seeded call is not reproducible and the engine says so once in the log.

Log-probs are SGLang's ``output_token_logprobs``: ``log_softmax(logits / temperature)`` of the sampled
token, before top-k/top-p truncation, which is what the trainer's ``token_logprobs(..., temperature)``
computes (unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set, which makes them temperature-1). Greedy
requests (temperature 0) become temperature 1 with top-k 1 inside SGLang, so they get temperature-1
log-probs, as with the other engines. ``score`` reads ``input_token_logprobs`` of a prefill-only request;
SGLang computes those without the sampling temperature, so ``score`` takes temperature 1.0 only.

Weights. ``load_weights`` hands a bucket to ``update_weights_from_tensor`` (SGLang's model
``load_weights`` maps Hugging Face names onto its fused layers, one tensor at a time, so a bucket need
not hold whole layers) without flushing; ``finish_weight_update`` flushes the radix cache once. LoRA
adapters are merged into their base weights (read once from the checkpoint, ``reroll.engines.lora``)
and loaded the same way: see ``update_lora`` for why not SGLang's own LoRA serving.

Sleep. ``release_memory_occupation`` / ``resume_memory_occupation`` with the tags ``weights``,
``kv_cache`` and ``cuda_graph`` (needs ``enable_memory_saver``, i.e. the ``torch_memory_saver``
package). Level 1 keeps the weights in host memory (``enable_weights_cpu_backup``, on by default);
level 2 lets them go: after ``wake_up`` they must be loaded before ``generate``. SGLang's CPU backup is
chosen when the engine starts, so an engine built with it also copies its weights out at level 2.

Abort. ``sglang.Engine`` has no abort method: ``abort()`` schedules
``tokenizer_manager.abort_request(abort_all=True)`` on the engine's event loop (thread-safe, from any
thread), which ends every running and queued request; the ``generate`` that was running raises
``EngineAborted``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from reroll.data.types import Completion, SamplingParams
from reroll.engines.base import EngineAborted, EngineStats, engine_call
from reroll.engines.lora import (
    BaseWeights,
    adapted_names,
    checkpoint_names,
    lora_pairs,
    lora_scale,
    merge_lora,
)
from reroll.errors import UserError

logger = logging.getLogger(__name__)

# what sleep() releases and wake_up() resumes (sglang.srt.constants.GPU_MEMORY_TYPE_*)
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class SGLangEngine:
    """``sglang.Engine`` behind the ``Engine`` interface: n samples per prompt with exact ids and log-probs."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        memory_saver: bool = True,
        weights_cpu_backup: bool = True,
        mem_fraction_static: float | None = None,
        deterministic: bool = False,
        seed: int = 0,
        lora_targets: Sequence[str] = (),
        **engine_args: Any,
    ):
        """``memory_saver``: ``sleep``/``wake_up`` work (needs ``torch_memory_saver``);
        ``weights_cpu_backup``: ``sleep(1)`` keeps the weights in host memory; ``mem_fraction_static``:
        the share of GPU memory for weights and KV cache (None: SGLang's choice; lower it when roles
        share the GPU); ``deterministic``: SGLang's batch-invariant kernels, which also make per-request
        seeds work; ``lora_targets``: the modules a LoRA run's adapters will reach this engine for, whose
        base weights are read from the checkpoint from the start, in the background; ``engine_args``: any
        other ``sglang.Engine`` (``ServerArgs``) keyword."""
        import sglang

        if mem_fraction_static is not None:
            engine_args["mem_fraction_static"] = mem_fraction_static
        self.engine = sglang.Engine(
            model_path=model_path,
            dtype=dtype,
            random_seed=seed,
            enable_memory_saver=memory_saver,
            enable_weights_cpu_backup=memory_saver and weights_cpu_backup,
            enable_deterministic_inference=deterministic,
            **engine_args,
        )
        # SGLang's own tokenizer: the one it decodes and matches stop strings with
        self.tokenizer = self.engine.tokenizer_manager.tokenizer
        self.model_path = model_path
        self.memory_saver = memory_saver
        self.weights_cpu_backup = memory_saver and weights_cpu_backup
        self.deterministic = deterministic
        self._tokens, self._seconds, self._requests = 0, 0.0, 0
        self._stats = EngineStats()
        self._asleep: int | None = None
        self._missing_weights = False
        self._abort = threading.Event()
        self._in_flight = False  # an engine.generate call is running (read on the engine's loop)
        self._warned_seed = False
        self._lora_base = BaseWeights(model_path)
        if lora_targets:
            self._lora_base.prefetch(lambda: adapted_names(checkpoint_names(model_path), lora_targets))

    def _sampling_params(self, params: SamplingParams, seed: int | None) -> dict[str, Any]:
        greedy = params.temperature == 0
        out: dict[str, Any] = {
            "temperature": params.temperature,  # 0: SGLang samples greedily (top-k 1)
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

    @engine_call
    def generate(
        self, prompts: Sequence[str] | Sequence[list[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        """``params.n`` completions per prompt, in prompt order. A seed makes row ``r`` (prompt
        ``r // n``, sample ``r % n``) use seed ``seed + r``; SGLang honours it with ``deterministic``."""
        if params.seed is not None and not self.deterministic and not self._warned_seed:
            logger.warning(
                "sglang engine: SGLang ignores per-request seeds unless it runs with "
                "enable_deterministic_inference (SGLangEngine(deterministic=True)); sampling is not reproducible"
            )
            self._warned_seed = True
        # a prompt is text (encoded without special tokens) or token ids, used exactly as given
        encoded = [
            p if isinstance(p, list) else self.tokenizer.encode(p, add_special_tokens=False) for p in prompts
        ]
        rows = [ids for ids in encoded for _ in range(params.n)]
        if not rows:
            return [[] for _ in prompts]
        sampling = [
            self._sampling_params(params, None if params.seed is None else params.seed + r)
            for r in range(len(rows))
        ]
        self._stats.observe(running=len(rows))
        start = time.perf_counter()
        outputs = self._run(
            lambda: self.engine.generate(input_ids=rows, sampling_params=sampling, return_logprob=True)
        )
        self._seconds += time.perf_counter() - start
        flat = [self._completion(ids, o) for ids, o in zip(rows, outputs)]
        self._tokens += sum(len(c.response_ids) for c in flat)
        self._requests += len(rows)
        n = params.n
        return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _run(self, call: Any) -> list[dict[str, Any]]:
        """``call()`` (an ``engine.generate``) as the one in flight: ``EngineAborted`` if ``abort()``
        was called meanwhile, whether SGLang then returned aborted outputs or raised."""
        self._in_flight = True
        try:
            outputs = call()
        except Exception as e:
            if self._abort.is_set():
                raise EngineAborted("generate was aborted (abort() called while it ran)") from e
            raise
        finally:
            self._in_flight = False
        if self._abort.is_set():
            raise EngineAborted("generate was aborted (abort() called while it ran)")
        return outputs

    @staticmethod
    def _completion(prompt_ids: list[int], out: dict[str, Any]) -> Completion:
        meta = out["meta_info"]
        finish = meta["finish_reason"] or {}
        if finish.get("type") == "abort":  # SGLang refused or dropped the request (not our abort())
            raise RuntimeError(f"sglang aborted a request: {finish.get('message', finish)}")
        pairs = meta["output_token_logprobs"]  # [(logprob, token_id, text or None), ...]
        ids = [int(tok) for _, tok, *_ in pairs]
        logprobs = [float(lp) for lp, *_ in pairs]
        reason = "length" if finish.get("type") == "length" else "stop"
        return Completion(list(prompt_ids), ids, out["text"], logprobs, reason)

    @engine_call
    def score(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
    ) -> torch.Tensor:
        """``(B, T)`` log-probs of given right-padded sequences (column 0 is 0), from SGLang's
        ``input_token_logprobs`` of a prefill-only request. SGLang computes those without the sampling
        temperature, so only temperature 1."""
        if temperature != 1.0:
            raise ValueError(f"the sglang engine scores at temperature 1.0 only, got {temperature}")
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]
        outputs = self._run(
            lambda: self.engine.generate(
                input_ids=rows,
                sampling_params={"max_new_tokens": 0, "temperature": 1.0},
                return_logprob=True,
                logprob_start_len=0,
            )
        )
        out = torch.zeros(input_ids.shape, dtype=torch.float32)
        for b, (row, res) in enumerate(zip(rows, outputs)):
            scored = res["meta_info"]["input_token_logprobs"]  # [(logprob or None, token_id, text), ...]
            if len(scored) != len(row):
                raise RuntimeError(f"sglang scored {len(scored)} of row {b}'s {len(row)} tokens")
            for t in range(1, len(row)):
                out[b, t] = float(scored[t][0])
        return out

    def load_weights(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of the trainer's weights (Hugging Face names) in place; the cache is
        flushed once, by ``finish_weight_update``."""
        if self._asleep is not None:
            raise RuntimeError("SGLangEngine.load_weights: the engine is asleep; call wake_up() first")
        result = self.engine.update_weights_from_tensor(named_tensors=list(bucket), flush_cache=False)
        _check(result, f"update_weights_from_tensor ({len(bucket)} tensors)")

    def finish_weight_update(self) -> None:
        """Flush the radix cache (KV computed with the old weights); the weights count as loaded again."""
        _check(self.engine.flush_cache(), "flush_cache")
        self._missing_weights = False

    def update_lora(self, adapter: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
        """Merge a peft adapter into its base weights (the checkpoint's, ``BaseWeights``) and load those.

        SGLang's own LoRA serving (``load_lora_adapter_from_tensors``) needs the engine started with
        ``enable_lora`` and the largest rank and target modules known in advance, every request to carry
        ``lora_path``, and decodes through its LoRA kernels, slower than the base model. Merging keeps
        ``generate`` as it is (as in the vllm engine) at the cost of host memory for the adapted
        weights' base values; a LoRA run freezes the base, so the checkpoint's values are the base."""
        scale, pairs = lora_scale(config), lora_pairs(adapter)
        merged = merge_lora(self._lora_base.take(list(pairs)), pairs, scale)
        self.load_weights(list(merged.items()))
        self.finish_weight_update()

    def sleep(self, level: int = 1) -> None:
        """Free the engine's GPU memory (weights, KV cache, CUDA graphs). Level 1: the weights wait in
        host memory; level 2: they are dropped (load them after ``wake_up``)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if not self.memory_saver:
            raise UserError("the sglang engine was built with memory_saver=False; it cannot sleep")
        if level == 1 and not self.weights_cpu_backup:
            raise UserError(
                "sleep(level=1) keeps the weights, but the sglang engine was built with "
                "weights_cpu_backup=False; use sleep(level=2) and load the weights after wake_up()"
            )
        if self._asleep is None:
            _check(self.engine.release_memory_occupation(tags=list(MEMORY_TAGS)), "release_memory_occupation")
            self._asleep = level

    def wake_up(self) -> None:
        """Take the memory back after ``sleep``; after level 2 the weights must be loaded again."""
        if self._asleep is not None:
            _check(self.engine.resume_memory_occupation(tags=list(MEMORY_TAGS)), "resume_memory_occupation")
            self._missing_weights = self._asleep == 2
            self._asleep = None

    def abort(self) -> None:
        """Stop an in-flight ``generate`` (from another thread); it raises ``EngineAborted``."""
        self._abort.set()
        self.engine.loop.call_soon_threadsafe(self._abort_in_flight)

    def _abort_in_flight(self) -> None:
        # runs on the engine's event loop, i.e. inside the generating thread's run_until_complete; an
        # abort() between calls is a no-op here (the next call's engine_call cleared the flag)
        if self._abort.is_set() and self._in_flight:
            self.engine.tokenizer_manager.abort_request(abort_all=True)

    def metrics(self) -> dict[str, float]:
        """Tokens/s, requests and the largest batch of rows since the last call."""
        out = self._stats.take(self._tokens, self._seconds) | {"engine/requests": float(self._requests)}
        self._tokens, self._seconds, self._requests = 0, 0.0, 0
        return out


def _check(result: Any, what: str) -> None:
    """Raise if an ``sglang.Engine`` control call reports failure: ``(success, message)`` tuples
    (weight updates) or outputs with ``success``/``message`` (cache flush, memory, LoRA)."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool):
        ok, message = result
    elif isinstance(result, Mapping):
        ok, message = bool(result.get("success", True)), result.get("message", "")
    else:
        ok, message = bool(getattr(result, "success", True)), getattr(result, "message", "")
    if not ok:
        raise RuntimeError(f"sglang {what} failed: {message or 'no message'}")
