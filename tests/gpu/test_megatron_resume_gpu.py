"""A Megatron checkpoint resumed at another layout on GPUs: NCCL, and Transformer Engine's fused Adam
(its step count kept per parameter group) and fused norms where installed. The CPU tests over gloo
(``tests/integration/test_megatron_resume.py``) check the same with torch's Adam.

Run with ``python -m pytest -q tests/gpu/test_megatron_resume_gpu.py`` (the TP=2 test needs two GPUs).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from tests.conftest import write_config
from tests.integration.megatron_cpu import free_address
from tests.integration.test_megatron_resume import (
    LR,
    check_loaded,
    check_step,
    optimizer_state_in_hf_names,
    train_step,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("megatron") is None,
        reason="needs a CUDA device and megatron-core (pip install 'reroll[megatron]')",
    ),
]


def _strategy(cfg_path: str, *sizes: str, rank: int = 0, world_size: int = 1, address: str | None = None):
    from reroll.strategies.megatron import MegatronStrategy

    torch.cuda.set_device(rank)
    cfg = load_config(cfg_path, RunConfig, ["strategy.name=megatron", *sizes])
    s = MegatronStrategy(cfg.model.path, cfg=cfg, device=f"cuda:{rank}", rank=rank, world_size=world_size)
    if address is not None:
        s.init_distributed(address)
    s.configure_optimizer(lr=LR, betas=(0.9, 0.99), weight_decay=0.1, warmup_steps=3)
    return s


def _config(tmp_path: Path, assets) -> str:
    model = {"path": str(assets["model"]), "dtype": "bfloat16"}
    return str(write_config(tmp_path / "c.yaml", assets, model=model))


def _check(saved: dict, loaded: dict, after: tuple[dict, dict]) -> None:
    """As the CPU tests: the state read back bit for bit, the next step within the Adam bound."""
    check_loaded(saved, loaded)
    check_step(*after)


def test_one_gpu_resumes_with_the_distributed_optimizer_turned_on(tmp_path, assets):
    """Saved without the distributed optimizer after two steps, loaded into one (flat ranges of its
    buffers), then one more step each."""
    cfg = _config(tmp_path, assets)
    plain = _strategy(cfg, "strategy.megatron.distributed_optimizer=false")
    for _ in range(2):
        train_step(plain, 0, 1)
    plain.save(tmp_path / "ck", with_optimizer=True)
    saved = optimizer_state_in_hf_names(plain)
    train_step(plain, 0, 1)
    sharded = _strategy(cfg)
    sharded.load(tmp_path / "ck")
    loaded = optimizer_state_in_hf_names(sharded)
    train_step(sharded, 0, 1)
    _check(saved, loaded, (optimizer_state_in_hf_names(plain), optimizer_state_in_hf_names(sharded)))


def _tp2_save(rank: int, address: str, cfg_path: str, out: str) -> None:
    s = _strategy(cfg_path, "strategy.megatron.tensor_parallel=2", rank=rank, world_size=2, address=address)
    for _ in range(2):
        train_step(s, rank, 2)
    s.save(Path(out) / "ck", with_optimizer=True)
    saved = optimizer_state_in_hf_names(s)
    train_step(s, rank, 2)
    torch.save({"saved": saved, "after": optimizer_state_in_hf_names(s)}, f"{out}/rank{rank}.pt")


def _one_resume(rank: int, address: str, cfg_path: str, out: str) -> None:
    s = _strategy(cfg_path, rank=0, world_size=1)
    s.load(Path(out) / "ck")
    loaded = optimizer_state_in_hf_names(s)
    train_step(s, 0, 1)
    torch.save({"loaded": loaded, "after": optimizer_state_in_hf_names(s)}, f"{out}/resumed.pt")


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP=2 needs two GPUs")
def test_tp2_checkpoint_resumes_on_one_gpu(tmp_path, assets):
    """Saved by TP=2 over NCCL after two steps, resumed by one rank (in a process of its own)."""
    import torch.multiprocessing as mp

    cfg = _config(tmp_path, assets)
    mp.start_processes(_tp2_save, args=(free_address(), cfg, str(tmp_path)), nprocs=2, start_method="spawn")
    mp.start_processes(_one_resume, args=(free_address(), cfg, str(tmp_path)), nprocs=1, start_method="spawn")
    saved = torch.load(tmp_path / "rank0.pt", weights_only=False)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    _check(saved["saved"], resumed["loaded"], (saved["after"], resumed["after"]))
