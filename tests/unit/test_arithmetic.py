import json
import operator

import pytest

from reroll.data.arithmetic import ARITHMETIC_ALPHABET, make_arithmetic_rows, write_arithmetic_dataset

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _evaluate(question: str) -> int:
    # "12-34" -> 12 - 34; operands are non-negative, so the first operator after position 0 splits them.
    for i, char in enumerate(question):
        if char in _OPS and i > 0:
            return _OPS[char](int(question[:i]), int(question[i + 1 :]))
    raise AssertionError(f"no operator in {question!r}")


def test_rows_are_correct_and_in_alphabet():
    rows = make_arithmetic_rows(300, max_operand=50, ops=("+", "-", "*"), seed=1)
    assert len(rows) == 300
    for row in rows:
        assert row["domain"] == "arithmetic"
        assert str(_evaluate(row["question"])) == row["answer"]
        assert set(row["question"] + "=" + row["answer"]) <= set(ARITHMETIC_ALPHABET)
    assert {row["question"][len(row["question"].rstrip("0123456789")) - 1] for row in rows} == {"+", "-", "*"}
    assert len({row["question"] for row in rows}) == 300
    assert len({row["id"] for row in rows}) == 300


def test_operand_range():
    rows = make_arithmetic_rows(100, max_operand=99, min_operand=10, ops=("+",), seed=0)
    operands = [int(x) for row in rows for x in row["question"].split("+")]
    assert min(operands) >= 10 and max(operands) <= 99


def test_deterministic_by_seed():
    assert make_arithmetic_rows(50, max_operand=99, ops=("+",), seed=7) == make_arithmetic_rows(
        50, max_operand=99, ops=("+",), seed=7
    )
    assert make_arithmetic_rows(50, max_operand=99, ops=("+",), seed=7) != make_arithmetic_rows(
        50, max_operand=99, ops=("+",), seed=8
    )


def test_too_many_rows_is_an_error():
    # 2 ops x 3 x 3 operand pairs = 18 distinct problems
    assert len(make_arithmetic_rows(18, max_operand=2, ops=("+", "-"), seed=0)) == 18
    with pytest.raises(ValueError, match="only 18 exist"):
        make_arithmetic_rows(19, max_operand=2, ops=("+", "-"), seed=0)


def test_unknown_op_is_an_error():
    with pytest.raises(ValueError, match="unknown: \\['/'\\]"):
        make_arithmetic_rows(5, max_operand=9, ops=("+", "/"), seed=0)


def test_written_splits_are_disjoint_and_deterministic(tmp_path):
    paths = write_arithmetic_dataset(
        tmp_path / "a", n_train=400, n_test=100, max_operand=30, ops=("+", "-"), seed=3
    )
    again = write_arithmetic_dataset(
        tmp_path / "b", n_train=400, n_test=100, max_operand=30, ops=("+", "-"), seed=3
    )
    splits = {
        name: [json.loads(line) for line in path.read_text().splitlines()] for name, path in paths.items()
    }
    assert len(splits["train"]) == 400 and len(splits["test"]) == 100
    train_questions = {row["question"] for row in splits["train"]}
    assert not train_questions & {row["question"] for row in splits["test"]}
    assert set(splits["train"][0]) == {"id", "question", "answer", "domain"}
    for name in paths:
        assert paths[name].read_text() == again[name].read_text()


def test_synthetic_settings_past_the_problem_space_name_the_section(tmp_path):
    from types import SimpleNamespace

    from reroll.data.arithmetic import write_arithmetic_dataset
    from reroll.errors import UserError
    from reroll.pipelines.common import write_synthetic_files

    syn = SimpleNamespace(n_train=500, n_test=10, max_operand=9, ops="+", seed=0, task="arithmetic")
    targets = [tmp_path / "train.jsonl", tmp_path / "test.jsonl"]
    with pytest.raises(
        UserError, match=r"data\.synthetic: asked for 510 distinct problems but only 100 exist"
    ):
        write_synthetic_files(write_arithmetic_dataset, syn, targets, "data")
    assert not any(p.exists() for p in targets)  # nothing half-written
