"""FSDP2 ranks read their own shards of the checkpoint (``reroll.strategies.shard_fill``): two ranks over
gloo load a tiny dense model with tied embeddings, one with a head of its own, a Qwen3-MoE (three
experts: two on one rank, one on the other, read from the checkpoint's per-expert tensors into
transformers' fused ones; in float32 and bfloat16), a Qwen2.5-VL (its language model and vision tower,
whose checkpoint names transformers renames on load), and a critic and a reward model from the dense
checkpoint (their new heads at zero), with and without LoRA. Each is loaded twice in the same ranks: by
shards, and as before this module (every rank ``from_pretrained`` on the host, ``fully_shard`` keeping
its chunk: the path a checkpoint without safetensors files takes).

Everything is compared bit for bit (``torch.equal``): both paths cast the same file tensors to the same
dtype once, and FSDP2 holds the same chunk of the same tensor, so no arithmetic separates them; the loss
before and after one AdamW step is the same computation on the same weights in the same ranks. The
gathered weights and buffers also equal ``from_pretrained``'s (rotary frequencies are computed, not
read), tied embeddings stay one tensor, each rank reads the bytes it holds, and the two ranks together
read each byte of the checkpoint once.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from reroll.config.model import TinyMoEConfig
from reroll.data.arithmetic import ARITHMETIC_ALPHABET
from reroll.models.loading import load_causal_lm
from reroll.models.tiny import build_tiny_model
from reroll.models.tiny_vision import build_tiny_vl_model
from tests.conftest import small_config

pytestmark = pytest.mark.integration

LORA = ["strategy.lora.rank=4", "strategy.lora.target_modules=[q_proj,v_proj]"]
# (model, head, LoRA): in CI the MoE (tied embeddings, fused experts) with LoRA and the vision-language
# model (renamed tensors) against from_pretrained; every model and head
# in the long run (65 s on 2 cores; most of a run is starting the two ranks)
FAST = [("moe_bf16", "causal_lm", True), ("vl", "causal_lm", False)]
ALL = [
    *FAST,
    ("vl_bf16", "causal_lm", True),
    ("moe", "causal_lm", True),
    ("tied", "causal_lm", False),
    ("tied", "causal_lm", True),
    ("untied", "causal_lm", False),
    ("moe", "causal_lm", False),
    ("tied", "value", False),
    ("tied", "reward", True),
]


def _build(root: Path, model: str) -> Path:
    shape = dict(alphabet=ARITHMETIC_ALPHABET, hidden_size=64, num_layers=2, num_heads=2)
    if model == "untied":
        return build_tiny_model(root / model, **shape, tie_word_embeddings=False, seed=1)
    if model.startswith("vl"):
        return build_tiny_vl_model(root / model, alphabet=ARITHMETIC_ALPHABET, seed=3, dtype=_dtype(model))
    if model.startswith("moe"):
        moe = TinyMoEConfig(experts=3, top_k=2)
        return build_tiny_model(root / model, **shape, moe=moe, seed=2, dtype=_dtype(model))
    return build_tiny_model(root / model, **shape)


def _load(path: Path, head: str, lora: bool, rank: int, address: str, *, by_shards: bool) -> dict:
    """One rank's strategy for the case: its gathered weights and buffers, whether its embeddings are
    one tensor, what it read, and the loss before and after one step."""
    from torch.distributed.tensor import DTensor

    import reroll.strategies.fsdp2 as fsdp2

    where = path.parent / f"cfg-{rank}"
    where.mkdir(exist_ok=True)
    lora_set = LORA if lora else []
    cfg = small_config(
        where, "strategy.name=fsdp2", f"model.dtype={_dtype(path.name)}", *lora_set, model=str(path)
    )
    files = fsdp2.checkpoint_files
    if not by_shards:  # the path a checkpoint without safetensors takes: from_pretrained on every rank
        fsdp2.checkpoint_files = lambda _path: None
    try:
        torch.manual_seed(0)  # LoRA's A: the same draws on both paths
        s = fsdp2.FSDP2Strategy(str(path), cfg=cfg, rank=rank, world_size=2, head=head)
        s.init_distributed(address)
    finally:
        fsdp2.checkpoint_files = files
    full = {
        n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
        for n, t in [*s.model.state_dict().items(), *s.model.named_buffers()]
    }
    held = sum(  # this rank's shards of the checkpoint's weights (in the files' dtype)
        p.to_local().numel() * p.element_size()
        for n, p in s.model.named_parameters()
        if isinstance(p, DTensor) and "lora_" not in n
    )
    out = {"weights": full, "read": s.checkpoint_bytes_read, "held": held}
    if head == "causal_lm":
        m = s.hf_model
        out["tied"] = m.get_output_embeddings().weight is m.get_input_embeddings().weight
    s.configure_optimizer(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0, warmup_steps=0)
    ids = torch.randint(3, 20, (2, 9), generator=torch.Generator().manual_seed(rank))
    return out | {"losses": two_steps(s, ids)}


def two_steps(s, ids: torch.Tensor) -> list[torch.Tensor]:
    """Two optimizer steps of strategy ``s`` on a loss of its logits over ``ids``: each step's loss."""
    losses = []
    for _ in range(2):
        loss = s.logits(ids, torch.ones_like(ids)).float().pow(2).mean()
        s.backward(loss)
        s.step(1.0)
        s.optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def _rank(rank: int, address: str, paths: dict[str, Path], cases: list, result_dir: str) -> None:
    results = {
        (model, head, lora, by_shards): _load(paths[model], head, lora, rank, address, by_shards=by_shards)
        for model, head, lora in cases
        for by_shards in (True, False)
    }
    torch.save(results, f"{result_dir}/rank{rank}.pt")


@pytest.mark.parametrize("cases", [FAST, pytest.param(ALL, marks=pytest.mark.long)], ids=["fast", "all"])
def test_ranks_read_their_shards_and_hold_what_from_pretrained_gives(tmp_path, cases):
    import torch.multiprocessing as mp

    models = {m: _build(tmp_path, m) for m in {case[0] for case in cases}}
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{so.getsockname()[1]}"
    mp.start_processes(_rank, args=(address, models, cases, str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    for model, head, lora in cases:
        case = (model, head, lora)
        new, old = ranks[0][(*case, True)], ranks[0][(*case, False)]
        # a reward model's new head is drawn by from_pretrained before it is zeroed, moving the random
        # state peft then draws the adapters' A from; built on the meta device, nothing is drawn first
        drawn_apart = "lora_A" if head == "reward" else None
        assert new["weights"].keys() == old["weights"].keys(), case
        for name, value in old["weights"].items():
            assert torch.equal(new["weights"][name], value) or drawn_apart in name, (case, name)
        if lora:
            adapters = [v for n, v in new["weights"].items() if "lora_A" in n]
            assert adapters and all(a.abs().sum() > 0 for a in adapters)  # peft's draws, not zeros
        for r in ranks:  # the step's loss; after it too, unless the adapters' A differ
            steps = 1 if drawn_apart else 2
            assert r[(*case, True)]["losses"][:steps] == r[(*case, False)]["losses"][:steps], case
            assert r[(*case, False)]["read"] is None and r[(*case, True)]["read"] > 0  # each path ran
        if head == "causal_lm":
            assert new["tied"] == old["tied"] == (model != "untied"), case
            # each rank read what it holds, no more, and the two of them the checkpoint once
            files = sum(t.numel() * t.element_size() for t in _checkpoint(models[model]).values())
            assert [r[(*case, True)]["read"] for r in ranks] == [r[(*case, True)]["held"] for r in ranks]
            assert ranks[0][(*case, True)]["read"] + ranks[1][(*case, True)]["read"] == files, case
            if not lora:
                ref = load_causal_lm(models[model], _dtype(model))
                want = {**ref.state_dict(), **dict(ref.named_buffers())}
                assert want.keys() == new["weights"].keys()
                for name, value in want.items():
                    assert torch.equal(new["weights"][name], value), (case, name)
        if head == "value":  # the new head at zero, as from_pretrained's loader starts it
            assert not new["weights"]["score.weight"].any()


def _dtype(model: str) -> str:
    """The dtype a case's checkpoint is written in and loaded at."""
    return "bfloat16" if model.endswith("bf16") else "float32"


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")
