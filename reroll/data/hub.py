"""Rows of a Hugging Face dataset given by name and split, or of a ``save_to_disk`` directory.

``{dataset: org/name, split: train, subset: main, rename: {problem: question}}`` in
``data.train_files`` loads with ``datasets.load_dataset("org/name", "main", split="train")``. With
``HF_DATASETS_OFFLINE=1`` (or ``HF_HUB_OFFLINE=1``) that reads the local cache only
(``HF_DATASETS_CACHE``, default ``~/.cache/huggingface/datasets``); a dataset that is not there is
an error that says so and gives the command that fetches it. Without those variables a machine that
cannot reach the Hub (no network, a firewall) is found out by one TCP connection with a 3 s timeout,
and the cache is read as if offline: datasets' own retries would take most of a minute per entry.
Needs ``pip install 'reroll[data]'``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from reroll.config.data import HubDatasetConfig
from reroll.errors import UserError


class HubDatasetError(UserError):
    """A dataset by name that cannot be read: not installed, not cached, no such split or subset."""


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as e:
        raise HubDatasetError(
            "reading a Hugging Face dataset (or a save_to_disk directory) needs `datasets`: "
            "pip install 'reroll[data]'"
        ) from e
    return datasets


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    return path.is_dir() and any(
        (path / name).exists() for name in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


def read_saved_rows(path: Path, split: str | None, limit: int | None) -> list[dict[str, Any]]:
    """Rows of a ``save_to_disk`` directory; a ``DatasetDict`` needs ``split``."""
    datasets = _datasets()
    found = datasets.load_from_disk(str(path))
    if isinstance(found, datasets.DatasetDict):  # one dataset per split
        splits = list(found.keys())
        if split is None:
            raise HubDatasetError(
                f"{path}: holds the splits {splits}: name one, as {{dataset: {path}, split: {splits[0]}}}"
            )
        if split not in found:
            raise HubDatasetError(f"{path}: no split {split!r}; it has {splits}: fix the split")
        found = found[split]
    return _rows(found, limit)


def fetch_command(source: HubDatasetConfig) -> str:
    """The one line that puts ``source`` into the local cache (run where the Hub can be reached)."""
    subset = f", {source.subset!r}" if source.subset else ""
    return (
        f'python -c "import datasets; datasets.load_dataset({source.dataset!r}{subset}, '
        f'split={source.split!r})"'
    )


def read_hub_rows(source: HubDatasetConfig, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of ``source`` (the first ``limit``), fields renamed by ``source.rename``."""
    path = Path(source.dataset)
    if is_saved_dataset(path):
        rows = read_saved_rows(path, source.split, limit)
    elif path.exists() or source.dataset.startswith((".", "/", "~")):
        raise HubDatasetError(
            f"dataset {source.dataset!r}: a local path that is not a directory written by save_to_disk: "
            f"give a file path as a plain entry of the list, or a Hub id ('org/name')"
        )
    else:
        rows = _load_hub(source, limit)
    return [_renamed(row, source, i) for i, row in enumerate(rows)]


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """datasets' and huggingface_hub's log lines ("Using the latest cached version ...", "... thrown
    while requesting HEAD ...") say what the config asked for; failures come back as errors."""
    loggers = [logging.getLogger(name) for name in ("datasets", "huggingface_hub")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def hub_endpoint() -> tuple[str, int]:
    """The Hub's host and port (``HF_ENDPOINT``, default https://huggingface.co)."""
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


@functools.cache
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether one TCP connection to the Hub opens within ``timeout_s`` (asked once per process). With a
    proxy configured the answer is left to the proxy: True."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    try:
        with socket.create_connection(hub_endpoint(), timeout=timeout_s):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def _offline(datasets: Any) -> Iterator[None]:
    """datasets and huggingface_hub in offline mode for one call (what HF_DATASETS_OFFLINE=1 does)."""
    import huggingface_hub.constants as hub

    before = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = before


def _load_hub(source: HubDatasetConfig, limit: int | None) -> list[dict[str, Any]]:
    datasets = _datasets()
    offline = bool(datasets.config.HF_HUB_OFFLINE)
    unreachable = not offline and not hub_reachable()
    try:
        with _quiet_datasets(), _offline(datasets) if unreachable else contextlib.nullcontext():
            found = datasets.load_dataset(source.dataset, source.subset, split=source.split)
    except (ConnectionError, FileNotFoundError) as e:
        raise HubDatasetError(_not_cached(source, offline, e, unreachable)) from e
    except ValueError as e:  # no such split, or no such subset (in the cache: "Couldn't find cache ...")
        text = " ".join(str(e).split()).rstrip(".")
        if "split" in text.lower():
            fix = "fix `split`"
        elif "config" in text.lower():
            fix = "fix `subset` (load_dataset's name)"
        else:
            fix = "fix the entry"
        raise HubDatasetError(f"dataset {source.label!r}: {text}: {fix}") from e
    except Exception as e:  # datasets' own errors (DatasetNotFoundError, a gated repo, ...)
        if type(e).__name__ in ("DatasetNotFoundError", "DataFilesNotFoundError", "EmptyDatasetError"):
            raise HubDatasetError(_not_cached(source, offline, e, unreachable)) from e
        raise
    return _rows(found, limit)


def _not_cached(source: HubDatasetConfig, offline: bool, error: Exception, unreachable: bool = False) -> str:
    datasets = _datasets()
    where = f"the local cache ({datasets.config.HF_DATASETS_CACHE})"
    if unreachable:
        host, port = hub_endpoint()
        return (
            f"dataset {source.label!r} is not in {where}, and the Hub ({host}:{port}) cannot be reached "
            f"from this machine: fetch it once where the Hub can be reached, with the same HF_HOME / "
            f"HF_DATASETS_CACHE: {fetch_command(source)}; or copy that cache here, or give the rows as a "
            f"local JSONL/Parquet file"
        )
    if offline:
        return (
            f"dataset {source.label!r} is not in {where}, and HF_DATASETS_OFFLINE / HF_HUB_OFFLINE is set "
            f"so it is not downloaded: fetch it once where the Hub can be reached, with the same HF_HOME / "
            f"HF_DATASETS_CACHE: {fetch_command(source)}; or copy that cache here"
        )
    return (
        f"dataset {source.label!r} could not be loaded from the Hub or from {where} "
        f"({type(error).__name__}: {' '.join(str(error).split())[:300]}): check the id and your network "
        f"(private or gated datasets need `hf auth login`), or fetch it elsewhere with "
        f"{fetch_command(source)} and copy the cache here (HF_DATASETS_OFFLINE=1 then reads it without "
        f"trying the Hub)"
    )


def _rows(found: Any, limit: int | None) -> list[dict[str, Any]]:
    if limit is not None:
        found = found.select(range(min(limit, len(found))))
    return [dict(row) for row in found]


def _renamed(row: dict[str, Any], source: HubDatasetConfig, index: int) -> dict[str, Any]:
    if not source.rename:
        return row
    missing = [k for k in source.rename if k not in row]
    if missing:
        raise HubDatasetError(
            f"dataset {source.label!r}: row {index + 1} has no field {missing[0]!r} to rename (it has "
            f"{sorted(row)}): fix `rename`"
        )
    renamed = {source.rename.get(k, k): v for k, v in row.items()}
    clashes = [new for old, new in source.rename.items() if new in row and new not in source.rename]
    if clashes:
        raise HubDatasetError(
            f"dataset {source.label!r}: `rename` gives the name {clashes[0]!r} to a field, but the rows "
            f"already have a field {clashes[0]!r}: rename that one too, or choose another name"
        )
    return renamed
