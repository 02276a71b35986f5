"""A synthetic visual task drawn locally: count the shapes in a small image (1 to ``max_count``).

Each image is ``size`` x ``size`` pixels, white, with ``n`` black squares in ``n`` cells of a 4 x 4 grid
drawn at random (so the count is the number of dark image tokens: a tiny model learns it in minutes); the answer is ``n`` as a digit. Rows are
``{"id", "question": "how many shapes?", "answer": "3", "images": [<base64 PNG>], "domain": "shapes"}``
(base64, so a row file is self-contained where it is copied). The same arguments give the same rows;
train and test rows are drawn from disjoint seeds.
"""

from __future__ import annotations

import base64
import random
from pathlib import Path
from typing import Any

from reroll.data.arithmetic import write_splits
from reroll.data.images import encode_image, pil

SHAPES_ALPHABET = "0123456789 abcdefghijklmnopqrstuvwxyz?"
"""Every character a question or answer of this task uses (the tiny model's tokenizer)."""

QUESTION = "how many shapes?"


def draw_shapes(n: int, rng: random.Random, size: int = 32) -> Any:
    """A ``size`` x ``size`` white PIL image with ``n`` black squares, each filling most of its own cell
    of a 4 x 4 grid (cells of 8 pixels at 32: one image token each for the tiny model, whose tokens are
    8 x 8 pixels), the cells drawn at random."""
    image = pil().new("RGB", (size, size), "white")
    cell = size // 4
    pixels = image.load()
    for k in rng.sample(range(16), n):
        x0, y0 = (k % 4) * cell + 1, (k // 4) * cell + 1
        for x in range(x0, x0 + cell - 2):
            for y in range(y0, y0 + cell - 2):
                pixels[x, y] = (0, 0, 0)
    return image


def make_shapes_rows(n: int, *, max_count: int = 4, seed: int = 0, size: int = 32) -> list[dict[str, Any]]:
    """``n`` rows of the counting task, counts uniform in 1..``max_count``."""
    if not 1 <= max_count <= 9:
        raise ValueError(f"max_count {max_count}: the answer is one digit, so it must be 1-9")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        count = rng.randint(1, max_count)
        png = encode_image(draw_shapes(count, rng, size))
        rows.append(
            {
                "id": f"shapes-{seed}-{i}",
                "question": QUESTION,
                "answer": str(count),
                "images": [base64.b64encode(png).decode("ascii")],
                "domain": "shapes",
            }
        )
    return rows


def write_shapes_dataset(
    out_dir: str | Path, *, n_train: int, n_test: int, max_operand: int = 4, seed: int = 0, **_: Any
) -> dict[str, Path]:
    """``train.jsonl`` and ``test.jsonl`` of the counting task in ``out_dir`` (``max_operand``: the most
    shapes in an image, as ``data.synthetic`` names it); returns ``{"train": path, "test": path}``."""
    train = make_shapes_rows(n_train, max_count=max_operand, seed=2 * seed)
    test = make_shapes_rows(n_test, max_count=max_operand, seed=2 * seed + 1)
    return write_splits(out_dir, {"train": train, "test": test})
