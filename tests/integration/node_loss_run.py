"""For test_node_loss, in a fresh interpreter (Ray's token authentication is set once a process, and the
nodes this starts must agree with it): a simulated cluster (``ray.cluster_utils.Cluster``, CPU only) of
a head with 2 CPUs and ``workers`` nodes with 1 CPU and one 'worker' resource each, the RLVR run of
CONFIG joined to it, and the node holding the pool's bundle removed as step 2 begins. Writes OUT (JSON):
the metrics, the nodes that held the bundle before and after, and the error the run stopped with.

    python -m tests.integration.node_loss_run CONFIG WORKERS OUT
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any


def _pool_node(name: str) -> str:
    """The id of the node that holds the run's pool bundle."""
    from ray.util import get_placement_group, placement_group_table

    table = placement_group_table(get_placement_group(f"reroll-{name}-pool"))
    [node] = set(table["bundles_to_node_id"].values())
    return node


def main(config: str, workers: int, out: str) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from reroll.config.loader import load_config
    from reroll.config.schema import RunConfig
    from reroll.errors import UserError
    from reroll.pipelines import run as run_module
    from reroll.pipelines.rlvr import RLVR
    from reroll.runtime.metrics import read_metrics

    logging.basicConfig(level=logging.WARNING)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    result: dict[str, Any] = {}
    try:
        for _ in range(workers):
            cluster.add_node(num_cpus=1, resources={"worker": 1})
        cluster.wait_for_nodes()
        cfg = load_config(Path(config), RunConfig, [f"runtime.ray_address={cluster.address}"])
        real_step = RLVR.step

        def step(self, roles, step):
            if step == 2 and "lost" not in result:
                result["lost"] = _pool_node(cfg.name)
                [node] = [n for n in cluster.list_all_nodes() if n.node_id == result["lost"]]
                cluster.remove_node(node)
            metrics = real_step(self, roles, step)
            result["now"] = _pool_node(cfg.name)
            return metrics

        RLVR.step = step  # type: ignore[method-assign]
        try:
            run_module.run(RLVR, cfg)
        except UserError as e:
            result["error"] = str(e)
        result["metrics"] = read_metrics(cfg.run_dir) if (cfg.run_dir / "metrics.jsonl").exists() else []
    finally:
        Path(out).write_text(json.dumps(result))
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
