"""What a run prints: one line per step, and a sample completion now and then."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

_COLUMNS = [
    ("rollout/reward_mean", "reward", "{:.3f}"),
    ("rollout/accuracy", "acc", "{:.3f}"),
    ("eval/accuracy", "eval_acc", "{:.3f}"),
    ("rollout/response_length", "len", "{:.1f}"),
    # shown only when not zero: responses cut at rollout.max_new_tokens, reward calls that failed
    ("rollout/truncated", "cut", "{:.3f}"),
    ("eval/truncated", "eval_cut", "{:.3f}"),
    ("reward/errors", "rew_err", "{:g}"),
    ("reward/timeouts", "rew_timeout", "{:g}"),
    ("eval/errors", "eval_err", "{:g}"),
    ("eval/timeouts", "eval_timeout", "{:g}"),
    ("actor/pg_loss", "pg_loss", "{:+.4f}"),
    ("critic/vf_loss", "vf_loss", "{:.4f}"),
    ("sft/loss", "sft_loss", "{:.4f}"),
    ("distill/reverse_kl", "rkl", "{:.4f}"),
    ("distill/forward_kl", "fkl", "{:.4f}"),
    ("rollout/reward_model_score", "rm", "{:+.3f}"),
    ("rm/loss", "rm_loss", "{:.4f}"),
    ("rm/accuracy", "pair_acc", "{:.3f}"),
    ("dpo/loss", "dpo_loss", "{:.4f}"),
    ("dpo/accuracy", "pair_acc", "{:.3f}"),
    ("dpo/margins", "margin", "{:+.3f}"),
]
_WHEN_NOT_ZERO = {
    "rollout/truncated",
    "eval/truncated",
    "reward/errors",
    "reward/timeouts",
    "eval/errors",
    "eval/timeouts",
}
_PHASES = [
    ("generate", "gen"),
    ("reward", "rew"),
    ("teacher", "teach"),
    ("reference", "ref"),
    ("episodes", "play"),
    ("baseline", "base"),
    ("old_logprobs", "old"),
    ("values", "val"),
    ("train", "train"),
    ("critic", "critic"),
    ("weight_sync", "sync"),
    ("offload", "off"),
    ("reload", "on"),
    ("evaluate", "eval"),
    ("checkpoint", "ckpt"),
]


def step_line(step: int, total: int, metrics: Mapping[str, float]) -> str:
    """``step 12/200 | reward 0.410 | acc 0.630 | len 4.0 | cut 0.125 | rew_err 3 | gen 1.2s ... | 3.1s``:
    the share of responses cut at the length cap and the reward calls that failed only when not zero."""
    parts = [f"step {step}/{total}"]
    parts += [
        f"{label} {fmt.format(metrics[k])}"
        for k, label, fmt in _COLUMNS
        if k in metrics and (metrics[k] or k not in _WHEN_NOT_ZERO)
    ]
    phases = [f"{label} {metrics[f'timing/{k}']:.1f}s" for k, label in _PHASES if f"timing/{k}" in metrics]
    if phases:
        parts.append(" ".join(phases))
    if "timing/step" in metrics:
        parts.append(f"{metrics['timing/step']:.1f}s")
    return " | ".join(parts)


def sample_line(prompt: str, response: str, score: float) -> str:
    """A prompt, the response and its reward, as the model saw them (decoded from the token ids)."""
    return f"  sample: {prompt!r} -> {response!r} (reward {score:g})"


def shown(path: Path) -> Path:
    """``path`` relative to the working directory when below it (as a user would type it), else as it is."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path
