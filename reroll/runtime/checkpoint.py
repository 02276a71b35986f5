"""Checkpoint directories that are complete or invisible.

A checkpoint is written into ``checkpoints/.step_000010.partial``; only when every file is in place is a
``COMPLETE`` marker written and the directory renamed to ``step_000010``. A crash mid-write leaves a
``.partial`` directory that ``latest`` never picks (and the next save of that step replaces). A write
that fails (a full disk) removes the partial directory (``discard``) and becomes one message
(``write_failed``): the newest complete checkpoint stays the one ``--resume`` picks.

Layout: ``model/`` (Hugging Face: ``from_pretrained`` loads it; written in parts by every rank),
``state/`` (the weights and optimizer for ``--resume``, in torch's distributed checkpoint format: every
rank's shards, read back at any world size; ``reroll.strategies.sharded_state``), ``adapter/`` with
LoRA, ``critic/`` (its own ``model/`` and ``state/``), ``trainer_state.json`` (step, data position,
algorithm state). DeepSpeed keeps ``deepspeed/`` instead of ``state/``, and Megatron ``optimizer/`` (its
optimizer state in the weights' form beside ``model/``, read back at any layout:
``reroll.strategies.megatron_optimizer_state``). Checkpoints from before ``state/`` (and Megatron's from
before ``optimizer/``) hold ``optimizer_rank{r}.pt`` instead.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from reroll.errors import UserError

_NAME = re.compile(r"^step_(\d{6,})$")
MARKER = "COMPLETE"
# beside ``checkpoints/`` in the run directory
REFERENCE = "reference"  # the reference's snapshot: the policy the loop started from (``run._begin``)
TEACHER_CACHE = "teacher_cache.pt"  # a distillation's teacher outputs, read back on --resume
# what a resumed run reads from the run directory beside its checkpoint, or keeps as the run's history:
# copied with the checkpoints to checkpoint.storage (``reroll.runtime.storage``)
RECORDS = ("config.yaml", "metrics.jsonl", "reward_errors.txt", "tensorboard", REFERENCE, TEACHER_CACHE)


def step_name(step: int) -> str:
    """The directory name of ``step``'s checkpoint: ``step_000010``."""
    return f"step_{step:06d}"


def step_of(name: str) -> int | None:
    """The step of a checkpoint directory's name (``step_000010``: 10), or None for any other name."""
    found = _NAME.match(name)
    return int(found.group(1)) if found else None


def begin(run_dir: Path, step: int) -> Path:
    """An empty partial directory for ``step``."""
    partial = run_dir / "checkpoints" / f".{step_name(step)}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def commit(partial: Path, state: dict[str, Any]) -> Path:
    """Write ``trainer_state.json`` and the marker, then rename into place; returns the final path."""
    (partial / "trainer_state.json").write_text(json.dumps(state, indent=2))
    (partial / MARKER).write_text("")
    final = partial.parent / partial.name.removeprefix(".").removesuffix(".partial")
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)
    return final


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if step_of(p.name) is not None and (p / MARKER).exists()]
    return sorted(found, key=lambda p: step_of(p.name))


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def read_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / "trainer_state.json").read_text())


def prune(run_dir: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints."""
    for old in complete_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def discard(partial: Path) -> None:
    """Remove a partial checkpoint that will not be completed."""
    shutil.rmtree(partial, ignore_errors=True)


def write_failed(run_dir: Path, step: int, error: OSError, who: str) -> UserError:
    """The error of a checkpoint whose write failed with ``error`` (in ``who``: the controller or a role)."""
    where = f" ({error.filename})" if error.filename else ""
    kept = latest(run_dir)
    still = (
        f"{kept.name} is still the newest complete checkpoint" if kept else "no complete checkpoint exists"
    )
    return UserError(
        f"checkpoint of step {step} could not be written by {who}: {error.strerror or error}{where}. "
        f"The partial checkpoint was removed and {still}: free space under {run_dir} "
        f"(checkpoint.keep_last bounds how many are kept)" + (", then continue with --resume" if kept else "")
    )


def model_dir(path: Path) -> Path:
    """The model directory of ``path``: a checkpoint (``step_000200``, its ``model/``) or a run
    directory (its newest complete checkpoint): what ``reroll generate`` and ``reroll serve`` load for
    ``--checkpoint``."""
    path = Path(path)
    if (path / "model" / "config.json").is_file():
        return path / "model"
    if (path / "config.json").is_file():
        return path
    latest_checkpoint = latest(path)
    if latest_checkpoint is not None:
        return latest_checkpoint / "model"
    raise UserError(
        f"--checkpoint {path}: no model there (no config.json in it or in its model/ directory, and no "
        f"complete checkpoint under {path / 'checkpoints'}): give a run's checkpoints/step_XXXXXX, its "
        f"model/ directory or the run directory"
    )
