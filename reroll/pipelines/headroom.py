"""What step 0 says about the room GRPO has: the rule the run applies after its warm start.

GRPO learns from the differences within a group of samples; a prompt whose samples all score the same
teaches it nothing. So step 0's held-out accuracy (after the SFT warm start) should stand well away
from 0 and from its ceiling: 1, or less where answers are cut by ``rollout.max_new_tokens`` (the share
of held-out answers that fit, ``reroll.data.lengths``). ``advice`` gives the warning the run logs:

- within ``HEADROOM`` of the ceiling: at most that many points are left to gain; raise the length cap
  where answers are cut, and take fewer SFT steps;
- under ``FLOOR``: most groups score all 0; more SFT steps, or a reward with partial credit.
"""

from __future__ import annotations

from reroll.data.lengths import LengthFit

HEADROOM = 0.15  # step 0 closer than this to its ceiling leaves GRPO too little to learn
FLOOR = 0.05  # step 0 under this: most groups of samples score all 0


def advice(accuracy: float, fit: LengthFit | None, *, sft_steps: int, group_size: int) -> str | None:
    """A warning for step 0's held-out ``accuracy`` (``fit``: the held-out answers against the length
    cap; ``sft_steps``: the warm start's steps, 0 without one), or None when it leaves room."""
    ceiling = fit.ceiling if fit is not None else 1.0
    after = f" after the SFT warm start ({sft_steps} steps)" if sft_steps else ""
    room = ceiling - accuracy
    measure = "measure step 0 again with total_steps=0 (it stops after the step-0 evaluation)"
    if room < HEADROOM:
        cut = fit is not None and fit.cut > 0
        what = (
            f"its ceiling {ceiling:.3f} ({fit.share_cut:.1%} of the held-out answers are longer than "
            f"rollout.max_new_tokens={fit.cap}, so they can never be right)"
            if cut and fit is not None
            else "1"
        )
        points = round(room * 100)
        gain = f"at most {points} point{'s' * (points != 1)}" if points >= 1 else "less than 1 point"
        fixes = (
            [f"set rollout.max_new_tokens to {fit.fitting_cap} so every answer fits"] if cut and fit else []
        )
        if sft_steps:
            fixes.append(
                f"take fewer SFT steps (sft.steps={sft_steps}; e.g. {max(1, sft_steps // 2)}) and {measure}"
            )
        if not fixes:
            fixes.append("use harder prompts, or a model that starts lower")
        return (
            f"step 0 held-out accuracy {accuracy:.3f}{after} is within {max(room, 0.0):.3f} of {what}: GRPO "
            f"has {gain} left to gain. Fix: {'; and '.join(fixes)}"
        )
    if accuracy < FLOOR:
        more = (
            f"more SFT steps (sft.steps={sft_steps})" if sft_steps else "an SFT warm start (sft: {steps: N})"
        )
        return (
            f"step 0 held-out accuracy {accuracy:.3f}{after}: most groups of rollout.group_size={group_size} "
            f"samples will all score 0, and such a group teaches GRPO nothing. Fix: {more}, or a reward "
            f"with partial credit; {measure}"
        )
    return None
