"""Whether the texts a policy must write fit ``rollout.max_new_tokens``.

A response is cut at ``max_new_tokens``: an answer longer than that cannot be written whole, so the
share of rows whose answer is cut is accuracy the run can never reach. ``length_fit`` measures it on
the texts (the SFT targets, else the answers) with the model's tokenizer; ``reroll validate`` warns on
the training rows (``reroll.pipelines.preflight_calls``), and the run's step 0 compares the held-out
accuracy with what the held-out rows allow (``LengthFit.ceiling``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LengthFit:
    """How ``rows`` texts fit a cap of ``cap`` new tokens, where ``end`` tokens end a response."""

    rows: int
    cut: int  # texts longer than the cap: never written whole
    no_end: int  # texts that fit, but with no room left for the end-of-response token(s)
    longest: int  # tokens of the longest text
    end: int
    cap: int

    @property
    def share_cut(self) -> float:
        return self.cut / self.rows if self.rows else 0.0

    @property
    def ceiling(self) -> float:
        """The accuracy the cap allows: the share of texts that fit."""
        return 1.0 - self.share_cut

    @property
    def fitting_cap(self) -> int:
        """The smallest ``max_new_tokens`` that holds every text and its end."""
        return self.longest + self.end


def length_fit(tokenizer: Any, texts: Iterable[str], *, cap: int, end: int) -> LengthFit:
    """``texts`` tokenized as the SFT warm start tokenizes its targets (no special tokens added)."""
    lengths = [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    return LengthFit(
        rows=len(lengths),
        cut=sum(n > cap for n in lengths),
        no_end=sum(cap - end < n <= cap for n in lengths),
        longest=max(lengths, default=0),
        end=end,
        cap=cap,
    )


def answer_template(cfg: Any) -> str:
    """The template of what a right response to a row is: ``sft.target_template`` where the run learns
    the rows' targets (SFT, a warm start), else ``{answer}``."""
    sft = cfg.section("sft")
    return sft.target_template if sft is not None and cfg.reads_targets else "{answer}"


def reference_text(row: Mapping[str, Any], template: str) -> str | None:
    """``template`` over ``row``, or None when the row lacks a field it reads."""
    try:
        return template.format(**row)
    except (KeyError, IndexError, AttributeError, ValueError):
        return None
