"""How ``model.build_tiny.alphabet`` (and ``reroll make-tiny-model --alphabet``) is read.

A value is either the name of an alphabet or the characters themselves:

- a value of letters only (``arithmetic``, ``game``, ``ascii``) is a name, and must be a known one;
- a value that starts with ``chars:`` is the characters after the prefix (``chars:abc``: the way to
  give characters that are letters only);
- any other value is the characters themselves (``"0123456789+-= "``); duplicates are ignored and
  the order sets the token ids.

The characters must be ASCII: the tiny tokenizer is byte-level with one token per character. The
named alphabets' characters live with the tiny-model kit (``reroll.models.tiny.ALPHABETS``); this
module only knows their names, so that the config can be validated without importing torch.
"""

from __future__ import annotations

import difflib
import re
from typing import Annotated

from pydantic import AfterValidator

ALPHABET_NAMES = ("arithmetic", "game", "ascii")
"""The named alphabets; ``reroll.models.tiny.ALPHABETS`` holds their characters."""

CHARS_PREFIX = "chars:"
_NAME = re.compile(r"[A-Za-z]+")


def parse_alphabet(value: str) -> tuple[str | None, str]:
    """``(name, "")`` for a named alphabet, ``(None, characters)`` for custom characters.

    Raises ``ValueError`` saying what to write instead for an unknown name, an empty alphabet or
    non-ASCII characters; the message does not name the key, the caller's prefix does.
    """
    if value.startswith(CHARS_PREFIX):
        return None, _checked_chars(value[len(CHARS_PREFIX) :], value)
    if _NAME.fullmatch(value):
        if value not in ALPHABET_NAMES:
            close = difflib.get_close_matches(value, ALPHABET_NAMES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"unknown alphabet {value!r}{hint}; use a name ({', '.join(map(repr, ALPHABET_NAMES))}) "
                f"or the characters themselves, e.g. '0123456789+-= '; a value of letters only is read "
                f"as a name, so write letters as '{CHARS_PREFIX}{value}'"
            )
        return value, ""
    return None, _checked_chars(value, value)


def _check_alphabet(value: str) -> str:
    parse_alphabet(value)
    return value


Alphabet = Annotated[str, AfterValidator(_check_alphabet)]
"""A config field holding an alphabet name or characters, validated by ``parse_alphabet``."""


def _checked_chars(chars: str, value: str) -> str:
    if not chars:
        raise ValueError(
            f"alphabet {value!r} has no characters; use a name ({', '.join(map(repr, ALPHABET_NAMES))}) "
            "or the characters the texts use, e.g. '0123456789+-= '"
        )
    non_ascii = sorted({c for c in chars if not c.isascii()})
    if non_ascii:
        raise ValueError(
            f"alphabet has non-ASCII characters {non_ascii}, which the tiny byte-level tokenizer cannot "
            "hold as single tokens; use ASCII characters only, or a real model (model.path) for other text"
        )
    return chars
