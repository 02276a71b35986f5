"""``model.build_tiny.alphabet`` / ``make-tiny-model --alphabet``: a name or the characters themselves."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from reroll.cli import main
from reroll.config.alphabet import ALPHABET_NAMES
from reroll.config.loader import ConfigError, load_config
from reroll.config.model import ModelConfig, TinyModelConfig
from reroll.config.schema import RunConfig
from reroll.data.arithmetic import ARITHMETIC_ALPHABET
from reroll.models.tiny import ALPHABETS, GAME_ALPHABET, resolve_alphabet
from reroll.models.tiny_build import ensure_tiny_model

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart" / "arithmetic_grpo.yaml"
SMALL = {"hidden_size": 32, "num_heads": 1, "num_layers": 1}  # head dim 32: the smallest valid model


def _alphabet_error(value: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, RunConfig, [f"model.build_tiny.alphabet={value}"])
    return str(info.value)


def test_config_names_match_the_kit():
    assert set(ALPHABET_NAMES) == set(ALPHABETS)


@pytest.mark.parametrize(
    ("value", "chars"),
    [
        ("arithmetic", ARITHMETIC_ALPHABET),
        ("game", GAME_ALPHABET),
        ("ascii", string.printable),
        ("0123456789+-=abc ", "0123456789+-=abc "),  # not letters only: the characters themselves
        ("chars:abc", "abc"),  # letters only need the prefix
        ("chars:game", "game"),  # ... which also reaches the letters of a name
        ("Ab1", "Ab1"),
    ],
)
def test_resolve_alphabet(value, chars):
    assert resolve_alphabet(value) == chars


def test_config_accepts_a_custom_alphabet_and_keeps_it_as_written():
    cfg = load_config(QUICKSTART, RunConfig, ["model.build_tiny.alphabet='0123456789+-=abc '"])
    assert cfg.model.build_tiny.alphabet == "0123456789+-=abc "


def test_unknown_name_is_a_config_error_with_the_fix():
    err = _alphabet_error("arithmatic")
    assert "model.build_tiny.alphabet: unknown alphabet 'arithmatic' (did you mean 'arithmetic'?)" in err
    assert "'chars:arithmatic'" in err  # how to mean these letters as characters


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("''", "model.build_tiny.alphabet: alphabet '' has no characters"),
        ("'chars:'", "model.build_tiny.alphabet: alphabet 'chars:' has no characters"),
        ("'0123é€'", "model.build_tiny.alphabet: alphabet has non-ASCII characters ['é', '€']"),
    ],
)
def test_empty_and_non_ascii_are_config_errors(value, message):
    err = _alphabet_error(value)
    assert message in err
    assert "use" in err.split(message)[1]  # followed by the fix


def test_ensure_tiny_model_honours_the_alphabet_then_leaves_the_model_alone(tmp_path):
    model = ModelConfig(path=str(tmp_path / "m"), build_tiny=TinyModelConfig(alphabet="ascii", **SMALL))
    assert ensure_tiny_model(model) == tmp_path / "m"
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")  # reloaded as transformers and vLLM load it
    text = "Reverse 4071:\n\tok!"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert len(tok) == 6 + 100  # pad, eos, unk, 3 role markers + string.printable's 100 characters
    assert ensure_tiny_model(model) is None  # the path exists now: nothing is rebuilt
    assert ensure_tiny_model(ModelConfig(path=str(tmp_path / "other"))) is None  # no build_tiny


def test_make_tiny_model_takes_a_custom_alphabet(tmp_path, capsys):
    out = tmp_path / "m"
    sizes = ["--hidden-size", "32", "--num-heads", "1", "--num-layers", "1"]
    assert main(["make-tiny-model", str(out), "--alphabet", "0123456789+-=abc ", *sizes]) == 0
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok.encode("ab 1+2=c", add_special_tokens=False)) == "ab 1+2=c"
    assert tok.decode(tok.encode("xyz9", add_special_tokens=False)) == "9"  # outside the alphabet


def test_make_tiny_model_rejects_an_unknown_name(tmp_path, capsys):
    assert main(["make-tiny-model", str(tmp_path / "m"), "--alphabet", "gmae"]) == 2
    err = capsys.readouterr().err
    assert "--alphabet: unknown alphabet 'gmae' (did you mean 'game'?)" in err
    assert not (tmp_path / "m").exists()


def test_make_tiny_model_help_names_the_alphabets(capsys):
    with pytest.raises(SystemExit):
        main(["make-tiny-model", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "a name (arithmetic, game, ascii) or the characters themselves" in help_text
