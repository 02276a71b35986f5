"""TRL's GRPO steps for ``benchmarks/grpo_step.py``'s peer rows, in a process of their own.

    python benchmarks/peers/trl_grpo.py SPEC.json     # SPEC: benchmarks/peers/spec.py's PeerSpec

The rows (``spec.row``):

- ``trl``: ``GRPOTrainer`` with its ``transformers`` generation (``use_vllm=False``).
- ``trl-vllm``: its documented fast setup, vLLM colocated in the trainer's process (``use_vllm=True,
  vllm_mode="colocate"``), the engine's share of the GPU ``spec.vllm_memory`` (the reroll rows'
  ``--vllm-memory``), TRL's defaults otherwise: among them ``vllm_importance_sampling_correction``, which
  adds a forward pass for the old log-probs each step.
- ``trl-vllm-nois``: the same without that correction (``vllm_importance_sampling_correction=False``):
  no old-log-prob pass, the work reroll's on-policy step does.

A process of its own: an in-process vLLM engine (TRL sets up ``torch.distributed`` for it) keeps its
GPU memory until the process ends, and the reroll rows that follow need that memory back.
Writes ``spec.out``: one ``{"step": seconds, "new_tokens": n}`` per optimizer step.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.peers.spec import PeerSpec, length_reward

ROWS = ("trl", "trl-vllm", "trl-vllm-nois")


def trl_config_fields(spec: PeerSpec) -> dict:
    """The ``GRPOConfig`` fields of ``spec``'s row: the same batch, lengths, KL and micro-batch as the
    reroll rows; one generation per optimizer step (TRL's default ``steps_per_generation`` equals the
    accumulation steps)."""
    if spec.row not in ROWS:
        raise ValueError(f"unknown TRL row {spec.row!r}; the rows are {', '.join(ROWS)}")
    n = spec.prompts * spec.group
    micro = min(spec.micro_batch, n)
    if n % micro:
        raise ValueError(f"the batch ({n} rows) must be divisible by the micro-batch ({micro}) for TRL")
    fields = dict(
        output_dir=str(Path(spec.out).parent / f"{spec.row}-out"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=n // micro,
        num_generations=spec.group,
        max_completion_length=spec.new_tokens,
        max_prompt_length=spec.prompt_len + 8,  # gone from TRL 1.16's GRPOConfig: dropped below there
        temperature=1.0,
        beta=spec.beta,
        learning_rate=spec.lr,
        max_steps=spec.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=spec.dtype == "bfloat16",
        use_cpu=spec.device == "cpu",
        gradient_checkpointing=spec.gradient_checkpointing,
        use_vllm=spec.row != "trl",
        seed=0,
        dataloader_num_workers=0,
    )
    if spec.row != "trl":
        fields |= dict(
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=spec.vllm_memory,
            vllm_max_model_length=spec.prompt_len + spec.new_tokens + 8,
        )
    if spec.row == "trl-vllm-nois":
        fields["vllm_importance_sampling_correction"] = False
    return fields


def run(spec: PeerSpec) -> list[dict]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    times: list[float] = []
    tokens: list[float] = []
    cuda = spec.device == "cuda"

    class StepClock(TrainerCallback):
        """An optimizer step's wall time: TRL generates inside the step's first micro-batch."""

        def on_step_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                tokens.append(logs["completions/mean_length"] * spec.prompts * spec.group)

    wanted = trl_config_fields(spec)
    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    config = GRPOConfig(**{k: v for k, v in wanted.items() if k in known})
    tok = AutoTokenizer.from_pretrained(spec.model)
    policy = AutoModelForCausalLM.from_pretrained(spec.model, dtype=getattr(torch, spec.dtype))
    prompts = json.loads(Path(spec.prompts_file).read_text())
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=[lambda completions, **_: [length_reward(c) for c in completions]],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tok,
        callbacks=[StepClock()],
    )
    trainer.train()
    return [{"step": t, "new_tokens": n} for t, n in zip(times, tokens or [0.0] * len(times))]


if __name__ == "__main__":
    spec = PeerSpec.read(Path(sys.argv[1]))
    Path(spec.out).write_text(json.dumps(run(spec)))
