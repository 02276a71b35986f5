"""Shared fixtures: a tiny model and the arithmetic data, built once per test session, offline."""

from __future__ import annotations

import getpass
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

if TYPE_CHECKING:
    from reroll.config.schema import RunConfig

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart" / "arithmetic_grpo.yaml"
# what switches the CPU kernels torch runs (tests/integration/test_cpu_kernels.py)
KERNEL_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS")

if "ATEN_CPU_CAPABILITY" in os.environ and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    # torch.compile's kernel cache is not keyed by ATEN_CPU_CAPABILITY: under another setting it reused
    # kernels built for the last (measured with torch 2.13: a C++ build error at 'default', NaN losses at
    # 'avx2'). One cache per setting; the variable reaches the Ray workers and CLI runs the tests start.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(
        Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}_{os.environ['ATEN_CPU_CAPABILITY']}"
    )


def pytest_report_header(config) -> str:
    """The CPU kernels this run uses: the equality tests' sums depend on them."""
    import torch

    switched = " ".join(f"{k}={os.environ[k]}" for k in KERNEL_VARS if k in os.environ)
    return f"cpu kernels: torch {torch.backends.cpu.get_cpu_capability()}" + (
        f" ({switched})" if switched else ""
    )


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict[str, Path]:
    """A tiny arithmetic model (hidden 64, head dim 32) and train/test JSONL."""
    from reroll.data.arithmetic import ARITHMETIC_ALPHABET, write_arithmetic_dataset
    from reroll.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("assets")
    model = build_tiny_model(
        root / "model", alphabet=ARITHMETIC_ALPHABET, hidden_size=64, num_layers=2, num_heads=2
    )
    data = write_arithmetic_dataset(root / "data", n_train=400, n_test=64, max_operand=30, ops="+", seed=0)
    return {"model": Path(model), "train": Path(data["train"]), "test": Path(data["test"])}


@pytest.fixture
def kit_record(request):
    """``kit_record(name, value, unit="")``: a number a multi-GPU kit test measured, for the kit's table
    (``python -m tests.multigpu``; tests/multigpu/kit.py)."""
    from tests.multigpu.kit import recorder

    return recorder(request.node.nodeid)


def step_metrics(run_dir: Path, step: int) -> dict[str, float]:
    """A step's metrics without the measured ones (times, speeds, memory), which differ run to run, and
    the weight sync's (``sync/*``): the run syncs the engine before a step that finds it stale, which
    the first step of a resumed run does not (its start synced the checkpoint's weights)."""
    from reroll.runtime.metrics import read_metrics

    [row] = [m for m in read_metrics(run_dir) if m["step"] == step]
    measured = ("timing/", "engine/", "sync/")
    return {
        k: v
        for k, v in row.items()
        if not k.startswith(measured) and not k.endswith(("tokens_per_s", "gb_per_s", "peak_memory_gb"))
    }


def reroll_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``reroll ARGS`` in a fresh interpreter (its own Ray cluster), output captured as text: for what
    only a fresh process shows (what third-party imports print, signals, the exit of the interpreter, a
    cluster of its own). Otherwise ``reroll_here``, which spares the 5-20 s of a fresh interpreter's
    imports and Ray start on 2 cores."""
    return subprocess.run(
        [sys.executable, "-m", "reroll.cli", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


def reroll_here(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``reroll ARGS`` through the command's ``main`` in this process, as ``reroll_cli`` reports it:
    the exit code and what the command wrote to stdout and stderr (its messages, log lines and
    progress), as text. A run on Ray joins this process's cluster (``start_ray``: one per test session),
    its roles Ray actors as in a fresh process; an error ``main`` does not turn into an exit code
    fails the test with its traceback, and so does a command still running after ``timeout`` seconds
    (``reroll_cli``'s bound on a hang: a ``TimeoutError`` raised in it, so its roles shut down)."""
    import contextlib
    import io
    import signal

    from reroll.cli import main

    def hung(signum: int, frame: object) -> None:
        raise TimeoutError(f"reroll {' '.join(map(str, args))} still running after {timeout} s")

    out, err = io.StringIO(), io.StringIO()
    before = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in args])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    return subprocess.CompletedProcess(["reroll", *map(str, args)], code, out.getvalue(), err.getvalue())


def quickstart_overrides(tmp_path: Path, total_steps: int) -> list[str]:
    """``reroll train QUICKSTART`` overrides for a run under ``tmp_path``: the quickstart builds its tiny
    model and data in ``tmp_path/assets``, writes the run to ``tmp_path/quickstart`` and runs
    ``total_steps`` GRPO steps with only the step-0 and final evaluations and no checkpoint but the last."""
    assets = tmp_path / "assets"
    return [
        f"output_dir={tmp_path}/{{name}}",
        f"model.path={assets}/tiny-arithmetic",
        f"data.train_files=[{assets}/arithmetic/train.jsonl]",
        f"data.eval_files=[{assets}/arithmetic/test.jsonl]",
        f"total_steps={total_steps}",
        "eval.every=0",
        "checkpoint.every=0",
    ]


def write_config(path: Path, assets: dict[str, Path], **sections) -> Path:
    """A small RLVR config over the session's assets; keyword sections replace the defaults' keys."""
    cfg = {
        "pipeline": "rlvr",
        "name": "t",
        "output_dir": str(path.parent / "runs" / "{name}"),
        "total_steps": 2,
        "model": {"path": str(assets["model"])},
        "data": {
            "train_files": [str(assets["train"])],
            "eval_files": [str(assets["test"])],
            "prompt_template": "{question}=",
            "eval_limit": 16,
        },
        "rollout": {"batch_size": 16, "group_size": 4, "max_new_tokens": 4},
        "optim": {"lr": 1e-3, "micro_batch_size": 16},
        "roles": {r: {"torch_threads": 1} for r in ("actor_train", "actor_infer", "reference", "reward")},
        "logging": {"tensorboard": False},
    }
    cfg = merge_sections(cfg, sections)
    if cfg["pipeline"] == "sft" and "total_steps" not in sections:
        del cfg["total_steps"]  # an SFT run takes sft.steps steps (a total_steps there is an error)
    path.write_text(yaml.safe_dump(cfg))
    return path


def small_config(tmp_path: Path, *overrides: str, model: str | None = None) -> RunConfig:
    """The smallest RLVR config a placement or start check reads (nothing is built or loaded), with
    dotted ``overrides``; ``model.path`` is ``tmp_path`` unless ``model`` names another."""
    from reroll.config.loader import load_config
    from reroll.config.schema import RunConfig

    base = {
        "pipeline": "rlvr",
        "model": {"path": model or str(tmp_path)},
        "data": {"train_files": ["x.jsonl"]},
        "rollout": {"batch_size": 8, "group_size": 4},
        "algorithm": {"kl_coef": 0.1},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(base))
    return load_config(path, RunConfig, list(overrides))


def engine_samples_scored(roles, samples, tokenizer, max_new_tokens: int, *, stale_ok: bool = False):
    """The engine's samples of ``samples``' prompts (2 each, seed 1) as a train batch, and the trainer's
    log-probs of them: what the sync checks compare (``batch.rollout_logprobs`` against the trainer's on
    ``batch.response_mask``). ``stale_ok``: generate on weights older than the trainer's (the check before
    a sync)."""
    from reroll.data.types import Rollout, SamplingParams, build_train_batch

    params = SamplingParams(n=2, max_new_tokens=max_new_tokens, seed=1)
    with roles.phase("generate", "actor_infer"):
        groups = roles.actor_infer.generate([s.prompt for s in samples], params, stale_ok=stale_ok)
    rollouts = [Rollout(s, i, c) for i, (s, cs) in enumerate(zip(samples, groups)) for c in cs]
    batch = build_train_batch(rollouts, tokenizer.pad_token_id)
    with roles.phase("logprobs", "actor_train"):
        return batch, roles.actor_train.compute_logprobs(batch)


def merge_sections(cfg: dict, sections: dict) -> dict:
    """``cfg`` with ``sections`` over it: a section given as a dict replaces only the keys it names."""
    out = dict(cfg)
    for key, value in sections.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = {**out[key], **value} if both else value
    return out


def load_sections(tmp_path: Path, cfg: dict, sections: dict) -> RunConfig:
    """The ``RunConfig`` of ``cfg`` with ``sections`` merged over it (``merge_sections``), through a YAML
    file in ``tmp_path`` as a user's run reads it."""
    from reroll.config.loader import load_config
    from reroll.config.schema import RunConfig

    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(merge_sections(cfg, sections)))
    return load_config(path, RunConfig, [])


def assert_kill_mid_generation_is_reported(rollout) -> None:
    """Kill actor_infer rank 0 one second into a long generate: the driver gets a RoleError within 60 s."""
    import threading
    import time

    import ray

    from reroll.data.types import SamplingParams
    from reroll.errors import RoleError

    rollout.generate(["1+1="], SamplingParams(n=1, max_new_tokens=2))  # the engine is up
    killer = threading.Timer(1.0, lambda: ray.kill(rollout.handles[0]))
    killer.start()
    start = time.monotonic()
    with pytest.raises(RoleError) as e:
        # long enough that the kill lands mid-call: 2000 prompts x 16 samples
        rollout.generate(["1+1="] * 2000, SamplingParams(n=16, max_new_tokens=64))
    assert time.monotonic() - start < 60
    assert f"actor_infer[0] ({rollout.detail}) failed during generate" in str(e.value)  # names the engine
    assert rollout.detail.endswith(" engine")
    assert "died" in str(e.value)


def assert_stream_yields_groups_then_interrupt_cuts_the_rest(rollout, *, prompts: int) -> list[int]:
    """``rollout.stream``: every prompt's group once, each of n completions; an ``interrupt`` after the
    first group makes the rest come back as they stand (some ``abort``). Returns the arrival order."""
    from reroll.data.types import SamplingParams

    order, cut = [], 0
    for i, group in rollout.stream(["1+2="] * prompts, SamplingParams(n=2, max_new_tokens=48, seed=5)):
        if not order:
            rollout.interrupt()
        order.append(i)
        assert len(group) == 2
        cut += sum(c.finish_reason == "abort" for c in group)
    assert sorted(order) == list(range(prompts))
    assert cut > 0
    return order


def assert_interrupted_responses_resume(rollout, *, prompts: int, after_s: float) -> None:
    """``interrupt`` ``after_s`` after the engine starts decoding: the responses it cut (``abort``,
    their tokens kept) are continued by ``submit_resume`` from those tokens up to ``max_new_tokens`` in
    all; the finished ones are left as they were.

    The start is read off the engine's ``engine/num_running`` (polled on its control thread), not timed
    from the submit: on a loaded machine an interrupt timed from the submit once landed before any
    response had a token (only unstarted ones cut). The interrupt is sent again every 0.2 s until the
    generation returns: an engine call clears an interrupt that reached it before the call began."""
    import threading

    from reroll.data.types import SamplingParams

    params = SamplingParams(n=2, max_new_tokens=48, seed=7)
    returned = threading.Event()

    def keep_interrupting() -> None:
        rollout.metrics(now=True)  # start over: the peaks since the last look
        while rollout.metrics(now=True)["engine/num_running"] == 0:
            if returned.wait(0.05):
                return
        if not returned.wait(after_s):
            rollout.interrupt()
            while not returned.wait(0.2):
                rollout.interrupt()

    sender = threading.Thread(target=keep_interrupting)
    sender.start()
    refs = rollout.submit(["1+1="] * prompts, params)
    try:
        first = rollout.collect(refs)
    finally:
        returned.set()
        sender.join()
    done = rollout.collect(rollout.submit_resume(refs, params))
    pairs = [(a, b) for ga, gb in zip(first, done) for a, b in zip(ga, gb)]
    cut = [(a, b) for a, b in pairs if a.finish_reason == "abort"]
    assert cut, "the interrupt landed after the generation ended: raise prompts"
    assert any(a.response_ids for a, _ in cut)  # cut in the middle of a response, not only unstarted
    for a, b in pairs:
        if a.finish_reason != "abort":
            assert b == a
            continue
        assert b.response_ids[: len(a.response_ids)] == a.response_ids
        assert b.logprobs[: len(a.logprobs)] == a.logprobs and len(b.logprobs) == len(b.response_ids)
        assert b.prompt_ids == a.prompt_ids and len(b.response_ids) <= 48
        assert b.finish_reason == "stop" or (b.finish_reason == "length" and len(b.response_ids) == 48)
