"""The 'ipc' transport's CPU handle (``reroll.runtime.shared_buckets``) through two processes: a trainer
rank packs a bucket into a POSIX shared-memory segment and sends only its name and layout; another
process maps it and reads exactly the trainer's values; the segment outlives the reader (its resource
tracker does not unlink it) and is gone once the sender releases it. The short sibling of
``test_weight_sync_ipc.py``."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reroll.runtime.shared_buckets import BucketSharer, SharedBucket, open_shared

pytestmark = pytest.mark.integration

# the engine worker's side, in a process of its own: open the bucket, print what it read
READER = """
import pickle, sys, torch
from reroll.runtime.shared_buckets import open_shared
shared = pickle.load(sys.stdin.buffer)
with open_shared(shared) as weights:
    out = {name: value.clone() for name, value in weights}
    print("opened", len(weights), file=sys.stderr)
torch.save(out, sys.argv[1])
"""


def _read_elsewhere(shared: SharedBucket, out: Path) -> dict[str, torch.Tensor]:
    done = subprocess.run(
        [sys.executable, "-c", READER, str(out)],
        input=pickle.dumps(shared),
        capture_output=True,
        env=os.environ | {"PYTHONPATH": str(Path(__file__).parents[2])},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert b"opened" in done.stderr  # the reader ran and mapped the segment
    assert b"leaked shared_memory" not in done.stderr  # its resource tracker was not handed the segment
    return torch.load(out)


def test_a_bucket_crosses_processes_as_a_segment_name_and_is_freed_by_its_sender(tmp_path):
    gen = torch.Generator().manual_seed(0)
    bucket = [
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(16, 8, generator=gen)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(16, generator=gen)),
        ("model.layers.0.mlp.down_proj.weight", torch.randn(8, 24, generator=gen).T),  # not contiguous
    ]
    sharer = BucketSharer(device=1, on=torch.device("cpu"))
    shared = sharer.share(bucket, torch.float32)
    assert shared.device == 1 and shared.shm is not None and shared.cuda is None
    assert len(pickle.dumps(shared)) < 1024  # what crosses Ray: a name and a layout, not the bytes
    segment = Path("/dev/shm") / shared.shm
    assert segment.exists()

    read = _read_elsewhere(shared, tmp_path / "read.pt")
    for name, value in bucket:
        assert torch.equal(read[name], value), name  # fp32 to fp32: the same bits
    assert segment.exists()  # the reader's exit left the sender's segment alone

    second = sharer.share(bucket, torch.bfloat16)  # the engine's dtype: cast while packing
    read = _read_elsewhere(second, tmp_path / "read2.pt")
    assert all(torch.equal(read[n], v.to(torch.bfloat16)) for n, v in bucket)
    assert sharer.held == 2
    sharer.release(keep=1)  # the first bucket's load is done, the second's may still run
    assert not segment.exists() and (Path("/dev/shm") / second.shm).exists()
    sharer.release()
    assert not (Path("/dev/shm") / second.shm).exists() and sharer.held == 0


def test_views_do_not_outlive_the_mapping(tmp_path):
    sharer = BucketSharer(device=0, on=torch.device("cpu"))
    shared = sharer.share([("w", torch.arange(6.0).reshape(2, 3))], torch.float32)
    with open_shared(shared) as weights:
        kept = weights
        assert torch.equal(weights[0][1], torch.arange(6.0).reshape(2, 3))
    assert kept == []  # emptied at the end of the with: nothing points into the closed mapping
    sharer.release()
