"""A run's copy in remote storage (``checkpoint.storage``): every complete checkpoint and the run's
records, so ``--resume`` continues on a machine whose disk is gone (a preempted cloud VM, a new node).

The run directory (``output_dir``) stays what it was: checkpoints are written and committed there
first (``reroll.runtime.checkpoint``), then copied up. The copy has the run directory's layout under
the storage URL (any fsspec URL: ``s3://bucket/runs/{name}``, ``gs://...``, ``az://...``, or a path
on a mounted filesystem):

- ``checkpoints/step_000010/...``: each file of the local checkpoint, its ``COMPLETE`` marker last, so
  a copy cut short (the machine lost mid-upload) has no marker and is never picked; older copies are
  pruned to ``checkpoint.keep_last`` as the local ones are;
- the run's records, which a resumed run reads beside the checkpoint (``reroll.runtime.checkpoint.RECORDS``:
  the metrics, the config, TensorBoard's files, the reference's snapshot, a teacher cache): copied after
  each step that checkpoints has logged its metrics (a file of 64 MiB or more only where the copy's
  size differs: the reference's snapshot once).

On ``--resume`` the newest complete checkpoint in storage is downloaded into the run directory when
the run directory has none as new (it is downloaded to a partial directory and renamed, as a local
save is), with the records the run directory lacks. A new run refuses a storage URL that already
holds checkpoints, as it refuses a run directory that does.

Checked before a run starts (``check``): the URL's protocol is known, its package is installed (s3fs,
gcsfs, adlfs: fsspec names it), and a small file can be written, read back and removed there.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from reroll.errors import UserError
from reroll.runtime import checkpoint

log = logging.getLogger(__name__)

RECORD_ALWAYS = 64 << 20  # records under this size are copied every time (a config rewritten at one size)
_THREADS = 8  # files copied at once: object stores take many small requests better in parallel


class Storage:
    """The run's copy under ``url`` (see the module doc)."""

    def __init__(self, url: str) -> None:
        from fsspec.core import url_to_fs

        self.url = url
        self.fs, root = url_to_fs(url)
        self.root = root.rstrip("/")

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    # -- checkpoints ---------------------------------------------------------------------------------
    def complete_steps(self) -> list[int]:
        """Steps of the complete checkpoints in storage (their marker present), oldest first."""
        found = self.fs.glob(self._path("checkpoints", "step_*", checkpoint.MARKER))
        steps = [checkpoint.step_of(Path(path).parent.name) for path in found]
        return sorted(step for step in steps if step is not None)

    def begin(self, step: int) -> None:
        """Before ``step``'s checkpoint is written: remove an earlier copy of it (unfinished, or of a
        step redone after a recovery), so that its files are this save's alone."""
        remote = self._path("checkpoints", checkpoint.step_name(step))
        if self.fs.exists(remote):
            self.fs.rm(remote, recursive=True)

    def finish(self, final: Path, keep_last: int) -> float:
        """Copy the complete local checkpoint ``final`` (files other nodes put there already are kept
        where their size matches), its marker last, and prune older copies to ``keep_last``; returns the
        seconds taken."""
        began = time.perf_counter()
        remote = f"checkpoints/{final.name}"
        self.put_tree(final, remote, leave=(checkpoint.MARKER,))
        self.put_tree(final / checkpoint.MARKER, f"{remote}/{checkpoint.MARKER}")
        for step in self.complete_steps()[:-keep_last]:
            self.fs.rm(self._path("checkpoints", checkpoint.step_name(step)), recursive=True)
        return time.perf_counter() - began

    def download_checkpoint(self, step: int, run_dir: Path) -> Path:
        """The storage's checkpoint of ``step`` as a complete local checkpoint under ``run_dir``."""
        name = checkpoint.step_name(step)
        partial = run_dir / "checkpoints" / f".{name}.download"
        shutil.rmtree(partial, ignore_errors=True)
        self.get_tree(f"checkpoints/{name}", partial, leave=(checkpoint.MARKER,))
        self.get_tree(f"checkpoints/{name}/{checkpoint.MARKER}", partial / checkpoint.MARKER)
        final = run_dir / "checkpoints" / name
        if final.exists():  # an incomplete local copy of the step (a complete newer one is not replaced)
            shutil.rmtree(final)
        partial.rename(final)
        return final

    # -- records -------------------------------------------------------------------------------------
    def upload_records(self, run_dir: Path, records: tuple[str, ...]) -> None:
        """Copy the run's ``records`` (files or directories under ``run_dir``) as they are now: the
        small ones (the config, the metrics, TensorBoard's) every time, a large one (the reference's
        snapshot) where its copy's size differs."""
        for name in records:
            self.put_tree(run_dir / name, name, always_below=RECORD_ALWAYS)

    def download_records(self, run_dir: Path, records: tuple[str, ...]) -> list[str]:
        """Copy into ``run_dir`` the ``records`` it lacks; returns their names."""
        taken = [n for n in records if not (run_dir / n).exists() and self.fs.exists(self._path(n))]
        for name in taken:
            self.get_tree(name, run_dir / name)
        return taken

    # -- copying -------------------------------------------------------------------------------------
    def put_tree(
        self, local: Path, remote: str, *, leave: tuple[str, ...] = (), always_below: int = 0
    ) -> int:
        """Copy the file or directory ``local`` to ``remote`` (relative to the storage's root): each file
        whose copy is missing or of another size, and every file under ``always_below`` bytes (one
        rewritten at the same size), but not the top-level names in ``leave``. Returns the number of
        files copied."""
        files = (
            [local]
            if local.is_file()
            else [p for p in _files(local) if p.relative_to(local).parts[0] not in leave]
        )
        target = {p: "/".join([self._path(remote), *p.relative_to(local).parts]) for p in files}
        sizes = {p: p.stat().st_size for p in files}
        changed = [p for p in files if sizes[p] < always_below or self._size(target[p]) != sizes[p]]

        def put(path: Path) -> None:
            self.fs.makedirs(target[path].rsplit("/", 1)[0], exist_ok=True)
            self.fs.put_file(str(path), target[path])

        _each(put, changed)
        return len(changed)

    def get_tree(self, remote: str, local: Path, *, leave: tuple[str, ...] = ()) -> int:
        """Copy the file or directory ``remote`` (relative to the storage's root) to ``local``: each file
        missing there or of another size, but not the top-level names in ``leave``. Returns the number
        of files copied."""
        root = self.fs._strip_protocol(self._path(remote)).rstrip("/")
        if not self.fs.exists(root):
            return 0
        if self.fs.isfile(root):
            sources = {root: local}
        else:
            sources = {}
            for path, info in self.fs.find(root, detail=True).items():
                relative = self.fs._strip_protocol(path)[len(root) :].strip("/")
                if relative.split("/")[0] not in leave and _size(local / relative) != info["size"]:
                    sources[path] = local / relative

        def get(path: str) -> None:
            sources[path].parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(path, str(sources[path]))

        _each(get, list(sources))
        return len(sources)

    def _size(self, remote: str) -> int | None:
        try:
            return self.fs.size(remote)
        except FileNotFoundError:
            return None


def _size(path: Path) -> int | None:
    return path.stat().st_size if path.is_file() else None


def _files(root: Path) -> Iterator[Path]:
    return (p for p in sorted(root.rglob("*")) if p.is_file())


def _each(fn: Any, items: list) -> None:
    """``fn`` on every item, ``_THREADS`` at a time; the first error is raised."""
    if len(items) <= 1:
        for item in items:
            fn(item)
        return
    with ThreadPoolExecutor(min(_THREADS, len(items))) as pool:
        for _ in pool.map(fn, items):
            pass


def check(url: str, run_dir: Path) -> str | None:
    """What is wrong with ``url`` as the run's storage (the module doc), or None. Writes, reads back and
    removes one small file there."""
    try:
        storage = Storage(url)
    except ImportError as e:  # fsspec's own words name the package: "Install s3fs to access S3"
        return f"{url!r} needs a package that is not installed: {e} (pip install it), or choose another URL"
    except (ValueError, TypeError) as e:
        return f"{url!r} is not a storage URL fsspec knows ({e}): use s3://, gs://, az://, file:// or a path"
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(storage.fs, LocalFileSystem) and Path(storage.root).resolve().is_relative_to(
        run_dir.resolve()
    ):
        return (
            f"{url!r} is the run directory or inside it ({run_dir}): a copy there is lost with the run "
            "directory; choose a URL elsewhere (another disk, a bucket)"
        )
    probe = storage._path(f".reroll-probe-{uuid.uuid4().hex}")
    try:
        storage.fs.makedirs(storage.root, exist_ok=True)
        storage.fs.pipe_file(probe, b"reroll")
        back = storage.fs.cat_file(probe)
        storage.fs.rm_file(probe)
    except Exception as e:  # a network error, a refused credential, a read-only bucket
        return (
            f"cannot write to {url!r} ({type(e).__name__}: {e}): check the URL and the credentials "
            "(the environment variables or files the package reads), or choose another"
        )
    if back != b"reroll":
        return f"{url!r} gave back other bytes than were written to it: choose another URL"
    return None


def restore(url: str, run_dir: Path, records: tuple[str, ...], *, resume: bool) -> Path | None:
    """Before a run opens ``run_dir``: on ``resume``, the storage's newest complete checkpoint downloaded
    into ``run_dir`` where the run directory has none as new (returned), with the ``records`` it lacks;
    a new run refuses a storage that holds checkpoints."""
    storage = Storage(url)
    steps = storage.complete_steps()
    if not resume:
        if steps:
            raise UserError(
                f"checkpoint.storage {url} already holds checkpoints (newest: step {steps[-1]}): add "
                f"--resume to continue that run, or set name / checkpoint.storage to start a new one "
                f"(nothing was overwritten)"
            )
        return None
    local = checkpoint.latest(run_dir)
    local_step = checkpoint.step_of(local.name) if local is not None else None
    if not steps or (local_step is not None and local_step >= steps[-1]):
        return None
    began = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    final = storage.download_checkpoint(steps[-1], run_dir)
    taken = storage.download_records(run_dir, records)
    log.warning(
        "--resume: downloaded %s from %s in %.1f s%s",
        final.name,
        url,
        time.perf_counter() - began,
        f" (and {', '.join(taken)})" if taken else "",
    )
    return final
