"""IFEval-style rules, each true and false on a real-looking response."""

from __future__ import annotations

import pytest

from reroll.rewards.ifeval import CHECKS, check_constraint, ifeval

CASES = [
    # (type, value, a response that meets it, one that does not)
    ("min_words", 5, "one two three four five", "too short"),
    ("max_words", 3, "short enough here", "this has far too many words"),
    ("min_sentences", 2, "First. Second!", "Only one."),
    ("max_sentences", 1, "Only one.", "One. Two. Three."),
    ("min_chars", 10, "0123456789", "short"),
    ("max_chars", 5, "tiny", "not tiny at all"),
    ("include_keywords", ["Paris", "river"], "The river Seine crosses paris.", "Paris is nice."),
    ("exclude_keywords", ["never"], "Always do it.", "Never say never."),
    ("keyword_frequency", {"keyword": "cat", "min": 2}, "A cat and a Cat.", "A cat, a catalogue."),
    ("json", None, '{"a": 1, "b": [2]}', "{a: 1}"),
    ("json", None, '```json\n{"a": 1}\n```', "```json\n{oops}\n```"),
    ("lowercase", None, "all quiet here", "Not all quiet"),
    ("uppercase", None, "LOUD NOISES", "Quiet"),
    ("bullets", 2, "Items:\n* one\n- two", "* only one"),
    ("paragraphs", 2, "First part.\n\nSecond part.", "One block\nstill one block"),
    ("starts_with", "Dear", "Dear reader, hello.", "Hello, dear reader."),
    (
        "ends_with",
        "Is there anything else?",
        "Done. Is there anything else?",
        "Is there anything else? Done.",
    ),
    ("no_commas", None, "No commas here.", "Yes, one."),
    ("title", None, "<<A Title>>\nbody", "No title"),
    ("placeholders", 2, "Meet at [place] on [date].", "Meet at [place]."),
]


@pytest.mark.parametrize(
    ("kind", "value", "good", "bad"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_rule_true_and_false(kind, value, good, bad):
    c = {"type": kind, "value": value}
    assert check_constraint(good, c) is True
    assert check_constraint(bad, c) is False


def test_every_rule_is_covered():
    assert {c[0] for c in CASES} == set(CHECKS)


def test_score_is_the_fraction_met_after_think():
    sample = {
        "constraints": [{"type": "lowercase"}, {"type": "max_words", "value": 3}, {"type": "no_commas"}]
    }
    r = ifeval("", "<think>Thinking, At Length, About It</think>all fine, really", sample)
    assert r.score == pytest.approx(2 / 3) and r.details["correct"] == 0
    assert ifeval("", "all fine", sample).details["correct"] == 1


def test_unknown_rule_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown constraint type 'haiku'"):
        check_constraint("x", {"type": "haiku"})
