"""A Megatron checkpoint resumed at another layout, optimizer state included, on CPU ranks over gloo
(CUDA calls pointed at the CPU, ``tests/integration/megatron_cpu.py``).

A run takes two Adam steps at one layout and saves; another run at another layout (tensor, pipeline,
expert or data parallelism, the distributed optimizer on or off) loads it. What it loaded must be what
was saved, bit for bit: Adam's moments and the fp32 main parameters of a bf16 model, gathered in
Hugging Face names at both layouts (moving state between layouts only copies it), and the step counts.
Both then take one more step on the same rows, and the resumed run's main parameters must match the
uninterrupted run's within the bound of the math (``check_step``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from reroll.algorithms.logprobs import token_logprobs
from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from tests.conftest import write_config
from tests.integration.megatron_cpu import patch_cuda_for_cpu, run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install 'reroll[megatron]')",
)

LR, ROWS = 1e-3, 8


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows of random tokens (zeros past each row's end), lengths 16 down to 3."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (ROWS, 16), generator=g)
    mask = (torch.arange(16) < torch.linspace(16, 3, ROWS).long()[:, None]).long()
    return ids * mask, mask


def _strategy(rank: int, world_size: int, address: str | None, cfg_path: str, sizes: list[str]):
    from reroll.strategies.megatron import MegatronStrategy

    cfg = load_config(cfg_path, RunConfig, ["strategy.name=megatron", *sizes])
    s = MegatronStrategy(cfg.model.path, cfg=cfg, device="cpu", rank=rank, world_size=world_size)
    if address is not None:
        s.init_distributed(address)
    s.configure_optimizer(lr=LR, betas=(0.9, 0.99), weight_decay=0.1, warmup_steps=3)
    return s


def train_step(s, rank: int, world_size: int) -> None:
    """One Adam step of next-token loss (token mean over the whole batch) on this rank's share of the
    rows, as the role splits a batch (the ranks of a TP or PP group run their rows together)."""
    ids, mask = _batch(s.shape.vocab_size)
    n_tokens = mask[:, 1:].sum()
    share = slice(rank * ROWS // world_size, (rank + 1) * ROWS // world_size)
    width = int(mask[share].sum(-1).max())
    ids, mask = ids[share, :width], mask[share, :width]

    def loss_of(rows: Rows) -> tuple[torch.Tensor, None]:
        logits = s.logits(rows.input_ids, rows.attention_mask)
        i, m = rows.input_ids.to(logits.device), rows.attention_mask.to(logits.device)
        return -(token_logprobs(logits, i) * m).sum() / n_tokens, None

    if s.vp > 1:  # the interleaved schedule runs the model (a filler beside the one micro-batch)
        s.train_micro_batches([Rows(ids, mask)], loss_of)
    else:
        s.backward(loss_of(Rows(ids, mask))[0])
    s.step(1.0)


@dataclass(frozen=True)
class Rows:
    """A micro-batch as the schedule takes it."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def optimizer_state_in_hf_names(s) -> dict[str, Any]:
    """The optimizer's moments and main parameters in Hugging Face names, gathered as ``save`` gathers
    them (a collective), and its step counts (Adam's, the warm-up's)."""
    from reroll.strategies import megatron_optimizer_state as ost

    by_param = ost.slots(s.optimizer)
    out = {
        kind: dict(s.hf_named([ost.ParamState(c, by_param, kind) for c in s.chunks], on_device=False))
        for kind in (*ost.MOMENTS, ost.MAIN)
    }
    return out | {"scalars": {"adam_step": ost._adam_step(by_param, s.device), "warmup_steps": s.steps}}


def _save_rank(rank: int, world_size: int, address: str, out: str, cfg_path: str, sizes: list[str]) -> None:
    """Two steps, save into ``out/ck``, then the step of the uninterrupted run; this rank's view of the
    state at the save and after the third step."""
    torch.set_num_threads(1)
    patch_cuda_for_cpu()
    s = _strategy(rank, world_size, address, cfg_path, sizes)
    for _ in range(2):
        train_step(s, rank, world_size)
    s.save(Path(out) / "ck", with_optimizer=True)
    saved = optimizer_state_in_hf_names(s)
    train_step(s, rank, world_size)
    torch.save({"saved": saved, "after": optimizer_state_in_hf_names(s)}, f"{out}/rank{rank}.pt")


def _resume_rank(
    rank: int, world_size: int, address: str, out: str, cfg_path: str, sizes: list[str], ck: str
) -> None:
    """``load`` ``ck`` at this layout, then the third step; the state as loaded and after the step."""
    torch.set_num_threads(1)
    patch_cuda_for_cpu()
    s = _strategy(rank, world_size, address, cfg_path, sizes)
    s.load(Path(ck))
    loaded = optimizer_state_in_hf_names(s)
    train_step(s, rank, world_size)
    torch.save({"loaded": loaded, "after": optimizer_state_in_hf_names(s)}, f"{out}/rank{rank}.pt")


def _config(root: Path, *, moe: bool = False) -> Path:
    from reroll.config.model import TinyMoEConfig
    from reroll.data.arithmetic import ARITHMETIC_ALPHABET
    from reroll.models.tiny import build_tiny_model

    experts = TinyMoEConfig(experts=4, top_k=2, expert_hidden_size=32) if moe else None
    model = build_tiny_model(
        root / "model", alphabet=ARITHMETIC_ALPHABET, hidden_size=64, num_layers=4, num_heads=2,
        moe=experts, tie_word_embeddings=not moe,
    )  # fmt: skip
    data = root / "rows.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    assets = {"model": Path(model), "train": data, "test": data}
    return write_config(root / "c.yaml", assets, model={"path": str(model), "dtype": "bfloat16"})


def check_loaded(saved: dict, loaded: dict) -> None:
    """What a run loaded is what the other saved, bit for bit (moving state between layouts copies it)."""
    assert saved["scalars"] == loaded["scalars"] and saved["scalars"]["adam_step"] == 2
    for kind in ("exp_avg", "exp_avg_sq", "main"):
        assert saved[kind].keys() == loaded[kind].keys()
        for name, t in saved[kind].items():
            assert torch.equal(loaded[kind][name], t), (kind, name)
    assert all(t.abs().max() > 0 for t in saved["exp_avg_sq"].values())  # every parameter's moments came


def check_step(uninterrupted: dict, resumed: dict) -> None:
    """The main parameters after the step that followed the save, resumed against uninterrupted. The two
    start from the same state; at another layout the gradients are summed in another order (over TP or
    DP ranks, in other shapes), so they differ in their last bits, and Adam's m^ / sqrt(v^) can turn
    that into anything up to its bound where a gradient is near zero. At step 3 m^ and v^ are weighted
    means of the gradients (weights w_i, u_i, each summing to 1), so by Cauchy-Schwarz
    |m^| / sqrt(v^) <= sqrt(sum w_i^2 / u_i) = 1.003 for betas (0.9, 0.99): each run's update is at most
    1.003 lr beside the weight decay (the same in both), and the two differ by at most 2.006 lr. That
    bound cannot tell restored moments from fresh ones (a fresh Adam's update is lr too): the exact
    comparison of the loaded state (``check_loaded``) is what pins the state; this checks the run
    steps on from it (measured: within 6e-5 for the Qwen3-MoE at EP 2 -> 1, lr 1e-3)."""
    for name, w in uninterrupted["main"].items():
        torch.testing.assert_close(resumed["main"][name], w, atol=2.01 * LR, rtol=0)
    assert uninterrupted["scalars"] == resumed["scalars"]


def _resume(
    tmp_path: Path, cfg: Path, saving: tuple[int, list[str]], resuming: tuple[int, list[str]]
) -> None:
    (n_save, save_sizes), (n_load, load_sizes) = saving, resuming
    first, second = tmp_path / "save", tmp_path / "resume"
    first.mkdir()
    second.mkdir()
    sizes = [[f"strategy.megatron.{s}" for s in x] for x in (save_sizes, load_sizes)]
    saved = run_ranks(_save_rank, n_save, first, str(cfg), sizes[0])
    assert (first / "ck" / "optimizer" / "exp_avg" / "config.json").exists()
    assert not list((first / "ck").glob("optimizer_rank*.pt"))
    resumed = run_ranks(_resume_rank, n_load, second, str(cfg), sizes[1], str(first / "ck"))
    for r in resumed:
        check_loaded(saved[0]["saved"], r["loaded"])
        check_step(saved[0]["after"], r["after"])


@pytest.mark.long  # two or four spawned ranks importing megatron-core, twice: 1-2 minutes on 2 CPU cores;
# the CI sibling is test_one_rank_resumes_with_the_distributed_optimizer_turned_on
@pytest.mark.parametrize(
    ("saving", "resuming"),
    [
        ((2, ["tensor_parallel=2"]), (1, [])),
        ((2, ["pipeline_parallel=2"]), (2, ["tensor_parallel=2"])),
        ((1, ["distributed_optimizer=false"]), (2, [])),
        ((2, []), (1, ["distributed_optimizer=false"])),
    ],
    ids=["tp2-to-1", "pp2-to-tp2", "1-to-dp2", "dp2-to-1"],
)
def test_a_checkpoint_resumes_at_another_layout(tmp_path, saving, resuming):
    """A tied bf16 model: TP 2 to one rank, two stages to TP 2, one rank to two data-parallel ranks
    (their distributed optimizer cuts each parameter's flat range out of what it reads) and back (it
    assembles them on save)."""
    _resume(tmp_path, _config(tmp_path), saving, resuming)


@pytest.mark.long  # two spawned ranks, then one: about a minute on 2 CPU cores
def test_a_mixture_of_experts_resumes_at_another_expert_parallelism(tmp_path):
    """A Qwen3-MoE (chained dense and expert optimizers, each distributed over its own data-parallel
    ranks) saved with its experts over 2 ranks, resumed with all on one."""
    _resume(tmp_path, _config(tmp_path, moe=True), (2, ["expert_parallel=2"]), (1, []))


def _one_rank(rank: int, world_size: int, address: str, out: str, cfg_path: str) -> None:
    """One rank, in one process: a run without the distributed optimizer saves after two steps and takes
    a third; a run with it loads and takes the third. Then the same with the checkpoint in the format
    before ``optimizer/`` (one file per rank): read back at its own layout, refused at another."""
    from reroll.errors import UserError
    from reroll.strategies import SavedAtOtherWorldSize

    torch.set_num_threads(1)
    patch_cuda_for_cpu()
    plain = _strategy(0, 1, None, cfg_path, ["strategy.megatron.distributed_optimizer=false"])
    for _ in range(2):
        train_step(plain, 0, 1)
    ck = Path(out) / "ck"
    plain.save(ck, with_optimizer=True)
    saved = optimizer_state_in_hf_names(plain)
    _old_format_files(plain, Path(out) / "old")
    train_step(plain, 0, 1)
    sharded = _strategy(0, 1, None, cfg_path, [])
    sharded.load(ck)
    loaded = optimizer_state_in_hf_names(sharded)
    train_step(sharded, 0, 1)
    again = _strategy(0, 1, None, cfg_path, ["strategy.megatron.distributed_optimizer=false"])
    again.load(Path(out) / "old")  # the old format at its own layout
    old = optimizer_state_in_hf_names(again)
    refusals = []
    for directory, error in ((Path(out) / "old", UserError), (Path(out) / "old2", SavedAtOtherWorldSize)):
        try:
            _strategy(0, 1, None, cfg_path, []).load(directory)
        except error as e:
            refusals.append(str(e))
    result = {"saved": saved, "loaded": loaded, "old": old, "refusals": refusals}
    torch.save(
        result | {"after": (optimizer_state_in_hf_names(plain), optimizer_state_in_hf_names(sharded))},
        f"{out}/rank0.pt",
    )


def _old_format_files(s, directory: Path) -> None:
    """What ``save`` wrote before ``optimizer/`` (its code as it was), into ``directory``, and a copy as
    if saved by 2 ranks into ``directory``2."""
    import shutil

    s.export(directory / "model")
    chained = getattr(s.optimizer, "chained_optimizers", [s.optimizer])
    inners = [o.optimizer for o in chained if o is not None and o.optimizer is not None]
    main = [[p.detach().cpu() for g in o.param_groups for p in g["params"]] for o in inners]
    state = {"optimizers": [o.state_dict() for o in inners], "main_params": main, "steps": s.steps}
    torch.save(state, directory / "optimizer_rank0.pt")
    shutil.copytree(directory, f"{directory}2")
    shutil.copy(directory / "optimizer_rank0.pt", f"{directory}2/optimizer_rank1.pt")


def test_one_rank_resumes_with_the_distributed_optimizer_turned_on(tmp_path):
    """The distributed optimizer at one rank keeps each parameter as a flat range of its buffer: a
    checkpoint written without it is read into those ranges exactly. The older per-rank format resumes
    at its own layout, and is refused (a ``UserError`` naming the fix) at another layout or world size."""
    cfg = _config(tmp_path)
    out = tmp_path / "rank"
    out.mkdir()
    (r,) = run_ranks(_one_rank, 1, out, str(cfg))
    check_loaded(r["saved"], r["loaded"])
    check_loaded(r["saved"], r["old"])
    check_step(*r["after"])
    assert len(r["refusals"]) == 2, r["refusals"]
    assert "strategy.megatron settings it was saved with" in r["refusals"][0]
    assert "saved by 2 ranks; this role has 1" in r["refusals"][1]
