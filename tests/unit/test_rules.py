import pytest

from reroll.rewards.rules import exact_match, numeric_match, parse_last_number


@pytest.mark.parametrize(
    ("response", "answer", "score"),
    [
        ("46", "46", 1.0),
        (" 46\n", 46, 1.0),
        ("46 ", " 46", 1.0),
        ("47", "46", 0.0),
        ("046", "46", 0.0),
        ("", "46", 0.0),
    ],
)
def test_exact_match(response, answer, score):
    result = exact_match("12+34=", response, {"answer": answer})
    assert result.score == score
    assert result.details == {"correct": int(score)}


@pytest.mark.parametrize(
    ("response", "answer", "score", "parsed"),
    [
        ("The answer is 46.", "46", 1.0, 1),
        ("46.0", "46", 1.0, 1),
        ("-3", "-3", 1.0, 1),
        ("1,046", "1046", 1.0, 1),
        ("first 46, then 47", "46", 0.0, 1),  # the last number counts
        ("no idea", "46", 0.0, 0),
        ("0.5", ".5", 1.0, 1),
    ],
)
def test_numeric_match(response, answer, score, parsed):
    result = numeric_match("", response, {"answer": answer})
    assert result.score == score
    assert result.details == {"correct": int(score), "parsed": parsed}


def test_numeric_match_needs_a_numeric_answer():
    with pytest.raises(ValueError, match="holds no number"):
        numeric_match("", "46", {"answer": "forty-six"})


def test_parse_last_number():
    assert parse_last_number("x = -3.5.") == -3.5
    assert parse_last_number("12 + 34 = 46") == 46.0
    assert parse_last_number("none") is None
