"""The Hugging Face engine: ``transformers`` ``generate``, no extra dependency. The fallback engine.

``stream_tokens`` runs the same ``generate`` call in a thread, with a per-step callback (a forward
hook keeps the step's raw logits, a stopping criterion reads the token it chose) that hands each
response's new token to the caller as it is decoded; each response ends where ``generate``'s would
(``_cut``, one rule for both). Guided decoding (``SamplingParams.json_schema``) is not offered.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from reroll.config.rollout import ImagesConfig
from reroll.data.types import Completion, ImageInputs, ImagePrompt, Prompt, SamplingParams, TokenDelta
from reroll.engines.base import EngineAborted, EngineStats, engine_call, in_prompt_order
from reroll.engines.lora import lora_pairs, lora_scale, merge_lora
from reroll.errors import UserError
from reroll.models.loading import load_causal_lm, load_tokenizer
from reroll.models.vision import VisionProcessor, is_vision_language, model_inputs


class _AbortCriterion(StoppingCriteria):
    """Checked after every decoding step: raises ``EngineAborted`` once ``abort()`` set the flag; stops
    every row (``fired``) once ``interrupt()`` set its flag."""

    def __init__(self, flag: threading.Event, interrupt: threading.Event) -> None:
        self.flag, self.interrupt, self.fired = flag, interrupt, False

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        if self.flag.is_set():
            raise EngineAborted("generate was aborted (abort() called while it ran)")
        self.fired = self.interrupt.is_set()
        return torch.full((input_ids.shape[0],), self.fired, dtype=torch.bool, device=input_ids.device)


StepCallback = Callable[[torch.Tensor, torch.Tensor], None]


class _StepHook(StoppingCriteria):
    """Calls ``on_step(tokens (N,), raw logits (N, V))`` after every decoding step: the logits are the
    model's last-position output, kept by a forward hook on the model (``capture``), the tokens those
    ``generate`` just appended. Stops nothing; raises ``EngineAborted`` once ``closed`` is set."""

    def __init__(self, on_step: StepCallback, closed: threading.Event) -> None:
        self.on_step, self.closed = on_step, closed
        self.logits: torch.Tensor | None = None

    def capture(self, module: Any, args: Any, output: Any) -> None:
        self.logits = output.logits[:, -1].float()

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        if self.closed.is_set():
            raise EngineAborted("the token stream was closed")
        assert self.logits is not None
        self.on_step(input_ids[:, -1], self.logits)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _step_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, k: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One decoding step's ``(N,)`` log-probs of ``tokens`` under ``log_softmax(logits / temperature)``
    (``(N, V)`` raw logits), and the ``(N, k)`` top log-probs and their ids (None for ``k == 0``)."""
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    chosen = lp.gather(-1, tokens[:, None]).squeeze(-1)
    if not k:
        return chosen, None, None
    top = lp.topk(k, dim=-1)
    return chosen, top.values, top.indices


def _pairs(ids: torch.Tensor, values: torch.Tensor) -> list[tuple[int, float]]:
    return list(zip(ids.tolist(), values.tolist()))


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
        images: ImagesConfig | None = None,
    ):
        """``static_cache``: a fixed-shape KV cache, which lets transformers compile the decode step
        (``torch.compile``; worth it on GPUs, where it removes per-token Python overhead). ``images``:
        the image processor's limits, for a vision-language model (``ImagePrompt`` prompts)."""
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_causal_lm(model_path, dtype, device).eval()
        self.vision = (
            VisionProcessor.for_rollout(model_path, self.tokenizer, images)
            if is_vision_language(self.model)
            else None
        )
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.static_cache = static_cache
        self._tokens, self._seconds = 0, 0.0
        self._abort = threading.Event()
        self._interrupt = threading.Event()
        self._stats = EngineStats()
        self._asleep: int | None = None  # the level of the last sleep(), until wake_up()
        self._dropped: dict[str, torch.Size] = {}  # sleep(2): shapes of the parameters dropped
        self._missing_weights = False  # woke from sleep(2); the next full weight update clears it
        self._lora_base: dict[str, torch.Tensor] = {}  # the base values of weights a LoRA adapts

    @engine_call
    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions per prompt; rows are generated ``batch_size`` at a time."""
        return in_prompt_order(self.stream(prompts, params), len(prompts))

    @engine_call
    def stream(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams,
        budgets: Sequence[int] | None = None,
    ) -> Iterator[tuple[int, list[Completion]]]:
        """Each prompt's group once its rows are done. Rows are decoded ``batch_size`` at a time, in
        lockstep, so groups finish in prompt order, a micro-batch at a time. After ``interrupt()`` the
        micro-batch in flight stops at its next token and the rows not started come back empty."""
        if params.seed is not None:
            torch.manual_seed(params.seed)
        encoded = self._encode(prompts)  # once per prompt: its group's samples share it
        limits = list(budgets) if budgets is not None else [params.max_new_tokens] * len(prompts)
        rows = [(i, *encoded[i], limits[i]) for i in range(len(prompts)) for _ in range(params.n)]
        done: dict[int, list[Completion]] = {}
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start : start + self.batch_size]
            if self._interrupt.is_set():  # not started: nothing generated yet
                made = [Completion(ids, [], "", [], "abort") for _, ids, _, _ in chunk]
            else:
                began = time.perf_counter()
                made = self._generate_batch(
                    [ids for _, ids, _, _ in chunk],
                    [b for *_, b in chunk],
                    params,
                    images=[im for _, _, im, _ in chunk],
                )
                self._seconds += time.perf_counter() - began
                self._tokens += sum(len(c.response_ids) for c in made)
            for (i, *_), c in zip(chunk, made):
                done.setdefault(i, []).append(c)
            for i in sorted({i for i, *_ in chunk}):
                if len(done[i]) == params.n:
                    yield i, done.pop(i)

    def _encode(self, prompts: Sequence[Prompt]) -> list[tuple[list[int], ImageInputs | None]]:
        """Each prompt's token ids and images: text encoded without special tokens, token ids used
        exactly as given, an ``ImagePrompt`` through the model's processor (placeholders expanded)."""
        out: list[tuple[list[int], ImageInputs | None]] = []
        for p in prompts:
            if isinstance(p, ImagePrompt):
                if self.vision is None:
                    raise UserError(
                        "a prompt with images reached the hf engine, whose model reads text only: use a "
                        "vision-language model (model.path)"
                    )
                out.append(self.vision.encode(p.text, p.images))
            else:
                out.append(
                    (p if isinstance(p, list) else self.tokenizer.encode(p, add_special_tokens=False), None)
                )
        return out

    @torch.no_grad()
    def _generate_batch(
        self,
        rows: list[list[int]],
        budgets: list[int],
        params: SamplingParams,
        step_hook: _StepHook | None = None,
        images: Sequence[ImageInputs | None] = (),
    ) -> list[Completion]:
        """One micro-batch, decoded to its largest budget; each row is cut at its own. ``step_hook``
        sees every decoding step (``stream_tokens``); ``images``: each row's (a vision-language model)."""
        self._stats.observe(running=len(rows))
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=self.device)
        attention_mask = torch.tensor(
            [[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device
        )
        greedy = params.temperature == 0
        criterion = _AbortCriterion(self._abort, self._interrupt)
        criteria = [criterion] if step_hook is None else [criterion, step_hook]
        extra = {"stop_strings": list(params.stop), "tokenizer": self.tokenizer} if params.stop else {}
        if self.static_cache and step_hook is None:  # a compiled step would bypass the forward hook
            extra["cache_implementation"] = "static"
        extra |= model_inputs(self.model, input_ids, ImageInputs.join(images))  # positions: the model's own
        if self.vision is not None:  # log-probs stay the raw logits'; only sampling skips them
            extra["suppress_tokens"] = self.vision.not_generated
        hook = self.model.register_forward_hook(step_hook.capture) if step_hook is not None else None
        try:
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=not greedy,
                temperature=None if greedy else params.temperature,
                top_p=None if greedy else params.top_p,
                top_k=None if greedy or params.top_k == 0 else params.top_k,
                max_new_tokens=max(budgets),
                eos_token_id=eos,
                pad_token_id=pad,
                # (N, V) per step, kept to the end of the call
                output_logits=step_hook is None and (params.logprobs or params.top_logprobs > 0),
                return_dict_in_generate=True,
                stopping_criteria=StoppingCriteriaList(criteria),
                **extra,
            )
        finally:
            if hook is not None:
                hook.remove()
        new = out.sequences[:, width:]
        temp = 1.0 if greedy else params.temperature
        # one decoding step at a time: stacking (N, new, V) fp32 logits takes tens of GB at a real vocabulary
        steps = [
            _step_logprobs(step, new[:, t], temp, params.top_logprobs)
            for t, step in enumerate(out.logits or ())
        ]
        # (N, new), from the logits before any processing; (N, 0) where not asked for
        logprobs = (
            torch.stack([lp for lp, _, _ in steps], dim=1)
            if steps
            else new.new_zeros((len(rows), 0), dtype=torch.float)
        )
        made = []
        for i in range(len(rows)):
            c = self._completion(
                rows[i], new[i, : budgets[i]], logprobs[i], params, budgets[i], criterion.fired
            )
            if params.top_logprobs and steps:
                c.top_logprobs = [_pairs(ids[i], vals[i]) for _, vals, ids in steps[: len(c.response_ids)]]
            made.append(c)
        return made

    def _cut(
        self, ids: list[int], params: SamplingParams, budget: int, *, since: int = 1
    ) -> tuple[int, str] | None:
        """Where a response of tokens ``ids`` ends, as ``(length, "stop" | "length")``: at its first
        eos, or the shortest prefix whose text holds a stop string, whichever comes first, else at
        ``budget`` tokens; ``None`` while it goes on. One rule for ``generate`` and ``stream_tokens``
        (which asks after each token, so only the prefixes from ``since`` tokens on are new)."""
        eos = self.tokenizer.eos_token_id
        end = ids.index(eos) + 1 if eos in ids else None
        if params.stop:  # the shortest prefix whose text holds a stop string
            for k in range(since, (end or len(ids)) + 1):
                if any(s in self.tokenizer.decode(ids[:k]) for s in params.stop):
                    return k, "stop"
        if end is not None:
            return end, "stop"
        return (budget, "length") if len(ids) >= budget else None

    def _completion(
        self,
        prompt: list[int],
        new: torch.Tensor,
        logprobs: torch.Tensor,
        params: SamplingParams,
        budget: int,
        interrupted: bool,
    ) -> Completion:
        ids = new.tolist()
        # generate stopped every row: each ends at its own cut; one that did not end was interrupted
        length, reason = self._cut(ids, params, budget) or (len(ids), "abort" if interrupted else "length")
        ids = ids[:length]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Completion(prompt, ids, text, logprobs[:length].tolist(), reason)

    @engine_call
    def stream_tokens(self, prompts: Sequence[Prompt], params: SamplingParams) -> Iterator[TokenDelta]:
        """Each response's tokens as they are decoded: ``generate``'s micro-batches, seeded as it seeds
        them, each run in a thread whose per-step callback puts every live response's new token (its
        log-prob, its top log-probs) on a queue that this generator empties. A response ends at
        ``_cut``, as in ``generate``. Closing the generator stops the micro-batch in flight."""
        if params.seed is not None:
            torch.manual_seed(params.seed)
        encoded = self._encode(prompts)
        rows = [(i, j, *encoded[i]) for i in range(len(prompts)) for j in range(params.n)]
        for start in range(0, len(rows), self.batch_size):
            yield from self._stream_batch(rows[start : start + self.batch_size], params)

    def _stream_batch(
        self, chunk: list[tuple[int, int, list[int], ImageInputs | None]], params: SamplingParams
    ) -> Iterator[TokenDelta]:
        """One micro-batch of ``stream_tokens``, generated in a thread."""
        budget, temp = params.max_new_tokens, params.temperature or 1.0
        made: list[list[int]] = [[] for _ in chunk]
        live = [True] * len(chunk)
        deltas: queue.Queue = queue.Queue()
        closed = threading.Event()

        def on_step(tokens: torch.Tensor, logits: torch.Tensor) -> None:
            lps, top_vals, top_ids = _step_logprobs(logits, tokens, temp, params.top_logprobs)
            for r, (token, lp) in enumerate(zip(tokens.tolist(), lps.tolist())):
                if not live[r]:
                    continue  # finished: generate pads it
                made[r].append(token)
                cut = self._cut(made[r], params, budget, since=len(made[r]))
                live[r] = cut is None
                top = [_pairs(top_ids[r], top_vals[r])] if top_ids is not None else []
                i, j, *_ = chunk[r]
                deltas.put(TokenDelta(i, j, [token], [lp], top, cut and cut[1]))

        def run() -> None:
            try:
                began = time.perf_counter()
                done = self._generate_batch(
                    [ids for _, _, ids, _ in chunk],
                    [budget] * len(chunk),
                    params,
                    _StepHook(on_step, closed),
                    images=[im for *_, im in chunk],
                )
                self._seconds += time.perf_counter() - began
                self._tokens += sum(len(c.response_ids) for c in done)
                for (i, j, *_), c, on in zip(chunk, done, live):
                    if on:  # generate ended it without a cut of its own (an interrupt): it ends here
                        deltas.put(TokenDelta(i, j, [], [], [], c.finish_reason))
            except BaseException as e:  # handed to the consumer
                deltas.put(e)
            deltas.put(None)

        thread = threading.Thread(target=run, name="hf-stream", daemon=True)
        thread.start()
        try:
            while (item := deltas.get()) is not None:
                if isinstance(item, BaseException):
                    if closed.is_set() and isinstance(item, EngineAborted):
                        break
                    raise item
                yield item
        finally:
            closed.set()
            thread.join()

    def load_weights(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Copy one bucket of new values into the live parameters (a full update resets the LoRA base)."""
        if self._asleep is not None:
            raise RuntimeError("HFEngine.load_weights: the engine is asleep; call wake_up() first")
        live = self.model.state_dict(keep_vars=True)  # tied weights appear under every name
        with torch.no_grad():
            for name, value in bucket:
                target = live.get(name)
                if target is None:
                    raise KeyError(f"engine has no parameter {name!r} to update")
                target.copy_(value.to(target.device, target.dtype))
                self._lora_base.pop(name, None)

    def finish_weight_update(self) -> None:
        """Nothing is cached across calls; the weights count as loaded again after ``sleep(2)``."""
        self._missing_weights = False

    def update_lora(self, adapter: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
        """Merge a peft adapter into the weights it adapts: ``W = W0 + scale * B @ A``, ``W0`` the base
        values kept from the first adapter (a later full weight load makes those the base)."""
        scale, pairs = lora_scale(config), lora_pairs(adapter)
        live = self.model.state_dict(keep_vars=True)
        for name in pairs:
            if name not in live:
                raise KeyError(f"LoRA adapter targets {name!r}, which the engine's model does not have")
            if name not in self._lora_base:
                self._lora_base[name] = live[name].detach().clone()
        merged = merge_lora(self._lora_base, pairs, scale)
        with torch.no_grad():
            for name, value in merged.items():
                live[name].copy_(value)

    def sleep(self, level: int = 1) -> None:
        """Free memory while a colocated role runs. Level 1: the weights move to host memory (nothing
        moves when the engine is on CPU). Level 2: the weights are dropped; after ``wake_up`` they must
        be loaded again (``load_weights`` + ``finish_weight_update``) before ``generate``. There is no KV cache
        to drop between calls."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self._asleep is not None:
            return
        if level == 1:
            self.model.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        else:
            for name, p in self.model.named_parameters():  # each tied parameter once
                self._dropped[name] = p.shape
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._lora_base.clear()
        self._asleep = level

    def wake_up(self) -> None:
        """Take the memory back: level 1 moves the weights back, level 2 allocates them (values unset)."""
        if self._asleep == 1:
            self.model.to(self.device)
        elif self._asleep == 2:
            params = dict(self.model.named_parameters())
            for name, shape in self._dropped.items():
                p = params[name]
                p.data = torch.empty(shape, dtype=p.dtype, device=p.device)
            self._dropped.clear()
            self._missing_weights = True
        self._asleep = None

    def abort(self) -> None:
        """Stop an in-flight ``generate`` at its next decoding step; it raises ``EngineAborted``."""
        self._abort.set()

    def interrupt(self) -> None:
        """End an in-flight ``generate``/``stream`` at its next decoding step, keeping its tokens."""
        self._interrupt.set()

    @engine_call
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
        """``engine/tokens_per_s`` and ``engine/num_running`` (the largest batch) since the last call."""
        out = self._stats.take(self._tokens, self._seconds)
        self._tokens, self._seconds = 0, 0.0
        return out
