"""math_verify: equivalences the verifier accepts and rejects; think-aware extraction."""

from __future__ import annotations

import pytest

from reroll.rewards.math import final_answer_text, math_verify, think_format

pytest.importorskip("math_verify")


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("The answer is \\boxed{\\frac{1}{2}}.", "1/2"),
        ("so $x = \\boxed{0.5}$", "\\frac12"),
        ("We get $\\frac{\\sqrt{2}}{2}$", "\\sqrt{2}/2"),
        ("\\boxed{10\\text{ cm}}", "10"),  # units stripped by the verifier
        ("\\boxed{(x+1)^2}", "x^2+2x+1"),
        ("<think>maybe 7? no.</think> The answer is \\boxed{12}", "12"),
    ],
)
def test_accepts_equivalent_answers(response, answer):
    r = math_verify("", response, {"answer": answer})
    assert (r.score, r.details["correct"]) == (1.0, 1)


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("\\boxed{3}", "4"),
        ("\\boxed{0.33}", "1/3"),  # not equal at the verifier's precision
        ("<think>the answer is 12</think> so \\boxed{13}", "12"),  # only the text after </think> counts
        ("<think>it is \\boxed{12} but I ran out of", "12"),  # unfinished thinking scores 0
        ("I don't know", "5"),
    ],
)
def test_rejects_wrong_or_hidden_answers(response, answer):
    assert math_verify("", response, {"answer": answer}).score == 0.0


def test_unfinished_think_is_reported():
    r = math_verify("", "<think>\\boxed{12}", {"answer": "12"})
    assert r.details == {"correct": 0, "parsed": 0, "unfinished_think": 1}
    assert final_answer_text("a</think>b</think>c") == "c"
    assert final_answer_text("<think>x", think=False) == "<think>x"


def test_think_format():
    assert think_format("", "<think>hmm</think> 42", {}).score == 1.0
    assert think_format("", "42", {}).score == 0.0
    assert think_format("", "<think>hmm</think>   ", {}).score == 0.0
