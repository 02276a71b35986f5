"""A synthetic verifiable task: integer arithmetic, ``"12+34"`` -> ``"46"``.

Small enough for a tiny model on CPU, checkable by exact match. The pipeline's prompt is
``"{question}="`` and the response is the answer followed by ``<eos>``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ARITHMETIC_ALPHABET = "0123456789+-*= "
"""Every character a question, prompt or answer of this task uses (a leading ``-`` for negatives)."""

OPS = ("+", "-", "*")
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def make_arithmetic_rows(
    n: int,
    *,
    max_operand: int = 99,
    ops: Sequence[str] = ("+",),
    seed: int = 0,
    min_operand: int = 0,
) -> list[dict[str, Any]]:
    """``n`` distinct problems ``a op b`` with ``a, b`` uniform in ``[min_operand, max_operand]``.

    Rows are ``{"id", "question": "12+34", "answer": "46", "domain": "arithmetic"}``; the same
    arguments give the same rows. Raises ``ValueError`` when fewer than ``n`` distinct problems exist.
    """
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        raise ValueError(f"ops {list(ops)} must be a non-empty subset of {list(OPS)}; unknown: {unknown}")
    if not 0 <= min_operand <= max_operand:
        raise ValueError(
            f"need 0 <= min_operand ({min_operand}) <= max_operand ({max_operand}); fix the operand range"
        )
    ops = list(dict.fromkeys(ops))
    width = max_operand - min_operand + 1
    space = len(ops) * width * width
    if n > space:
        raise ValueError(
            f"asked for {n} distinct problems but only {space} exist with ops={ops} and operands in "
            f"[{min_operand}, {max_operand}]; lower n or raise max_operand"
        )
    rows = []
    # Sample indices into the (op, a, b) grid without replacement: distinct problems, no materialised grid.
    for i, index in enumerate(random.Random(seed).sample(range(space), n)):
        op_index, rest = divmod(index, width * width)
        a, b = (min_operand + k for k in divmod(rest, width))
        op = ops[op_index]
        rows.append(
            {
                "id": f"arithmetic-{seed}-{i}",
                "question": f"{a}{op}{b}",
                "answer": str(_APPLY[op](a, b)),
                "domain": "arithmetic",
            }
        )
    return rows


def write_arithmetic_dataset(
    out_dir: str | Path,
    *,
    n_train: int,
    n_test: int,
    max_operand: int = 99,
    ops: Sequence[str] = ("+",),
    seed: int = 0,
    min_operand: int = 0,
) -> dict[str, Path]:
    """Write ``train.jsonl`` and ``test.jsonl`` (disjoint: no test question is in train) to ``out_dir``.

    Returns ``{"train": path, "test": path}``.
    """
    rows = make_arithmetic_rows(
        n_train + n_test, max_operand=max_operand, ops=ops, seed=seed, min_operand=min_operand
    )
    return write_splits(out_dir, {"train": rows[:n_train], "test": rows[n_train:]})


def write_splits(out_dir: str | Path, splits: dict[str, Sequence[dict]]) -> dict[str, Path]:
    """``<split>.jsonl`` in ``out_dir`` for each split, each row's id prefixed with its split's name;
    returns ``{split: path}``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {split: out / f"{split}.jsonl" for split in splits}
    for split, split_rows in splits.items():
        with paths[split].open("w") as f:
            for row in split_rows:
                f.write(json.dumps({**row, "id": f"{split}-{row['id']}"}) + "\n")
    return paths
