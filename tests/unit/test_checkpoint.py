import errno
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from reroll.errors import RoleError, UserError
from reroll.runtime import checkpoint


def test_partial_checkpoint_is_never_picked(tmp_path):
    done = checkpoint.begin(tmp_path, 1)
    (done / "weights").write_text("x")
    checkpoint.commit(done, {"step": 1})
    crashed = checkpoint.begin(tmp_path, 2)  # a crash mid-write: no commit
    (crashed / "weights").write_text("half")
    assert checkpoint.latest(tmp_path).name == "step_000001"
    assert checkpoint.read_state(checkpoint.latest(tmp_path)) == {"step": 1}


def test_prune_keeps_newest(tmp_path):
    for step in (1, 2, 3):
        checkpoint.commit(checkpoint.begin(tmp_path, step), {"step": step})
    checkpoint.prune(tmp_path, keep_last=2)
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step_000002", "step_000003"]


def test_no_checkpoints(tmp_path):
    assert checkpoint.latest(tmp_path) is None


class _Tokenizer:
    def save_pretrained(self, directory):
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "tokenizer.json").write_text("{}")


class _Actor:
    """Writes part of a checkpoint, then fails the way a full disk does (in the controller, or in a
    worker, where the error arrives as the role's ``RoleError``)."""

    def __init__(self, fail: str | None = None) -> None:
        self.fail = fail

    def save(self, directory, with_optimizer):
        (directory / "model").mkdir()
        (directory / "model" / "model.safetensors").write_bytes(b"\0" * 64)
        if self.fail is None:
            return
        full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "optimizer_rank0.pt"))
        if self.fail == "controller":
            raise full
        raise RoleError("actor_train", 0, "save", f"OSError: {full}") from full


@pytest.mark.parametrize("where", ["controller", "worker"])
def test_a_full_disk_mid_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch, where):
    from reroll.pipelines import run_dir as run_module

    monkeypatch.setattr(run_module, "load_tokenizer", lambda path: _Tokenizer())
    cfg = SimpleNamespace(
        run_dir=tmp_path,
        model=SimpleNamespace(path="m"),
        checkpoint=SimpleNamespace(keep_last=2),
        storage_url=None,
    )
    extra = run_module.Checkpointed({"sampler": {"epoch": 0, "index": 4}})
    first = run_module.save_checkpoint(cfg, _Actor(), 1, extra)
    with pytest.raises(UserError) as e:
        run_module.save_checkpoint(cfg, _Actor(fail=where), 2, extra)
    assert checkpoint.latest(tmp_path) == first  # --resume picks the last complete one
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]  # no partial left
    message = str(e.value)
    who = "the controller" if where == "controller" else "actor_train[0]"
    assert f"checkpoint of step 2 could not be written by {who}: No space left on device" in message
    assert (
        "optimizer_rank0.pt" in message and "step_000001 is still the newest complete checkpoint" in message
    )
    assert "--resume" in message


def test_a_failure_that_is_not_a_write_error_still_removes_the_partial(tmp_path, monkeypatch):
    from reroll.pipelines import run_dir as run_module

    class Dead(_Actor):
        def save(self, directory, with_optimizer):
            super().save(directory, with_optimizer)
            raise RoleError("actor_train", 0, "save", "the worker process died (RayActorError)")

    cfg = SimpleNamespace(
        run_dir=tmp_path,
        model=SimpleNamespace(path="m"),
        checkpoint=SimpleNamespace(keep_last=2),
        storage_url=None,
    )
    with pytest.raises(RoleError):
        run_module.save_checkpoint(cfg, Dead(), 1, run_module.Checkpointed())
    assert list((tmp_path / "checkpoints").iterdir()) == []
