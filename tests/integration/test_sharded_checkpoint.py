"""Checkpoints written by every rank (torch's distributed checkpoint, ``state/``) resume at another world
size: saved by 2 FSDP2 ranks, loaded by 1 and by 4, the state they hold is the saved one exactly and
their next step is the one the 2 ranks took; the checkpoint's ``model/``, written in parts by the ranks,
loads with ``from_pretrained`` and holds the trained weights exactly.

Exactly: a load copies bytes, so a rank count that reads the checkpoint and writes it again must write
what it read, weights, Adam's moments and step counts, and the schedule. The next step is compared by
what it computes from the loaded weights alone, its loss and gradient norm, which differ only by the
float summation order of other splits over ranks and micro-batches (~1e-7 relative; 1e-5, as in
test_data_parallel.py), not by Adam's next weights: Adam divides by sqrt(v), so an element whose
gradient is ~0 can take a step of up to lr apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.data.datasets import load_samples
from reroll.models.loading import load_tokenizer
from reroll.pipelines.common import sft_batch
from reroll.roles.objectives import NextToken
from reroll.roles.trainer import TrainerGroup
from reroll.runtime.actors import start_ray
from reroll.strategies import strategy_available
from tests.conftest import write_config

pytestmark = pytest.mark.integration

LR = 1e-2


@pytest.fixture(scope="module")
def batch(assets):
    samples = load_samples([str(assets["train"])], template="{question}=")[:8]
    return sft_batch(samples, load_tokenizer(str(assets["model"])), "{answer}")


def _group(path: Path, world_size: int, strategy: str, *more: str) -> TrainerGroup:
    """actor_train on ``world_size`` ranks (one: in this process), its optimizer configured."""
    overrides = [f"roles.actor_train.world_size={world_size}", f"strategy.name={strategy}", *more]
    if world_size == 1:
        overrides.append("runtime.backend=local")
    group = TrainerGroup("actor_train", load_config(path, RunConfig, overrides), trainable=True)
    group.configure_optimizer(LR, 2)  # a warm-up, so the schedule's position matters too
    return group


def _state(checkpoint: Path) -> dict:
    """Everything ``state/`` holds, as whole tensors (read in this process, whatever wrote it)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint / "state", checkpoint / "state.pt")
    return torch.load(checkpoint / "state.pt", weights_only=False)


def _assert_equal(a, b, where: str = "") -> None:
    """The same nested dicts and lists, tensors bit for bit."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def _exported(checkpoint: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint / "model").state_dict()


@dataclass
class Saved:
    """A checkpoint 2 FSDP2 ranks wrote after one step, their weights then, and the step they took next."""

    path: Path
    weights: dict[str, torch.Tensor]
    next_step: dict[str, float]


@pytest.fixture(scope="module")
def saved_by_2(tmp_path_factory, assets, batch) -> Saved:
    root = tmp_path_factory.mktemp("saved")
    path = write_config(root / "c.yaml", assets, optim={"lr": LR, "micro_batch_size": 4})
    start_ray(None)
    two = _group(path, 2, "fsdp2")
    try:
        two.train(batch, NextToken())
        two.save(root / "step_1")
        weights = two.weight_buckets(1.0).tensors()
        next_step = two.train(batch, NextToken())  # the step a run that never stopped takes next
    finally:
        two.shutdown()
    return Saved(root / "step_1", weights, next_step)


def _resumes_exactly(saved: Saved, tmp_path: Path, assets, world_size: int, strategy: str, batch) -> None:
    """``world_size`` ranks of ``strategy`` load ``saved``, write it back and take the next step: what they
    wrote is what they read, bit for bit, and their step is the 2 ranks' one."""
    path = write_config(tmp_path / "c.yaml", assets, optim={"lr": LR, "micro_batch_size": 4})
    again = tmp_path / "again"
    group = _group(path, world_size, strategy)
    try:
        group.load(saved.path)
        group.save(again)  # what it loaded, written back
        step = group.train(batch, NextToken())
    finally:
        group.shutdown()
    state = _state(saved.path)
    assert float(state["optimizer"]["state"]["model.norm.weight"]["step"]) == 1  # one step's moments
    assert state["scheduler"]["last_epoch"] == 1
    _assert_equal(_state(again), state)
    written, exported = _exported(again), _exported(saved.path)
    assert written.keys() == exported.keys()
    assert all(torch.equal(w, exported[n]) for n, w in written.items())
    assert step["sft/loss"] == pytest.approx(saved.next_step["sft/loss"], rel=1e-5)
    assert step["sft/grad_norm"] == pytest.approx(saved.next_step["sft/grad_norm"], rel=1e-5)
    assert step["sft/lr"] == saved.next_step["sft/lr"] == LR  # the schedule's second step: warm-up done


def test_each_rank_writes_its_part_and_model_loads_in_transformers(saved_by_2):
    state, model = saved_by_2.path / "state", saved_by_2.path / "model"
    assert sorted(p.name for p in state.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # one of model/'s two files each, one decoder layer at a time
    assert sorted(p.name for p in model.glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    exported = _exported(saved_by_2.path)
    assert all(torch.equal(exported[n], w) for n, w in saved_by_2.weights.items())


@pytest.mark.parametrize("strategy", ["fsdp2", "torch"])
def test_saved_by_2_fsdp2_ranks_resumes_on_1(saved_by_2, tmp_path, assets, batch, strategy):
    _resumes_exactly(saved_by_2, tmp_path, assets, 1, strategy, batch)


@pytest.mark.long
def test_saved_by_2_fsdp2_ranks_resumes_on_4(saved_by_2, tmp_path, assets, batch):
    """4 ranks: each reads pieces of both ranks' files (the 21-row embedding sharded 11 + 10 is read as
    6 + 6 + 6 + 3)."""
    _resumes_exactly(saved_by_2, tmp_path, assets, 4, "fsdp2", batch)


def _stepped(strategy_cls, cfg, batch):
    """A strategy of one rank after one optimizer step, its optimizer state as plain tensors."""
    s = strategy_cls(cfg.model.path, cfg=cfg)
    s.configure_optimizer(lr=LR, betas=(0.9, 0.999), weight_decay=0.0, warmup_steps=2)
    logits = s.logits(batch.input_ids, batch.attention_mask)
    s.backward(-(logits.log_softmax(-1)[..., 5] * batch.response_mask).sum() / batch.num_tokens)
    s.step(1.0)
    return s


def _local_optimizer_state(optimizer) -> dict:
    """``optimizer.state_dict()`` with each DTensor as this rank's shard: what older checkpoints held."""
    from torch.distributed.tensor import DTensor

    sd = optimizer.state_dict()
    sd["state"] = {
        i: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in s.items()}
        for i, s in sd["state"].items()
    }
    return sd


@pytest.mark.parametrize("strategy", ["torch", "fsdp2"])
def test_a_checkpoint_from_before_state_resumes(tmp_path, assets, batch, strategy):
    """The format before ``state/``: ``model/`` from rank 0 and ``optimizer_rank{r}.pt`` (fsdp2: this rank's
    shard and the world size), here of one rank."""
    from reroll.strategies.fsdp2 import FSDP2Strategy
    from reroll.strategies.torch_strategy import TorchStrategy

    cls = {"torch": TorchStrategy, "fsdp2": FSDP2Strategy}[strategy]
    cfg = load_config(write_config(tmp_path / "c.yaml", assets, strategy={"name": strategy}), RunConfig)
    old = _stepped(cls, cfg, batch)
    weights = old.full_state_dict()
    # a copy: save_pretrained emptied the dict it was given (seen once fsdp2 built its model on the meta
    # device; the files it wrote are whole), and the weights are compared below
    old.hf_model.save_pretrained(tmp_path / "old" / "model", state_dict=dict(weights))
    state = {"optimizer": _local_optimizer_state(old.optimizer), "scheduler": old.scheduler.state_dict()}
    torch.save(state | {"world_size": 1}, tmp_path / "old" / "optimizer_rank0.pt")

    new = cls(cfg.model.path, cfg=cfg)
    new.configure_optimizer(lr=LR, betas=(0.9, 0.999), weight_decay=0.0, warmup_steps=2)
    new.load(tmp_path / "old")
    assert all(torch.equal(w, weights[n]) for n, w in new.full_state_dict().items())
    _assert_equal(_local_optimizer_state(new.optimizer), state["optimizer"])
    assert new.scheduler.state_dict() == state["scheduler"]


def test_an_older_fsdp2_checkpoint_at_another_world_size_names_the_fix(tmp_path, assets, batch):
    """Its optimizer shards fit only the world size that wrote them: the error says which and what to set."""
    from reroll.errors import RoleError

    path = write_config(tmp_path / "c.yaml", assets, strategy={"name": "fsdp2"})
    (tmp_path / "old" / "model").mkdir(parents=True)
    for rank in (0, 1):  # two ranks' shards; nothing is read before the check
        torch.save({"world_size": 2}, tmp_path / "old" / f"optimizer_rank{rank}.pt")
    group = _group(path, 1, "fsdp2")
    try:
        with pytest.raises(RoleError) as e:
            group.load(tmp_path / "old")
    finally:
        group.shutdown()
    message = str(e.value)
    assert "one shard per rank, saved by 2 ranks; this role has 1" in message
    assert "resume it with roles.actor_train.world_size=2" in message
    assert f"model.path={tmp_path / 'old' / 'model'}" in message


def _universal(state: Path) -> dict[str, torch.Tensor]:
    """A DeepSpeed checkpoint as one tensor per parameter and state (fp32 weights, Adam's moments and
    step), whatever the number of ranks that wrote it: its universal form, converted here."""
    from reroll.strategies.deepspeed import _TAG, _UNIVERSAL, DeepSpeedStrategy

    strategy = object.__new__(DeepSpeedStrategy)  # only its conversion, done here as rank 0 does it
    strategy.rank = 0
    strategy._to_universal(state)
    zero = state / _UNIVERSAL / _TAG / "zero"  # zero/<parameter>/{fp32,exp_avg,exp_avg_sq,step}.pt
    return {str(p.relative_to(zero)): torch.load(p, weights_only=False) for p in sorted(zero.glob("*/*.pt"))}


@pytest.mark.skipif(not strategy_available("deepspeed"), reason="deepspeed is not installed")
@pytest.mark.parametrize(
    ("stage", "lora"),
    [  # CI keeps LoRA on ZeRO-3 (~12 s on 2 cores): its checkpoint holds the adapters alone, partitioned
        pytest.param(2, False, marks=pytest.mark.long),
        pytest.param(3, False, marks=pytest.mark.long),
        pytest.param(2, True, marks=pytest.mark.long),
        (3, True),
    ],
)
def test_deepspeed_saved_by_2_resumes_on_1(tmp_path, assets, batch, stage, lora):
    """DeepSpeed's own checkpoint, read by another number of ranks through its universal form: what the
    1 rank loaded and wrote back is, per parameter, what the 2 ranks wrote, and its next step is theirs.
    With LoRA the checkpoint holds the trained tensors alone (``exclude_frozen_parameters``): the base
    comes from ``model.path`` again and the universal form's parameters are the adapters'."""
    strategy = {"lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}} if lora else {}
    path = write_config(
        tmp_path / "c.yaml", assets, optim={"lr": LR, "micro_batch_size": 4}, strategy=strategy
    )
    zero = f"strategy.deepspeed.zero_stage={stage}"
    start_ray(None)
    two = _group(path, 2, "deepspeed", zero)
    try:
        two.train(batch, NextToken())
        two.save(tmp_path / "saved")
        weights = two.weight_buckets(1.0).tensors()
        next_step = two.train(batch, NextToken())
    finally:
        two.shutdown()
    assert len(list((tmp_path / "saved" / "model").glob("*.safetensors"))) == 2  # one file a rank
    one = _group(path, 1, "deepspeed", zero)
    try:
        one.load(tmp_path / "saved")
        assert all(torch.equal(w, weights[n]) for n, w in one.weight_buckets(1.0).tensors().items())
        one.save(tmp_path / "again")
        step = one.train(batch, NextToken())
    finally:
        one.shutdown()
    saved, again = _universal(tmp_path / "saved" / "deepspeed"), _universal(tmp_path / "again" / "deepspeed")
    assert any(name.endswith("exp_avg_sq.pt") for name in saved)
    if lora:  # the adapters' moments and nothing of the frozen base
        assert all(".lora_" in name for name in saved if name.endswith("exp_avg_sq.pt"))
    _assert_equal(again, saved)
    assert step["sft/loss"] == pytest.approx(next_step["sft/loss"], rel=1e-5)
    assert step["sft/grad_norm"] == pytest.approx(next_step["sft/grad_norm"], rel=1e-5)


@pytest.mark.long
def test_a_run_resumes_on_another_world_size_through_the_cli(tmp_path, assets):
    """What a user does: an SFT run on 2 FSDP2 ranks stopped after step 2, ``--resume`` on 1 rank. Its
    step 3 is the uninterrupted 2-rank run's step 3 (loss and gradient norm, from the loaded weights;
    1e-5 as above), and no step is lost or logged twice."""
    from reroll.cli import main
    from reroll.runtime.metrics import read_metrics
    from tests.conftest import step_metrics

    cfg = write_config(
        tmp_path / "c.yaml",
        assets,
        pipeline="sft",
        sft={"steps": 3, "batch_size": 16, "lr": 1e-3},
        checkpoint={"every": 1},
        eval={"every": 0},
        strategy={"name": "fsdp2"},
    )
    two = "roles.actor_train.world_size=2"
    assert main(["train", str(cfg), "name=straight", two]) == 0
    assert main(["train", str(cfg), "name=stopped", two, "sft.steps=2"]) == 0
    assert main(["train", str(cfg), "name=stopped", "--resume", "roles.actor_train.world_size=1"]) == 0
    straight, resumed = (
        step_metrics(tmp_path / "runs" / "straight", 3),
        step_metrics(tmp_path / "runs" / "stopped", 3),
    )
    for key in ("sft/loss", "sft/grad_norm"):
        assert resumed[key] == pytest.approx(straight[key], rel=1e-5), key
    assert resumed["sft/lr"] == straight["sft/lr"]
    assert [m["step"] for m in read_metrics(tmp_path / "runs" / "stopped")] == [0, 1, 2, 3]
