"""Directories moved through the storage between nodes whose run directories are disks of their own
(``reroll.runtime.node_copies``), with the nodes played in this process: each node's task runs here
against a directory standing for that node's disk at the same path. The two-node cluster with a node
of its own disk is ``tests/integration/test_cluster_node_check.py`` (long)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reroll.runtime import node_copies


@pytest.fixture
def nodes(tmp_path, monkeypatch):
    """``{"driver": root, "other": root}``: the driver's disk (which the head node shares) and another
    node's; a call's task runs once per node, the directory's path moved onto that node's disk."""
    roots = {"driver": tmp_path / "driver", "other": tmp_path / "other"}
    calls = []

    def on_nodes(fn, url, directory, *args):
        relative = Path(directory).relative_to(roots["driver"])
        for node in ("driver", "other"):
            calls.append((fn.__name__, node, fn(url, str(roots[node] / relative), *args)))

    monkeypatch.setattr(node_copies, "_on_nodes", on_nodes)
    return {**roots, "calls": calls}


def _write(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def _read(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_gather_makes_the_drivers_copy_whole_and_drops_the_other_nodes_parts(tmp_path, nodes):
    url = f"file://{tmp_path / 'bucket'}"
    partial = Path("run/checkpoints/.step_000001.partial")
    _write(nodes["driver"] / partial, {"model/part-0.safetensors": b"driver's rank"})
    _write(
        nodes["other"] / partial, {"model/part-1.safetensors": b"other's rank", "state/__1_0.distcp": b"s"}
    )
    node_copies.gather(url, nodes["driver"] / partial, "checkpoints/step_000001", drop=True)
    assert _read(nodes["driver"] / partial) == {
        "model/part-0.safetensors": b"driver's rank",
        "model/part-1.safetensors": b"other's rank",
        "state/__1_0.distcp": b"s",
    }
    assert not (nodes["other"] / partial).exists()  # its part is in the storage and with the driver
    # the driver's node found the token and did nothing; the other copied its two files
    assert [(name, node, n) for name, node, n in nodes["calls"]] == [
        ("_send", "driver", 0),
        ("_send", "other", 2),
    ]
    assert not list((nodes["driver"] / partial).glob(".reroll-driver-*"))  # the token is gone


def test_scatter_gives_every_node_the_drivers_whole_copy_and_only_that_checkpoint(tmp_path, nodes):
    url = f"file://{tmp_path / 'bucket'}"
    ckpt = Path("run/checkpoints/step_000002")
    whole = {"COMPLETE": b"", "model/a.safetensors": b"a", "state/.metadata": b"m"}
    _write(nodes["driver"] / ckpt, whole)
    _write(nodes["other"] / ckpt.parent / "step_000001", {"old": b"an older checkpoint, gone after"})
    _write(nodes["other"] / ckpt, {"model/a.safetensors": b"b"})  # an older copy of the step, same size
    node_copies.scatter(url, nodes["driver"] / ckpt, "checkpoints/step_000002", alone=True)
    assert _read(nodes["other"] / ckpt) == whole
    assert sorted(p.name for p in (nodes["other"] / ckpt.parent).iterdir()) == ["step_000002"]
    assert [(node, n) for _, node, n in nodes["calls"]] == [("driver", 0), ("other", 3)]  # downloaded whole
    assert _read(nodes["driver"] / ckpt) == whole  # the driver's own copy is as it was


def test_without_a_storage_or_a_cluster_of_several_nodes_nothing_moves(tmp_path):
    assert not node_copies.spread(None)
    assert not node_copies.spread(f"file://{tmp_path}")  # no Ray cluster of several nodes here


def test_the_node_check_lets_in_a_run_directory_of_its_own_only_with_a_storage(tmp_path):
    """``preflight_nodes.run_dir_problems`` on a node that does not see the driver's token."""
    from reroll.pipelines.preflight_nodes import run_dir_problems

    own = tmp_path / "node-disk" / "runs" / "t"
    [(key, message)] = run_dir_problems(own, "the driver's token")
    assert key == "output_dir" and "is missing here" in message and "checkpoint.storage" in message
    assert run_dir_problems(own, "the driver's token", f"file://{tmp_path / 'bucket'}") == []
    assert own.is_dir()  # made here, where this node's ranks write their parts
    (tmp_path / "a-file").write_text("")
    [(key, message)] = run_dir_problems(own, "the driver's token", str(tmp_path / "a-file" / "below"))
    assert key == "checkpoint.storage" and message.startswith("from this node: cannot write")
