"""Which characters of a run's texts a tokenizer cannot represent, and the one warning that says so.

The tiny character-level tokenizer drops every character outside its alphabet on encode, without a
sign: a prompt "Reverse 4071:" reaches a model built with the arithmetic alphabet as " 4071:", and an
answer with a letter in it can never be produced. ``lost_characters_warning`` run on the prompts and
answers at the start of a run says so once, with an example and the fix.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Protocol

FIX = (
    "use a larger alphabet in model.build_tiny.alphabet, e.g. 'ascii' or a custom string containing "
    "them, or model.path with a real tokenizer"
)
_ANCHORS = ("0", "a")  # tried first as the anchor of the probes (they combine with no mark under NFC)


class RoundTripTokenizer(Protocol):
    """The two methods used here; any Hugging Face tokenizer has them."""

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]: ...

    def decode(
        self, token_ids: list[int], *, skip_special_tokens: bool, clean_up_tokenization_spaces: bool
    ) -> str: ...


def lost_characters(tokenizer: RoundTripTokenizer, texts: Iterable[str]) -> dict[str, int]:
    """Each character of ``texts`` that ``tokenizer`` does not give back -> how many texts contain it.

    Characters are checked one by one, not texts: each distinct character ``c`` is encoded and
    decoded once, as ``anchor + c + anchor`` (``add_special_tokens=False``; special tokens such as
    ``<unk>`` skipped and no clean-up of spaces on decode), and is lost when the decoded probe holds
    fewer ``c`` than the probe. Why:

    - cost: one round trip per distinct character (about 100 for 10k English texts) plus one pass
      over the texts to collect and count characters, whatever the number of texts;
    - exactness: a tokenizer loses a character whatever surrounds it, by dropping it (the tiny
      byte-level tokenizer: no token for it) or mapping it to ``<unk>`` (a vocabulary without byte
      fallback); checking the character alone names exactly the culprit, where a whole text's round
      trip would also blame the neighbours that a word-level ``<unk>`` swallows;
    - no false alarms: the ``anchor`` (a character the tokenizer keeps, ``"0"`` or ``"a"`` when
      it keeps those) keeps every probed character inside the text, so a decoder that drops a
      leading space (SentencePiece's dummy prefix) does not read as a lost space; spaces are not
      cleaned up on decode.

    A normaliser that rewrites a character (NFKC's "ﬁ" -> "fi") reports it as lost: the model never
    sees it. Counts include duplicate texts. Returns characters by descending count, then code point;
    an empty dict when nothing is lost. Pass texts as written (prompts, answers, targets), not rendered
    through a chat template: the characters of a special token such as ``<|user|>`` would be probed
    one by one.
    """
    counts = Counter(texts)  # distinct text -> how many times it occurs
    chars: set[str] = set().union(*counts)
    anchor = _anchor(tokenizer, chars)
    lost = {c for c in chars if not _kept(tokenizer, c, anchor)}
    texts_losing: Counter[str] = Counter()
    if lost:
        for text, n in counts.items():
            for c in lost.intersection(text):
                texts_losing[c] += n
    return dict(sorted(texts_losing.items(), key=lambda item: (-item[1], item[0])))


def lost_characters_warning(
    tokenizer: RoundTripTokenizer, texts: Iterable[str], *, what: str = "texts", show: int = 20
) -> str | None:
    """The one warning for a run whose ``texts`` (``what``: "prompts and answers") hold characters
    ``tokenizer`` loses, or ``None``: the characters (``repr``, with how many texts hold each, the
    first ``show``), the first such text and what the model reads instead, and the fix."""
    texts = list(texts)
    lost = lost_characters(tokenizer, texts)
    if not lost:
        return None
    listed = ", ".join(f"{c!r} in {n}" for c, n in list(lost.items())[:show])
    if len(lost) > show:
        listed += f", and {len(lost) - show} more"
    example = next(t for t in texts if not lost.keys().isdisjoint(t))
    return (
        f"the tokenizer cannot represent {len(lost)} character{'s' if len(lost) > 1 else ''} of the "
        f"{what} ({len(texts)} checked), so the model never sees them and cannot write them: {listed}; "
        f"e.g. {_short(example)} reads as {_short(_round_trip(tokenizer, example))}. Fix: {FIX}"
    )


def _kept(tokenizer: RoundTripTokenizer, char: str, anchor: str) -> bool:
    probe = anchor + char + anchor
    return _round_trip(tokenizer, probe).count(char) >= probe.count(char)


def _round_trip(tokenizer: RoundTripTokenizer, text: str) -> str:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _anchor(tokenizer: RoundTripTokenizer, chars: set[str]) -> str:
    """A visible character the tokenizer gives back unchanged ("" when none of those tried is)."""
    candidates = [*_ANCHORS, *sorted(c for c in chars if c.isprintable() and not c.isspace())]
    return next((c for c in candidates if _round_trip(tokenizer, c * 2) == c * 2), "")


def _short(text: str, limit: int = 80) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 4] + "..." + shown[-1]
