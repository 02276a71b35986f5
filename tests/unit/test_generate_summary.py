"""``reroll generate``'s numbers: the unbiased pass@k estimator and the per-domain summary."""

from __future__ import annotations

import itertools

import pytest

from reroll.pipelines.generate import pass_at_k, pass_ks, summarize


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),  # 1 - C(3,1)/C(4,1) = 1 - 3/4
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (4, 3, 2, 1.0),  # n - c < k: any 2 of 4 hold a correct one
        (4, 0, 4, 0.0),
        (4, 4, 1, 1.0),
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample():
    for n in range(1, 7):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                share = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(share)
            assert pass_at_k(n, c, 1) == pytest.approx(c / n)  # pass@1 is the accuracy


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


def test_reported_ks():
    assert pass_ks(1) == [1]
    assert pass_ks(4) == [1, 2, 4]
    assert pass_ks(6) == [1, 2, 4, 6]
    assert pass_ks(16) == [1, 2, 4, 8, 16]


def test_summary_per_domain_and_over_all():
    def rec(domain, correct, scores):
        return {"domain": domain, "correct": correct, "scores": scores}

    records = [
        rec("math", [True, False], [1.0, 0.0]),  # c=1 of n=2: pass@1 0.5, pass@2 1
        rec("math", [False, False], [0.0, 0.2]),  # c=0: 0, 0
        rec("code", [True, True], [1.0, 0.5]),  # c=2: 1, 1
    ]
    out = summarize(records, 2)
    assert list(out) == ["all", "math", "code"]
    assert out["math"].prompts == 2 and out["math"].reward_mean == pytest.approx(1.2 / 4)
    assert out["math"].accuracy == pytest.approx(1 / 4)
    assert out["math"].pass_at == pytest.approx({1: 0.25, 2: 0.5})
    assert out["code"].pass_at == pytest.approx({1: 1.0, 2: 1.0})
    assert out["all"].accuracy == pytest.approx(3 / 6)
    assert out["all"].reward_mean == pytest.approx(2.7 / 6)
    assert out["all"].pass_at == pytest.approx({1: 1.5 / 3, 2: 2 / 3})
    assert list(summarize(records[:2], 2)) == ["all"]  # one domain: no per-domain rows
