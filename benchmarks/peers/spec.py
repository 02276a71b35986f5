"""What every row of ``benchmarks/grpo_step.py`` runs, reroll's and the peers' (each peer gets it as JSON
in a process of its own), and the reward every row shares."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class PeerSpec:
    row: str  # trl, trl-vllm, trl-vllm-nois, verl
    model: str  # the local model directory (config, weights, tokenizer)
    prompts_file: str  # a JSON list of prompt strings, ``prompts`` per step
    out: str  # where the process writes its steps: [{"step": seconds, "new_tokens": n}, ...]
    prompts: int  # prompts per step
    group: int  # samples per prompt
    prompt_len: int  # tokens per prompt (one character, one token)
    new_tokens: int  # the most new tokens per sample
    steps: int  # optimizer steps
    micro_batch: int  # training rows per micro-batch
    dtype: str = "bfloat16"
    device: str = "cuda"
    vllm_memory: float = 0.35  # the engine's share of the GPU
    beta: float = 0.04  # KL coefficient against the reference
    lr: float = 1e-6
    gradient_checkpointing: bool = False
    # LoRA adapters instead of full fine-tuning: reroll's ``strategy.lora`` section (rank, alpha,
    # target_modules), which the peers translate into their own settings; None: full fine-tuning
    lora: dict | None = None
    # full fine-tuning too big to keep resident beside the engine (7B on one GPU): the peers move their
    # engine and optimizer state off the GPU between phases as reroll's ``placement.offload: auto`` does
    # (TRL: vLLM's sleep mode; verl: its FSDP parameter and optimizer offload)
    offload: bool = False

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(dataclasses.asdict(self)))
        return path

    @classmethod
    def read(cls, path: Path) -> PeerSpec:
        return cls(**json.loads(path.read_text()))


def length_reward(text: str) -> float:
    """A model-free reward with spread within a group: the share of digits in the response (the reroll
    rows' ``bench_reward:digits`` computes the same)."""
    return sum(c.isdigit() for c in text) / max(len(text), 1)
