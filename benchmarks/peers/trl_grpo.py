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

With ``spec.lora`` every row trains adapters through ``peft`` (``GRPOTrainer(peft_config=...)``: the same
rank, alpha and target modules as reroll's ``strategy.lora``; the reference is the base model with the
adapters off, as in reroll); with ``spec.offload`` the vLLM rows put the engine to sleep while the
trainer computes (``vllm_enable_sleep_mode``), what lets a 7B full fine-tuning step beside it.

A process of its own: an in-process vLLM engine (TRL sets up ``torch.distributed`` for it) keeps its
GPU memory until the process ends, and the reroll rows that follow need that memory back.
Writes ``spec.out``: one ``{"step": seconds, "new_tokens": n, "mean_length": .., "max_length": ..}`` per
optimizer step.
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
    if spec.offload and spec.row != "trl":
        fields["vllm_enable_sleep_mode"] = True
    return fields


def peft_fields(spec: PeerSpec) -> dict | None:
    """``peft.LoraConfig``'s fields for ``spec.lora`` (reroll's ``strategy.lora`` section), None without."""
    if spec.lora is None:
        return None
    return dict(
        r=spec.lora["rank"],
        lora_alpha=spec.lora["alpha"],
        target_modules=list(spec.lora["target_modules"]),
        lora_dropout=spec.lora.get("dropout", 0.0),
        task_type="CAUSAL_LM",
    )


def run(spec: PeerSpec) -> list[dict]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    times: list[float] = []
    tokens: list[float] = []
    lengths: list[tuple[float, float]] = []  # each step's mean and longest response
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
                lengths.append((logs["completions/mean_length"], logs.get("completions/max_length", 0.0)))

    wanted = trl_config_fields(spec)
    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    config = GRPOConfig(**{k: v for k, v in wanted.items() if k in known})
    tok = AutoTokenizer.from_pretrained(spec.model)
    policy = AutoModelForCausalLM.from_pretrained(spec.model, dtype=getattr(torch, spec.dtype))
    prompts = json.loads(Path(spec.prompts_file).read_text())
    lora = peft_fields(spec)
    if lora is not None:
        from peft import LoraConfig
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=[lambda completions, **_: [length_reward(c) for c in completions]],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tok,
        callbacks=[StepClock()],
        peft_config=None if lora is None else LoraConfig(**lora),
    )
    trainer.train()
    lengths = lengths or [(0.0, 0.0)] * len(times)
    return [
        {"step": t, "new_tokens": n, "mean_length": m, "max_length": x}
        for t, n, (m, x) in zip(times, tokens or [0.0] * len(times), lengths)
    ]


if __name__ == "__main__":
    spec = PeerSpec.read(Path(sys.argv[1]))
    Path(spec.out).write_text(json.dumps(run(spec)))
