"""Preference rows: checks that name file and row, rendering, the synthetic arithmetic pairs, pair batches."""

from __future__ import annotations

import json
import random

import pytest
import torch

from reroll.data.arithmetic import make_arithmetic_rows
from reroll.data.datasets import DatasetError
from reroll.data.packing import micro_batches
from reroll.data.preferences import (
    PreferencePair,
    check_preference_row,
    load_pairs,
    make_arithmetic_preferences,
    near_miss,
    pair_batch,
    render_pair,
    write_arithmetic_preferences,
)


@pytest.fixture(scope="module")
def tiny_tokenizer(assets):
    from reroll.models.loading import load_tokenizer

    return load_tokenizer(str(assets["model"]))


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "1+1=", "chosen": "2"}, "row 3 has no field 'rejected'"),
        ({"prompt": "1+1=", "chosen": " ", "rejected": "3"}, "row 3: 'chosen' is empty"),
        ({"prompt": "1+1=", "chosen": "2", "rejected": "2"}, "row 3: 'chosen' and 'rejected' are the same"),
        ({"prompt": "1+1=", "chosen": 2, "rejected": "3"}, "row 3: 'chosen' is a int"),
        ({"prompt": [{"role": "user"}], "chosen": "2", "rejected": "3"}, "is not a chat message"),
        ({"prompt": [], "chosen": "2", "rejected": "3"}, "'prompt' is a list"),
    ],
)
def test_bad_rows_name_file_and_row(row, message):
    with pytest.raises(DatasetError, match=r"prefs\.jsonl") as e:
        check_preference_row("prefs.jsonl", 2, row)
    assert message in str(e.value)


def test_load_pairs_reports_the_first_bad_row(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
        {"prompt": "2+2=", "chosen": "4", "rejected": "4"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError, match=r"p.jsonl: row 2: 'chosen' and 'rejected' are the same"):
        load_pairs([str(path)])
    path.write_text(json.dumps(rows[0]) + "\n")
    assert load_pairs([str(path)]) == [PreferencePair(f"{path}:1", "1+1=", "2", "3")]


def test_chat_rows_render_through_the_template(tiny_tokenizer):
    row = {
        "prompt": [{"role": "user", "content": "1+1="}],
        "chosen": [{"role": "assistant", "content": "2"}],
        "rejected": "3",
    }
    prompt, chosen, rejected = render_pair(row, tiny_tokenizer)
    assert (prompt, chosen, rejected) == ("<|user|>1+1=<|assistant|>", "2", "3")  # eos comes from pair_batch


def test_near_miss_is_wrong_close_and_non_negative():
    rng = random.Random(0)
    for answer in (0, 7, 10, 46, 99, 198):
        for _ in range(50):
            wrong = near_miss(answer, rng)
            assert wrong != answer and wrong >= 0
            assert abs(wrong - answer) <= 100 or len(str(wrong)) == len(str(answer))  # one digit or a carry


def test_arithmetic_preferences_follow_the_arithmetic_split():
    pairs = make_arithmetic_preferences(20, max_operand=30, seed=3)
    problems = make_arithmetic_rows(20, max_operand=30, seed=3)
    assert [p["question"] for p in pairs] == [r["question"] for r in problems]  # same split as the task
    for p in pairs:
        a, b = map(int, p["question"].split("+"))
        assert p["prompt"] == f"{p['question']}=" and p["chosen"] == str(a + b) != p["rejected"]
        check_preference_row("x", 0, p)


def test_several_negatives_per_training_question_leave_the_held_out_pairs(tmp_path):
    one = write_arithmetic_preferences(tmp_path / "one", n_train=30, n_test=10, max_operand=30, seed=3)
    four = write_arithmetic_preferences(
        tmp_path / "four", n_train=30, n_test=10, max_operand=30, seed=3, negatives=4
    )
    read = lambda p: [json.loads(line) for line in p.read_text().splitlines()]  # noqa: E731
    assert four["test"].read_text() == one["test"].read_text()  # the same held-out pairs
    train_one, train_four = read(one["train"]), read(four["train"])
    assert len(train_four) == 4 * len(train_one) and train_four[::4] == train_one  # the first is the same
    for i in range(0, len(train_four), 4):
        rows = train_four[i : i + 4]
        assert len({r["question"] for r in rows}) == 1 and len({r["id"] for r in rows}) == 4
        assert len({r["rejected"] for r in rows}) == 4 and all(r["rejected"] != r["chosen"] for r in rows)


def test_pair_batch_layout_and_pair_preserving_micro_batches(tiny_tokenizer):
    pairs = [PreferencePair(str(i), f"{i}+1=", str(i + 1), str(i + 11)) for i in range(5)]
    batch = pair_batch(pairs, tiny_tokenizer)
    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    row = batch.chosen.input_ids[0][batch.chosen.attention_mask[0]].tolist()
    assert tiny_tokenizer.decode(row[:-1]) == "0+1=1" and row[-1] == eos
    assert batch.chosen.response_mask[0].tolist()[:6] == [False] * 4 + [True, True]  # "1" and eos
    stacked = batch.stacked()
    assert len(stacked) == 10 and (stacked.input_ids[~stacked.attention_mask] == pad).all()
    assert [len(s) for s in batch.split(2)] == [2, 3] or [len(s) for s in batch.split(2)] == [3, 2]
    parts = micro_batches(batch.proxy(), max_rows=2, max_tokens=None)
    assert [p.group_ids.tolist() for p in parts] == [[0, 1], [2, 3], [4]]  # whole pairs, in order
    assert torch.equal(
        batch.select(slice(2, 4)).rejected.input_ids, batch.rejected.select(slice(2, 4)).trim().input_ids
    )
