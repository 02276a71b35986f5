"""``lost_characters``: the characters a tokenizer cannot give back, and the run's one warning."""

from __future__ import annotations

import string

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from reroll.data.arithmetic import ARITHMETIC_ALPHABET
from reroll.data.coverage import FIX, lost_characters, lost_characters_warning
from reroll.models.tiny import char_tokenizer


@pytest.fixture(scope="module")
def arithmetic():
    return char_tokenizer(ARITHMETIC_ALPHABET)  # "0123456789+-*= "


def _byte_level_all_bytes() -> PreTrainedTokenizerFast:
    """A byte-level BPE holding all 256 bytes (GPT-2's and Qwen's kind): it loses no character."""
    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def _sentencepiece_like() -> PreTrainedTokenizerFast:
    """Lowercase letters and digits, '▁' for a space with a dummy prefix (the decoder drops a leading
    space), and ``<unk>`` for anything else: Llama's kind without byte fallback."""
    vocab = {"<unk>": 0, "▁": 1} | {c: i + 2 for i, c in enumerate(string.ascii_lowercase + string.digits)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def test_finds_exactly_the_characters_outside_the_alphabet(arithmetic):
    # "Reverse 4071:" -> outside "0123456789+-*= ": R, e (x3, counted once per text), v, r, s, ':'.
    # "12+34=" loses nothing; "Reverse 12:" loses the same six. Equal counts sort by code point.
    lost = lost_characters(arithmetic, ["Reverse 4071:", "12+34=", "Reverse 12:"])
    assert list(lost.items()) == [(":", 2), ("R", 2), ("e", 2), ("r", 2), ("s", 2), ("v", 2)]


def test_counts_texts_with_duplicates_and_sorts_by_count():
    # alphabet "a": "ab" twice and "b" lose 'b' (3 texts); "xa" loses 'x' (1 text).
    assert list(lost_characters(char_tokenizer("a"), ["ab", "ab", "b", "xa"]).items()) == [("b", 3), ("x", 1)]


def test_a_full_alphabet_loses_nothing():
    texts = [string.printable, "  two  spaces  ", " leading", "trailing ", "tab\tand\nnewline\n", ""]
    assert lost_characters(char_tokenizer(string.printable), texts) == {}


def test_a_byte_level_tokenizer_loses_nothing_not_even_non_ascii():
    texts = ["Reverse 4071:", "café € 😀", " x ", "a\n\nb"]
    assert lost_characters(_byte_level_all_bytes(), texts) == {}


def test_a_decoder_that_drops_a_leading_space_is_not_a_lost_space():
    tokenizer = _sentencepiece_like()
    assert tokenizer.decode(tokenizer.encode(" ", add_special_tokens=False)) == ""  # alone, ' ' vanishes
    # ... but inside text it survives; '!' and '€' become <unk> and are lost (one text holds them).
    assert lost_characters(tokenizer, ["hello world", " lead", "price 5€!"]) == {"!": 1, "€": 1}


def test_the_warning_names_the_characters_an_example_and_the_fix(arithmetic):
    message = lost_characters_warning(arithmetic, ["12+34=", "Reverse 4071:"], what="prompts")
    assert message == (
        "the tokenizer cannot represent 6 characters of the prompts (2 checked), so the model never sees "
        "them and cannot write them: ':' in 1, 'R' in 1, 'e' in 1, 'r' in 1, 's' in 1, 'v' in 1; "
        "e.g. 'Reverse 4071:' reads as ' 4071'. Fix: " + FIX
    )
    assert "model.build_tiny.alphabet, e.g. 'ascii'" in FIX and "model.path" in FIX


def test_the_warning_shortens_a_long_list_and_is_none_when_nothing_is_lost(arithmetic):
    message = lost_characters_warning(arithmetic, ["Reverse 4071:"], show=2)
    assert "cannot represent 6 characters" in message and "':' in 1, 'R' in 1, and 4 more;" in message
    assert lost_characters_warning(arithmetic, ["12+34=", "7*8=56"]) is None
