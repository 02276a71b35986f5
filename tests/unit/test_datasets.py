import json

import pytest

from reroll.data.datasets import DatasetError, PromptSampler, load_samples


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_load_samples_renders_template(tmp_path):
    f = _write(tmp_path / "t.jsonl", [{"id": "a", "question": "1+2", "answer": "3"}])
    [s] = load_samples([f], template="{question}=", required=["answer"])
    assert (s.uid, s.prompt, s.row["answer"]) == ("a", "1+2=", "3")


def test_missing_answer_field_names_file_row_and_fix(tmp_path):
    f = _write(tmp_path / "t.jsonl", [{"question": "1+2", "answer": "3"}, {"question": "2+2"}])
    with pytest.raises(DatasetError) as e:
        load_samples([f], template="{question}=", required=["answer"])
    msg = str(e.value)
    assert "row 2" in msg and "'answer'" in msg and "t.jsonl" in msg and "data.answer_field" in msg


def test_missing_file_names_path(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_samples([str(tmp_path / "nope.jsonl")], template="{q}")


def test_bad_json_line_names_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"q": 1}\n{oops\n')
    with pytest.raises(DatasetError, match=r"t.jsonl:2"):
        load_samples([str(p)], template="{q}")


def test_parquet_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["1+1"], "answer": ["2"]}), tmp_path / "t.parquet")
    [s] = load_samples([str(tmp_path / "t.parquet")], template="{question}=", required=["answer"])
    assert s.prompt == "1+1="


def test_sampler_is_deterministic_and_restorable(tmp_path):
    f = _write(tmp_path / "t.jsonl", [{"q": str(i)} for i in range(7)])
    samples = load_samples([f], template="{q}")
    a = PromptSampler(samples, 3, seed=1)
    first = [s.uid for _ in range(2) for s in a.next_batch()]
    state = a.state()
    rest = [s.uid for _ in range(4) for s in a.next_batch()]
    b = PromptSampler(samples, 3, seed=1)
    b.restore(state)
    assert [s.uid for _ in range(4) for s in b.next_batch()] == rest
    assert len(set(first)) == 6  # no repeats within an epoch
