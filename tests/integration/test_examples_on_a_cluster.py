"""Every per-size example on paper, on a simulated cluster: eight Ray nodes on this machine that each
declare 8 GPUs and 64 CPUs (``ray.cluster_utils.Cluster``; 64 GPUs, what the largest example names).
With this process connected to it, as ``reroll train`` is to the cluster it joins, each example goes
through the three checks a run meets before any worker starts:

- ``reroll validate`` (``check_inputs``): the cluster's resources hold the pool and the roles, and the
  start checks with the device type the cluster gives (cuda);
- ``reroll plan`` on the example's stated GPUs: it fits, and it prints per-GPU memory per phase;
- the run's start (``ResourceManager``): the pool reserved as one placement group, packed onto as few
  nodes of 8 GPUs as hold it.

An example this version refuses is refused by all three with the same reasons, and its header says so
(as ``tests/unit/test_examples.py``, the CI sibling, checks against a simulated machine). What this
cannot show: that the workers then start on those GPUs (the multi-GPU kit, ``tests/multigpu``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.unit.test_examples import SIZED, _hardware

pytestmark = pytest.mark.integration

NODES, GPUS_PER_NODE = 8, 8

SCRIPT = r"""
import json, sys
from unittest import mock

import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.errors import UserError
from reroll.pipelines import preflight
from reroll.plan import plan
from reroll.runtime.placement import ResourceManager

nodes, per_node, rows, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
examples = json.loads(sys.argv[5])
cluster = Cluster(
    initialize_head=True, head_node_args={"num_cpus": 64, "num_gpus": per_node, "include_dashboard": False}
)
for _ in range(nodes - 1):
    cluster.add_node(num_cpus=64, num_gpus=per_node)
ray.init(address=cluster.address, logging_level="ERROR")
cluster.wait_for_nodes()
found = {"gpus": ray.cluster_resources().get("GPU", 0), "examples": {}}
for path, gpus, memory in examples:
    args = [f"data.train_files=[{rows}]", f"data.eval_files=[{rows}]", f"output_dir={out_dir}/run"]
    cfg = load_config(path, RunConfig, args)
    with mock.patch.object(preflight, "package_problems", lambda cfg, **kw: []):  # vLLM is not installed here
        problems = [f"{p.path}: {p.message}" for p in preflight.check_inputs(cfg)]
    report, fits = plan(cfg, gpus=gpus, gpu_memory_gib=memory)
    try:
        manager = ResourceManager(cfg)
    except UserError as e:
        start = {"refused": str(e).splitlines()}
    else:
        table = placement_group_table(manager.pg) if manager.pg is not None else {}
        spread = set(table.get("bundles_to_node_id", {}).values())
        start = {"bundles": len(table.get("bundles", {})), "nodes": len(spread), "device": manager.device_type}
        manager.shutdown()
    found["examples"][path] = {"problems": problems, "report": report, "fits": fits, "start": start}
print("RESULT " + json.dumps(found))
ray.shutdown()
cluster.shutdown()
"""


@pytest.mark.long  # eight Ray nodes on 2 cores: about a minute to start; the CI sibling is test_examples.py
def test_every_sized_example_passes_validate_plan_and_reserves_its_pool_on_a_64_gpu_cluster(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "1+1?", "answer": "2"}\n')
    examples = [(str(p), *_hardware(p)) for p in SIZED]
    cluster = [str(NODES), str(GPUS_PER_NODE), str(rows), str(tmp_path), json.dumps(examples)]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, *cluster],
        capture_output=True,
        text=True,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert found["gpus"] == NODES * GPUS_PER_NODE
    assert len(found["examples"]) == len(SIZED) >= 6
    for path, gpus, _ in examples:
        got = found["examples"][path]
        name, report = os.path.basename(os.path.dirname(path)), got["report"]
        refused = [line.strip() for line in report.partition("\ncannot start:")[2].splitlines()[1:]]
        assert sorted(refused) == sorted(got["problems"]), (name, report)
        if got["problems"]:  # refused by all three, and the example says so
            assert not got["fits"] and sorted(got["start"]["refused"]) == sorted(got["problems"]), name
            assert "DOES NOT START WITH THIS VERSION" in Path(path).read_text(), name
            continue
        assert got["fits"], (name, report)
        pool = int(report.split(" GPUs in the pool")[0].rsplit("\n", 1)[1])
        assert pool <= gpus
        # the start reserved one GPU bundle per pool device, packed onto the fewest nodes of 8 GPUs
        assert got["start"] == {"bundles": pool, "nodes": math.ceil(pool / GPUS_PER_NODE), "device": "cuda"}
        phases = report.partition("per GPU, per phase")[2].split("\n\n")[0].splitlines()[1:]
        assert any(line.lstrip().startswith("generate ") for line in phases), (name, report)
        assert any(line.lstrip().startswith("train, old log-probs ") for line in phases), (name, report)
        assert all(" GiB on gpu" in line for line in phases), (name, phases)
