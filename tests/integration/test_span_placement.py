"""An engine rank spanning pool devices on a Ray cluster that declares GPUs (this CPU machine, 4 GPUs
declared): each engine's Ray actor sits on its first device and its process is shown the GPUs of all
of its devices, in order, the ones the trainer ranks on those devices are given. What this cannot
show: that vLLM then runs its tensor-parallel workers on those GPUs (a machine with several GPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = r"""
import json, os, sys
import ray
from ray.util.placement_group import placement_group
from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.runtime.placement import _pg_name, actor_options

cfg = load_config(sys.argv[1], RunConfig, sys.argv[2:])
ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, logging_level="ERROR")
pg = placement_group([{"GPU": 1.0, "CPU": 1.0}] * 4, strategy="PACK", name=_pg_name(cfg))
assert pg.wait(60)

@ray.remote
class Probe:
    def seen(self):
        return os.environ.get("CUDA_VISIBLE_DEVICES")

out = {}
for role in ("actor_train", "actor_infer"):
    for rank in range(getattr(cfg.roles, role).world_size):
        options = actor_options(cfg, role, rank)
        actor = Probe.options(**options).remote()
        bundle = options["scheduling_strategy"].placement_group_bundle_index
        out[f"{role}[{rank}]"] = ray.get(actor.seen.remote(), timeout=60), [bundle]
        ray.kill(actor)
print(json.dumps(out))
"""


@pytest.mark.long  # a Ray cluster declaring 4 GPUs and two engines: ~35 s, kept out of CI for its length
def test_each_engine_sees_the_gpus_of_its_pool_devices_in_order(tmp_path, assets):
    from tests.conftest import write_config

    path = write_config(tmp_path / "c.yaml", assets)
    overrides = [
        "placement.devices=4",
        "placement.device_type=cuda",
        "roles.actor_train.world_size=4",
        "roles.actor_infer.world_size=2",
        "rollout.engine=vllm",
        "rollout.vllm.tensor_parallel_size=2",
        "rollout.vllm.in_process=false",
    ]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), *overrides],
        capture_output=True,
        text=True,
        env=os.environ | {"PYTHONPATH": str(Path(__file__).parents[2])},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # each trainer rank sits on its own bundle (pool device r), and Ray shows it that bundle's GPU
    trainers = [seen[f"actor_train[{r}]"] for r in range(4)]
    assert [bundles for _, bundles in trainers] == [[0], [1], [2], [3]]
    gpu = [visible for visible, _ in trainers]
    assert len(set(gpu)) == 4 and all("," not in g for g in gpu)
    # engine i: its actor holds a share of device 2i, its process sees devices 2i and 2i+1's GPUs
    for i in range(2):
        visible, bundles = seen[f"actor_infer[{i}]"]
        assert bundles == [2 * i]  # the actor sits on the first device of its span
        assert visible == f"{gpu[2 * i]},{gpu[2 * i + 1]}"  # and left CUDA_VISIBLE_DEVICES to us
