"""Recovery on the GPU path: the quickstart's run with a vLLM engine colocated on one GPU, the engine's
actor killed as step 2 begins (after step 1 trained). The run finishes every step; the engine is a new
actor, the other roles keep theirs, and the new engine holds the trainer's weights: every step after the
restart generates with the trainer's version, and its log-probs are the trainer's (the tolerance of
test_vllm_gpu's sync check; a stale engine, holding model.path's weights rather than the warm start's,
misses it by far). Skipped without CUDA or vLLM. NOT YET RUN ON A GPU: written for the lead's run,
``python -m pytest -q tests/gpu/test_engine_recovery_gpu.py`` (aimed at under 90 s). Its mechanics ran
on CPU with the hf engine in place of COLOCATED (passed, 169 s on 2 shared cores)."""

from __future__ import annotations

import pytest
import torch

from reroll.engines import engine_available
from tests.conftest import QUICKSTART, quickstart_overrides

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STEPS = 4
COLOCATED = [  # test_vllm_gpu's: every role on GPU 0, weights over CUDA IPC
    "placement.devices=1",
    "placement.device_type=cuda",
    "model.dtype=bfloat16",
    "strategy.name=fsdp2",
]
ENGINES = {  # the engine's own settings; hf: the same path where vLLM is not installed
    "vllm": [
        "rollout.engine=vllm",
        "rollout.vllm.gpu_memory_utilization=0.3",
        "rollout.vllm.max_model_len=64",
    ],
    "hf": ["rollout.engine=hf"],
}


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param("vllm", marks=pytest.mark.skipif(not engine_available("vllm"), reason="needs vllm")),
        "hf",
    ],
)
def test_a_killed_engine_is_recreated_with_the_trainers_weights_and_the_run_finishes(
    tmp_path, monkeypatch, engine
):
    import ray

    from reroll.config.loader import load_config
    from reroll.config.schema import RunConfig
    from reroll.pipelines import run as run_module
    from reroll.pipelines.rlvr import RLVR
    from reroll.runtime.metrics import read_metrics

    overrides = [
        *quickstart_overrides(tmp_path, total_steps=STEPS),
        *COLOCATED,
        *ENGINES[engine],
        "sft.steps=100",  # a warm start: weights a stale engine would not hold
        "rollout.batch_size=128",
        "optim.micro_batch_size=128",
        "rollout.logprobs=true",  # mismatch/*: the engine's log-probs against the trainer's
        "runtime.max_restarts=1",
    ]
    cfg = load_config(QUICKSTART, RunConfig, overrides)
    seen: list[dict] = []
    real_step = RLVR.step

    def step(self, roles, step):
        ids = {name: [h._actor_id.hex() for h in g._handles] for name, g in roles.groups.items()}
        versions = (roles.actor_infer.weights_version, roles.actor_train.weights_version)
        seen.append({"step": step, "ids": ids, "versions": versions})
        if step == 2 and len(seen) == 2:  # its first attempt: step 1 has trained
            ray.kill(roles.actor_infer._handles[0], no_restart=True)
        return real_step(self, roles, step)

    monkeypatch.setattr(RLVR, "step", step)
    run_module.run(RLVR, cfg)

    metrics = read_metrics(cfg.run_dir)
    assert [m["step"] for m in metrics] == list(range(STEPS + 1))  # step 2 retried, logged once
    assert metrics[-1]["recovery/restarts"] == 1
    assert [s["step"] for s in seen] == [1, 2, 2, 3, 4]
    killed, retried = seen[1]["ids"], seen[2]["ids"]
    assert retried["actor_infer"] != killed["actor_infer"]  # a new engine
    for role in set(killed) - {"actor_infer"}:
        assert retried[role] == killed[role] == seen[-1]["ids"][role], role  # the others' actors kept
    # every attempt generated with the trainer's weights: the new engine got them before the retry
    assert all(engine == trainer for s in seen for engine, trainer in [s["versions"]]), seen
    for m in metrics[1:]:
        assert "mismatch/logprob_abs_mean" in m, sorted(m)  # the check below ran
        # bf16 on both sides, the engine's kernels differing from the trainer's (test_vllm_gpu's bound)
        assert m["mismatch/logprob_abs_mean"] < 0.02 and m["mismatch/logprob_abs_max"] < 0.25, m
    assert metrics[-1]["eval/accuracy"] >= metrics[0]["eval/accuracy"] - 0.05  # no stale engine at eval
