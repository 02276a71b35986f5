"""The rule a run applies to step 0 after its warm start (reroll.pipelines.headroom), and the length
measure under it (reroll.data.lengths)."""

from __future__ import annotations

from reroll.data.lengths import LengthFit, length_fit
from reroll.models.tiny import char_tokenizer
from reroll.pipelines.headroom import FLOOR, HEADROOM, advice


def test_length_fit_counts_what_the_cap_cuts_and_what_fits():
    tokenizer = char_tokenizer("0123456789")
    fit = length_fit(tokenizer, ["123", "1234", "12345", "123456"], cap=5, end=1)
    # 6 tokens > 5: cut; 5 tokens: fits, but no room for the end token; 3 and 4: fit with it
    assert (fit.rows, fit.cut, fit.no_end, fit.longest) == (4, 1, 1, 6)
    assert (fit.share_cut, fit.ceiling, fit.fitting_cap) == (0.25, 0.75, 7)


def test_close_to_a_ceiling_the_length_cap_sets_says_both_fixes():
    fit = LengthFit(rows=300, cut=90, no_end=0, longest=6, end=1, cap=5)  # ceiling 0.700
    text = advice(0.687, fit, sft_steps=400, group_size=8)
    assert text.startswith(
        "step 0 held-out accuracy 0.687 after the SFT warm start (400 steps) is within 0.013"
    )
    assert (
        "of its ceiling 0.700 (30.0% of the held-out answers are longer than rollout.max_new_tokens=5" in text
    )
    assert "GRPO has at most 1 point left to gain" in text
    assert "GRPO has less than 1 point left" in advice(
        0.653, LengthFit(300, 103, 0, 6, 1, 5), sft_steps=250, group_size=8
    )
    assert "set rollout.max_new_tokens to 7 so every answer fits" in text
    assert "take fewer SFT steps (sft.steps=400; e.g. 200)" in text


def test_close_to_1_without_a_cut_says_fewer_steps_and_far_from_both_says_nothing():
    fits = LengthFit(rows=300, cut=0, no_end=0, longest=6, end=1, cap=7)
    text = advice(0.91, fits, sft_steps=250, group_size=8)
    assert "is within 0.090 of 1: GRPO has at most 9 points left" in text and "max_new_tokens" not in text
    assert advice(1.0 - HEADROOM - 0.01, fits, sft_steps=250, group_size=8) is None
    assert advice(0.377, None, sft_steps=250, group_size=8) is None
    capped = LengthFit(rows=300, cut=90, no_end=0, longest=6, end=1, cap=5)  # ceiling 0.700
    assert advice(0.50, capped, sft_steps=250, group_size=8) is None  # 0.20 below it: room enough
    text = advice(0.60, capped, sft_steps=0, group_size=8)  # 0.10 below it, no warm start to shorten
    assert "rollout.max_new_tokens to 7" in text and "sft.steps" not in text


def test_near_zero_says_most_groups_teach_nothing():
    text = advice(FLOOR / 2, None, sft_steps=20, group_size=8)
    assert "most groups of rollout.group_size=8 samples will all score 0" in text
    assert "more SFT steps (sft.steps=20)" in text
    assert "an SFT warm start (sft: {steps: N})" in advice(0.0, None, sft_steps=0, group_size=4)
