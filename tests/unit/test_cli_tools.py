"""The offline helper commands: tiny model, synthetic data, config docs."""

from __future__ import annotations

import json

from transformers import AutoModelForCausalLM, AutoTokenizer

from reroll.cli import main


def test_make_tiny_model_loads_with_transformers(tmp_path, capsys):
    out = tmp_path / "m"
    assert (
        main(["make-tiny-model", str(out), "--hidden-size", "64", "--num-heads", "2", "--num-layers", "1"])
        == 0
    )
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.hidden_size // model.config.num_attention_heads == 32
    assert tok.decode(tok.encode("12+34=", add_special_tokens=False)) == "12+34="


def test_make_tiny_model_rejects_bad_head_dim(tmp_path, capsys):
    assert main(["make-tiny-model", str(tmp_path / "m"), "--hidden-size", "96", "--num-heads", "2"]) == 2
    err = capsys.readouterr().err
    assert "= 48" in err and "(32, 64)" in err  # names the head dim it got and the ones it accepts


def test_make_data_writes_disjoint_splits(tmp_path, capsys):
    assert main(["make-data", str(tmp_path), "--n-train", "50", "--n-test", "10"]) == 0
    train = [json.loads(x)["question"] for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    test = [json.loads(x)["question"] for x in (tmp_path / "test.jsonl").read_text().splitlines()]
    assert len(train) == 50 and len(test) == 10 and not set(train) & set(test)
