"""Kit (e): the 3B and 7B examples (``examples/qwen2.5-3b-rlvr_fsdp2``, ``qwen2.5-7b-rlvr_fsdp2``) run
3 GRPO steps through ``reroll train`` on the GPUs present, as shipped (fsdp2 over every GPU with
activation checkpointing and bf16 compute, vLLM colocated with sleep mode and CUDA graphs, the
reference on the same GPUs, math_verify rewards, chat template), with what cannot be had offline or in
minutes replaced: the model is a random-init one of the family's shape (``tests/multigpu/shaped.py``),
the data are local arithmetic rows, and a step is smaller (``SMALLER``: 128 responses of up to 512
tokens, 32 held-out rows).

The pool is the example's GPU count or the GPUs present if fewer (at least 2); a run that ``reroll
plan`` says does not fit them is skipped with the plan's verdict (the 7B on 2 GPUs of 80 GiB, say).
Asserted: steps 0-3 logged, every step generated and synced, the final checkpoint written with the
shape's layer count. Measured: seconds a step (steps 2 and 3; step 1 also measures memory and warms
up), GPUs used.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

from tests.conftest import ROOT
from tests.multigpu.kit import gpu_count, needs_gpus

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm"),
    pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="needs math-verify"),
]

EXAMPLES = {"qwen2.5-3b-rlvr_fsdp2": "qwen2.5-3b", "qwen2.5-7b-rlvr_fsdp2": "qwen2.5-7b"}
SMALLER = ["rollout.batch_size=128", "rollout.max_new_tokens=512", "data.eval_limit=32", "total_steps=3"]
SMALLER += ["eval.every=0", "checkpoint.every=0"]


def _pool(example: str) -> tuple[int, list[str]]:
    """The GPUs the run takes and the overrides that put every model role on them."""
    wanted = int(
        re.search(r"# hardware: (\d+)x", (ROOT / "examples" / example / "config.yaml").read_text())[1]
    )
    n = min(wanted, gpu_count())
    roles = ("actor_train", "actor_infer", "reference")
    return n, [f"placement.devices={n}", *(f"roles.{r}.world_size={n}" for r in roles)]


@pytest.mark.parametrize("example", [pytest.param(e, marks=needs_gpus(2)) for e in EXAMPLES])
def test_the_example_runs_three_steps_on_the_gpus_present(example, tmp_path, kit_record):
    import torch
    from transformers import AutoConfig

    from reroll.config.loader import load_config
    from reroll.config.schema import RunConfig
    from reroll.data.arithmetic import write_arithmetic_dataset
    from reroll.plan import plan
    from reroll.runtime.metrics import read_metrics
    from tests.conftest import reroll_cli
    from tests.multigpu.shaped import build_shaped

    config = ROOT / "examples" / example / "config.yaml"
    data = write_arithmetic_dataset(
        tmp_path / "data", n_train=600, n_test=64, max_operand=99, ops="+", seed=0
    )
    gpus, pool = _pool(example)
    files = [f"data.train_files=[{data['train']}]", f"data.eval_files=[{data['test']}]"]
    overrides = [*files, f"output_dir={tmp_path}/{{name}}", *pool, *SMALLER]
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30
    report, fits = plan(load_config(config, RunConfig, overrides), gpus=gpus, gpu_memory_gib=memory)
    if not fits:  # the example's model name gives the plan its shape (reroll.config.memory.KNOWN)
        pytest.skip(f"reroll plan: {example} does not fit {gpus} GPUs of {memory:.0f} GiB:\n{report}")

    model = build_shaped(tmp_path / "model", EXAMPLES[example])
    out = reroll_cli("train", config, f"model.path={model}", *overrides, timeout=1800)
    assert out.returncode == 0, out.stderr[-4000:]
    run = tmp_path / example
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["rollout/response_length"] > 0 and r.get("sync/bytes", 0) > 0 for r in rows[1:])
    [ckpt] = sorted((run / "checkpoints").glob("step_*"))
    layers = AutoConfig.from_pretrained(ckpt / "model").num_hidden_layers
    assert layers == AutoConfig.from_pretrained(model).num_hidden_layers
    kit_record("s/step (steps 2-3)", sum(r["timing/step"] for r in rows[2:]) / 2, "s")
    kit_record("GPUs used", gpus)
