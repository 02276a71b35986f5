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
