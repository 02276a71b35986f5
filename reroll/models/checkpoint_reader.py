"""A Hugging Face checkpoint's safetensors files as a lazy mapping: a tensor is read from its file
(``safetensors.safe_open``) only when asked for, so a reader that asks for its share reads its share.

Names are the files' own (what ``save_pretrained`` writes), not transformers' state-dict names where a
model converts weights on load (a Qwen3-MoE layer's experts: one tensor per expert on disk, fused in the
model); ``reroll.models.megatron_convert.layer_from_hf`` takes either.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from reroll.errors import UserError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def checkpoint_files(path: str | Path) -> dict[str, str] | None:
    """``{tensor name: file}`` of the safetensors checkpoint at ``path`` (a directory or a hub id, resolved
    as transformers resolves it), from its index or its one ``model.safetensors``; None where it has
    neither (a ``.bin`` checkpoint); a path transformers cannot resolve is a ``UserError``."""
    from safetensors import safe_open
    from transformers.utils import cached_file

    try:
        index = cached_file(str(path), INDEX, _raise_exceptions_for_missing_entries=False)
        if index is not None:  # each file resolved as from_pretrained resolves it (a hub id's: downloaded)
            weight_map = json.loads(Path(index).read_text())["weight_map"]
            local = {file: cached_file(str(path), file) for file in set(weight_map.values())}
            return {name: local[file] for name, file in weight_map.items()}
        single = cached_file(str(path), SINGLE, _raise_exceptions_for_missing_entries=False)
    except OSError as e:  # neither a directory nor a hub id transformers can resolve
        raise UserError(f"cannot read a checkpoint from model.path {str(path)!r}: {e}") from e
    if single is None:
        return None
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


class CheckpointReader(Mapping[str, torch.Tensor]):
    """The tensors of a safetensors checkpoint by name, each read (and cast to ``dtype`` where it is a
    floating-point tensor) when asked for; a file is opened at its first read and stays open until
    ``close`` (or the end of a ``with`` block); ``narrow`` reads a slice alone (a TP rank's rows or
    columns). ``files``: ``checkpoint_files``' map. ``read_bytes`` counts the bytes read so far."""

    def __init__(self, files: Mapping[str, str], dtype: torch.dtype) -> None:
        self.files, self.dtype = dict(files), dtype
        self.read_bytes = 0
        self._open: dict[str, Any] = {}
        self._stack = ExitStack()

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._read(self._file(name).get_tensor(name))

    def shape(self, name: str) -> tuple[int, ...]:
        """``name``'s shape, from its file's header (nothing read)."""
        return tuple(self._file(name).get_slice(name).get_shape())

    def narrow(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """``self[name].narrow(dim, start, length)``, reading only those elements (``get_slice``)."""
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._read(self._file(name).get_slice(name)[index])

    def _file(self, name: str) -> Any:
        from safetensors import safe_open

        file = self.files[name]  # KeyError for a name the checkpoint lacks, as a dict
        if file not in self._open:
            self._open[file] = self._stack.enter_context(safe_open(file, framework="pt"))
        return self._open[file]

    def _read(self, tensor: torch.Tensor) -> torch.Tensor:
        self.read_bytes += tensor.numel() * tensor.element_size()
        return tensor.to(self.dtype) if tensor.is_floating_point() else tensor

    def __contains__(self, name: object) -> bool:
        return name in self.files

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
