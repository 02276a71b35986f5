"""The run's copy in storage (``reroll.runtime.storage``), on fsspec's local filesystem: a checkpoint
counts only once its marker is there, older copies are pruned, a download is complete or absent, and a
URL that cannot be used is named before a run starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from fsspec.registry import known_implementations

from reroll.errors import UserError
from reroll.runtime import checkpoint, storage


def _checkpoint(run_dir: Path, step: int) -> Path:
    partial = checkpoint.begin(run_dir, step)
    (partial / "model").mkdir()
    (partial / "model" / "weights.bin").write_bytes(bytes([step]) * 100)
    (partial / "state.pt").write_bytes(b"state")
    return checkpoint.commit(partial, {"step": step})


def test_a_copy_counts_once_its_marker_is_there_and_older_ones_are_pruned(tmp_path):
    store = storage.Storage(f"file://{tmp_path / 'bucket'}")
    for step in (1, 2, 3):
        store.begin(step)
        store.finish(_checkpoint(tmp_path / "run", step), keep_last=2)
    assert store.complete_steps() == [2, 3]
    (tmp_path / "bucket" / "checkpoints" / "step_000003" / checkpoint.MARKER).unlink()  # cut short
    assert store.complete_steps() == [2]
    # a later upload of the same step replaces the unfinished copy whole
    store.begin(3)
    store.finish(tmp_path / "run" / "checkpoints" / "step_000003", keep_last=2)
    assert store.complete_steps() == [2, 3]


def test_resume_downloads_the_newest_copy_where_the_run_directory_has_none_as_new(tmp_path):
    url = f"file://{tmp_path / 'bucket'}"
    run = tmp_path / "run"
    for step in (1, 2):
        storage.Storage(url).finish(_checkpoint(run, step), keep_last=2)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    storage.Storage(url).upload_records(run, checkpoint.RECORDS)
    fresh = tmp_path / "fresh"
    got = storage.restore(url, fresh, checkpoint.RECORDS, resume=True)
    assert got == fresh / "checkpoints" / "step_000002" == checkpoint.latest(fresh)
    assert (got / "model" / "weights.bin").read_bytes() == bytes([2]) * 100
    assert (fresh / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert not list((fresh / "checkpoints").glob(".*"))  # no partial download left
    # a run directory as new as the storage keeps its own files
    (fresh / "metrics.jsonl").write_text("mine")
    assert storage.restore(url, fresh, checkpoint.RECORDS, resume=True) is None
    assert (fresh / "metrics.jsonl").read_text() == "mine"
    with pytest.raises(UserError, match="already holds checkpoints"):
        storage.restore(url, tmp_path / "new", checkpoint.RECORDS, resume=False)
    assert not (tmp_path / "new").exists()


def test_an_unusable_url_is_named_with_its_fix(tmp_path, monkeypatch):
    run = tmp_path / "run"
    assert storage.check(f"file://{tmp_path / 'bucket'}", run) is None
    assert "Protocol not known" in storage.check("nope://x", run)
    assert "inside it" in storage.check(str(run / "copy"), run)
    monkeypatch.setitem(
        known_implementations,
        "missingfs",
        {"class": "reroll_absent_package.FileSystem", "err": "Install reroll-absent-package"},
    )
    problem = storage.check("missingfs://bucket/run", run)
    assert "Install reroll-absent-package" in problem and "pip install" in problem
    (tmp_path / "file").write_text("")
    assert "cannot write" in storage.check(str(tmp_path / "file" / "below"), run)


def test_a_copy_that_fails_stops_the_run_naming_the_complete_local_checkpoint(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from reroll.pipelines import run_dir as run_module
    from tests.unit.test_checkpoint import _Actor, _Tokenizer

    monkeypatch.setattr(run_module, "load_tokenizer", lambda path: _Tokenizer())
    (tmp_path / "a-file").write_text("")  # the storage lies below a regular file: nothing can be put there
    cfg = SimpleNamespace(
        run_dir=tmp_path / "run",
        model=SimpleNamespace(path="m"),
        checkpoint=SimpleNamespace(keep_last=2),
        storage_url=f"file://{tmp_path / 'a-file' / 'below'}",
    )
    with pytest.raises(UserError) as e:
        run_module.save_checkpoint(cfg, _Actor(), 1, run_module.Checkpointed())
    message = str(e.value)
    assert message.startswith("checkpoint.storage: copying step_000001 to file://") and "--resume" in message
    assert f"The local checkpoint {tmp_path / 'run' / 'checkpoints' / 'step_000001'} is complete" in message
    assert checkpoint.latest(tmp_path / "run").name == "step_000001"


def test_a_record_rewritten_at_the_same_size_is_copied_again(tmp_path):
    """A resumed run rewrites config.yaml (total_steps 2 -> 3: the same size); small records are copied
    every time, so the copy is never the older file."""
    store, run = storage.Storage(f"file://{tmp_path / 'bucket'}"), tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("total_steps: 2\n")
    store.upload_records(run, checkpoint.RECORDS)
    (run / "config.yaml").write_text("total_steps: 3\n")
    store.upload_records(run, checkpoint.RECORDS)
    assert (tmp_path / "bucket" / "config.yaml").read_text() == "total_steps: 3\n"
