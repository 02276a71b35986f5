"""Prompt datasets: rows from JSONL / JSON / Parquet / Hugging Face ``datasets``, rendered by a template.

A row is a flat mapping (``{"question": "12+34", "answer": "46"}``). The user message is
``template.format(**row)``; the model's prompt is that message in the run's ``PromptFormat``
(``reroll.data.chat``: the chat template, or the text as it is); the reward function sees the
message and the whole row. Rows are checked when loaded, so a missing field is reported with its
file and line before any model is started.

A source is a path (a file, or a ``save_to_disk`` directory) or a ``HubDatasetConfig``: a Hugging
Face dataset by name and split, loaded with ``datasets.load_dataset`` (from the local cache when
``HF_DATASETS_OFFLINE=1``), its fields renamed as the config says.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reroll.config.data import HubDatasetConfig
from reroll.data.images import row_images, without_images
from reroll.data.types import Sample
from reroll.errors import UserError

Source = str | Path | HubDatasetConfig


class DatasetError(UserError):
    """A dataset file is missing, unreadable, or has a row without a needed field."""


def template_fields(template: str) -> list[str]:
    """The row fields a prompt template reads: ``{question}``, ``{meta[level]}`` -> ``meta``."""
    names = [name for _, name, _, _ in string.Formatter().parse(template) if name]
    return list(dict.fromkeys(re.split(r"[.\[]", name)[0] for name in names))


def source_name(source: Source) -> str:
    """How errors and row ids name a source: the path, or ``org/name[subset]:split``."""
    return source.label if isinstance(source, HubDatasetConfig) else str(source)


def read_rows(path: Source, limit: int | None = None) -> list[dict[str, Any]]:
    """Every row (or the first ``limit``) of a ``.jsonl``, ``.json`` or ``.parquet`` file, of a
    ``datasets`` save directory, or of a Hugging Face dataset (``HubDatasetConfig``). Whatever cannot
    be read is a ``DatasetError`` naming the file and the fix: missing, a directory where a file is
    meant, not UTF-8, not valid JSON, a row that is not an object, a dataset not in the cache."""
    if isinstance(path, HubDatasetConfig):
        from reroll.data.hub import read_hub_rows

        return read_hub_rows(path, limit)
    p = Path(path)
    if not p.exists():
        relative = (
            "" if p.is_absolute() else f" (a relative path is read from the current directory, {Path.cwd()})"
        )
        raise DatasetError(
            f"dataset file {str(path)!r} does not exist{relative}: fix the path in data.train_files / "
            f"data.eval_files"
        )
    try:
        rows = _read(p, limit)
    except PermissionError as e:
        raise DatasetError(f"{p}: cannot read it ({e.strerror}): fix its permissions") from e
    except UnicodeDecodeError as e:
        raise DatasetError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start}): save it as UTF-8") from e
    bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
    if bad is not None:
        raise DatasetError(
            f"{p}: row {bad + 1} is {type(rows[bad]).__name__}, not an object: each row must be a JSON "
            f'object such as {{"question": ..., "answer": ...}}'
        )
    return rows


def _read(p: Path, limit: int | None) -> list[Any]:
    if p.is_dir():
        from reroll.data.hub import is_saved_dataset, read_saved_rows

        if not is_saved_dataset(p):
            raise DatasetError(
                f"{p}: is a directory, not a dataset file: name a .jsonl / .json / .parquet file, or a "
                f"directory written by datasets' save_to_disk"
            )
        return read_saved_rows(p, None, limit)
    if p.suffix == ".jsonl":
        return _read_jsonl(p, limit)
    if p.suffix == ".json":
        try:
            data = json.loads(p.read_bytes().decode("utf-8"))
        except json.JSONDecodeError as e:
            raise DatasetError(
                f"{p}: not valid JSON at line {e.lineno}, column {e.colno} ({e.msg}): a .json dataset is one "
                f"list of objects; for one object per line, name the file .jsonl"
            ) from e
        if not isinstance(data, list):
            raise DatasetError(
                f"{p}: a .json dataset must hold a list of objects, not a {type(data).__name__}"
            )
        return data[:limit]
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise DatasetError(f"{p}: reading Parquet needs pyarrow: pip install 'reroll[data]'") from e
        try:
            if limit is None:
                return pq.read_table(p).to_pylist()
            first = next(pq.ParquetFile(p).iter_batches(batch_size=limit), None)
            return first.to_pylist() if first is not None else []
        except Exception as e:  # pyarrow's errors for a file that is not Parquet
            raise DatasetError(f"{p}: not a readable Parquet file ({type(e).__name__}: {e})") from e
    raise DatasetError(
        f"{p}: unknown dataset format {p.suffix!r}; use .jsonl, .json, .parquet or a datasets dir"
    )


def _read_jsonl(path: Path, limit: int | None) -> list[dict[str, Any]]:
    rows = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if limit is not None and len(rows) >= limit:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(
                    f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start} of the line): save the "
                    f"file as UTF-8"
                ) from e
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(
                    f"{path}:{lineno}: not valid JSON ({e.msg}): one JSON object per line"
                ) from e
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{lineno}: each line must be a JSON object")
            rows.append(row)
    return rows


def check_row(file: str, index: int, row: dict[str, Any], needed: Sequence[str]) -> None:
    """``row`` (the ``index``-th of ``file``, from 0) has every field in ``needed``."""
    missing = [k for k in needed if k not in row]
    if missing:
        raise DatasetError(
            f"{file}: row {index + 1} has no field {missing[0]!r} (the prompt template or the reward "
            f"needs {list(needed)}; the row has {sorted(row)}): add the field to every row, or set "
            f"data.prompt_template / data.answer_field to the names your file uses"
        )


def load_samples(
    files: Sequence[Source],
    *,
    template: str,
    render: Callable[..., str] | None = None,
    required: Sequence[str] = (),
    id_field: str = "id",
    domain_field: str = "domain",
    limit: int | None = None,
    image_field: str | None = None,
) -> list[Sample]:
    """Rows of ``files`` made into ``Sample``s; a row lacking a template field or a ``required`` field is an error.

    The sample's ``message`` is ``template.format(**row)``; its ``prompt``, what the model reads, is
    ``render(message, images=k)`` (a ``PromptFormat.prompt``, which places the row's k images; the
    message itself without ``render``). ``image_field``: the field holding a row's images
    (``reroll.data.images``: each must open, else the error names the row); they become the sample's
    ``images`` and leave its ``row``."""
    needed = list(dict.fromkeys([*template_fields(template), *required]))
    samples: list[Sample] = []
    for file in files:
        name = source_name(file)
        stem = Path(file).stem if not isinstance(file, HubDatasetConfig) else name
        base = Path(file).parent if not isinstance(file, HubDatasetConfig) else None
        for i, row in enumerate(read_rows(file)):
            check_row(name, i, row, needed)
            uid = str(row.get(id_field, f"{stem}-{i}"))
            domain = str(row.get(domain_field, "default"))
            message = template.format(**row)
            images = row_images(f"{name}: row {i + 1}", row, image_field, base) if image_field else ()
            row = without_images(row, image_field)
            if render is None:
                prompt = message
            else:
                prompt = render(message, images=len(images)) if images else render(message)
            samples.append(
                Sample(uid=uid, prompt=prompt, row=row, domain=domain, message=message, images=images)
            )
            if limit is not None and len(samples) >= limit:
                return samples
    if not samples:
        raise DatasetError(
            f"no rows in {[source_name(f) for f in files]}: the dataset files are empty; add rows or fix "
            f"the paths"
        )
    return samples


@dataclass
class PromptSampler:
    """Endless, reshuffled-every-epoch batches of samples, with a position that a checkpoint can restore."""

    samples: list[Sample]
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    epoch: int = 0
    index: int = 0

    def _order(self) -> list[int]:
        order = list(range(len(self.samples)))
        if self.shuffle:
            random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self) -> list[Sample]:
        batch: list[Sample] = []
        order = self._order()
        while len(batch) < self.batch_size:
            if self.index >= len(order):
                self.epoch, self.index = self.epoch + 1, 0
                order = self._order()
            batch.append(self.samples[order[self.index]])
            self.index += 1
        return batch

    def __iter__(self) -> Iterator[list[Sample]]:
        while True:
            yield self.next_batch()

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


class DomainSampler:
    """Each step's prompts drawn from several domains by fixed shares, each domain its own ``PromptSampler``.

    A batch of ``batch_size`` prompts takes ``share * batch_size`` from each domain; the fractional
    parts carry over to later steps (largest credit first), so over many steps every domain gets
    its share exactly even when a single batch cannot split evenly. Batches list domains in the
    order given. ``state()``/``restore()`` cover every domain's position and the carried credit.
    """

    def __init__(
        self,
        by_domain: dict[str, list[Sample]],
        shares: dict[str, float],
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        empty = [d for d, s in shares.items() if s > 0 and not by_domain.get(d)]
        if empty:
            raise DatasetError(
                f"reward domains {empty} have a share but no training rows: add rows tagged for them "
                f"(the row's `domain` field) or set their share to 0"
            )
        self.shares, self.batch_size = shares, batch_size
        self.samplers = {
            d: PromptSampler(by_domain[d], 1, seed=seed + i, shuffle=shuffle)
            for i, d in enumerate(shares)
            if shares[d] > 0
        }
        self.credit = dict.fromkeys(self.samplers, 0.0)

    def counts(self) -> dict[str, int]:
        """How many prompts each domain gives to the next batch (and the credit carried on)."""
        for d in self.credit:
            self.credit[d] += self.shares[d] * self.batch_size
        counts = {d: int(c) for d, c in self.credit.items()}
        by_remainder = sorted(self.credit, key=lambda d: self.credit[d] - counts[d], reverse=True)
        for d in by_remainder[: self.batch_size - sum(counts.values())]:
            counts[d] += 1
        for d in counts:
            self.credit[d] -= counts[d]
        return counts

    def next_batch(self) -> list[Sample]:
        batch: list[Sample] = []
        for d, n in self.counts().items():
            sampler = self.samplers[d]
            sampler.batch_size = n
            batch += sampler.next_batch() if n else []
        return batch

    def __iter__(self) -> Iterator[list[Sample]]:
        while True:
            yield self.next_batch()

    def state(self) -> dict[str, Any]:
        return {"domains": {d: s.state() for d, s in self.samplers.items()}, "credit": dict(self.credit)}

    def restore(self, state: dict[str, Any]) -> None:
        for d, s in self.samplers.items():
            s.restore(state["domains"][d])
        self.credit = {d: float(state["credit"][d]) for d in self.samplers}
