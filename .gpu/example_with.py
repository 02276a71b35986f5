"""The one-GPU example test with extra overrides (argv), metrics copied to $OUT/metrics-<tag>.jsonl."""

import os
import pathlib
import shutil
import sys

import tests.gpu.test_examples_gpu as t

orig = t.reroll_cli
t.reroll_cli = lambda *a, **k: orig(*a, *sys.argv[1:], **k)
tmp = pathlib.Path("/tmp/pw")
shutil.rmtree(tmp, ignore_errors=True)
tmp.mkdir()
t.test_the_one_gpu_example_starts_trains_and_checkpoints(tmp)
for f in tmp.rglob("metrics.jsonl"):
    shutil.copy(f, pathlib.Path(os.environ["OUT"]) / "metrics-with.jsonl")
print("done")
