"""A run copied to ``checkpoint.storage`` resumes after its run directory is gone (a preempted VM's
disk), and a new run does not write over a storage that holds one (``reroll.runtime.storage``)."""

from __future__ import annotations

import json
import shutil

import pytest

from reroll.cli import main
from reroll.runtime.metrics import read_metrics
from tests.conftest import step_metrics, write_config

pytestmark = pytest.mark.integration

LOCAL = ["runtime.backend=local"]


def test_a_run_resumes_from_storage_after_its_run_directory_is_gone(tmp_path, assets, capsys):
    cfg = write_config(
        tmp_path / "c.yaml",
        assets,
        pipeline="sft",
        sft={"steps": 3, "batch_size": 16, "lr": 1e-3},
        checkpoint={"every": 1, "keep_last": 1},
        eval={"every": 0},
    )
    store = tmp_path / "bucket"
    storage = f"checkpoint.storage=file://{store}/{{name}}"
    assert main(["train", str(cfg), "name=straight", *LOCAL]) == 0
    capsys.readouterr()
    assert main(["train", str(cfg), "name=stopped", *LOCAL, "sft.steps=2", storage]) == 0
    assert f"copied to:  file://{store}/stopped" in capsys.readouterr().out  # the summary says where

    copy = store / "stopped"
    # keep_last 1 holds in storage too: step 1's copy was pruned when step 2's was complete
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["step_000002"]
    local = tmp_path / "runs" / "stopped" / "checkpoints" / "step_000002"
    assert _files(copy / "checkpoints" / "step_000002") == _files(local)  # every file, byte for byte
    assert "COMPLETE" in _files(local) and any(f.startswith("model/") for f in _files(local))
    assert [m["step"] for m in read_metrics(copy)] == [m["step"] for m in read_metrics(local.parents[1])]
    assert (copy / "config.yaml").is_file()

    shutil.rmtree(tmp_path / "runs" / "stopped")  # the machine is gone: only the storage holds the run
    capsys.readouterr()
    assert main(["train", str(cfg), "name=stopped", *LOCAL, "sft.steps=3", storage, "--resume"]) == 0
    assert "downloaded step_000002" in capsys.readouterr().err

    resumed_dir = tmp_path / "runs" / "stopped"
    # Step 3 from the downloaded checkpoint is the uninterrupted run's step 3, exactly: the same weights,
    # Adam moments, step and data position, read back bit for bit, through the same kernels on this machine.
    assert step_metrics(resumed_dir, 3) == step_metrics(tmp_path / "runs" / "straight", 3)
    # the history came back with the checkpoint: no step lost or logged twice
    steps = [m["step"] for m in read_metrics(resumed_dir)]
    assert steps == [m["step"] for m in read_metrics(tmp_path / "runs" / "straight")]
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["step_000003"]
    assert [m["step"] for m in read_metrics(copy)] == steps
    assert json.loads((copy / "checkpoints" / "step_000003" / "trainer_state.json").read_text())["step"] == 3


def test_an_rlvr_run_with_a_reference_resumes_from_storage(tmp_path, assets, capsys):
    """RLVR with a KL term: the resumed run's reference is the snapshot the run started from, downloaded
    with the checkpoint (the run directory's ``reference/`` is gone with it)."""
    cfg = write_config(
        tmp_path / "c.yaml",
        assets,
        total_steps=3,
        algorithm={"kl_coef": 0.04},
        checkpoint={"every": 1, "keep_last": 1},
        eval={"every": 0},
    )
    storage = f"checkpoint.storage=file://{tmp_path / 'bucket'}/{{name}}"
    assert main(["train", str(cfg), "name=straight", *LOCAL]) == 0
    assert main(["train", str(cfg), "name=stopped", *LOCAL, "total_steps=2", storage]) == 0
    run_dir, copy = tmp_path / "runs" / "stopped", tmp_path / "bucket" / "stopped"
    assert _files(copy / "reference") == _files(run_dir / "reference") != {}
    shutil.rmtree(run_dir)
    capsys.readouterr()
    assert main(["train", str(cfg), "name=stopped", *LOCAL, storage, "--resume"]) == 0
    assert "downloaded step_000002" in capsys.readouterr().err
    straight, resumed = step_metrics(tmp_path / "runs" / "straight", 3), step_metrics(run_dir, 3)
    assert straight.keys() == resumed.keys() and "actor/kl" in resumed
    for key in straight:  # the same tolerance as the other resume tests (a fresh process's kernels)
        assert resumed[key] == pytest.approx(straight[key], rel=1e-5, abs=1e-6), key


def test_a_new_run_refuses_a_storage_that_holds_checkpoints(tmp_path, assets, capsys):
    cfg = write_config(
        tmp_path / "c.yaml", assets, pipeline="sft", sft={"steps": 1, "batch_size": 16}, eval={"every": 0}
    )
    storage = f"checkpoint.storage=file://{tmp_path / 'bucket'}/shared"
    assert main(["train", str(cfg), "name=first", *LOCAL, storage]) == 0
    capsys.readouterr()
    assert main(["train", str(cfg), "name=second", *LOCAL, storage]) != 0
    err = capsys.readouterr().err
    assert "already holds checkpoints" in err and "--resume" in err and "Traceback" not in err
    assert not (tmp_path / "runs" / "second").exists()  # refused before the run directory was made


def test_validate_names_a_storage_it_cannot_use(tmp_path, assets, capsys):
    cfg = write_config(tmp_path / "c.yaml", assets)
    inside = f"checkpoint.storage={tmp_path / 'runs' / 't' / 'copy'}"
    assert main(["validate", str(cfg), inside, "checkpoint.storage=nope://x"]) != 0
    err = capsys.readouterr().err
    assert "checkpoint.storage" in err and "Protocol not known: nope" in err
    assert main(["validate", str(cfg), inside]) != 0
    assert "is the run directory or inside it" in capsys.readouterr().err


def _files(root):
    """``{relative path: bytes}`` of every file under ``root``."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
