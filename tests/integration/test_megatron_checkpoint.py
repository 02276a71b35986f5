"""Megatron's checkpoint on CPU ranks over gloo (CUDA calls pointed at the CPU,
``tests/integration/megatron_cpu.py``): ``save`` writes ``model/`` one decoder layer at a time, each rank
its share of the files (``hf_export``), never the whole model on one rank; what it writes is what the
former export wrote (the gathered weights assigned to a meta model and ``save_pretrained``: the
reference below), bit for bit and name for name, ``from_pretrained`` loads it, and ``load`` resumes from
it exactly."""

from __future__ import annotations

import contextlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from reroll.algorithms.logprobs import token_logprobs
from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from tests.conftest import write_config
from tests.integration.megatron_cpu import patch_cuda_for_cpu, run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install 'reroll[megatron]')",
)

ROWS = 4


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (ROWS, 12), generator=g)
    mask = (torch.arange(12) < torch.tensor([12, 10, 7, 5])[:, None]).long()
    return ids * mask, mask


def _step(s, ids: torch.Tensor, mask: torch.Tensor) -> float:
    loss = -(token_logprobs(s.logits(ids, mask), ids) * mask).sum() / mask.sum()
    s.backward(loss)
    s.step(1.0)
    return float(loss)


def _save_rank(rank: int, world_size: int, address: str, out: str, cfg_path: str, sizes: list[str]) -> None:
    """One Adam step, ``save`` into ``out/ck``; a second strategy ``load``s it; both take one more step on
    the same rows (each rank all of them: a pipeline group runs one copy). Saves the weights before
    saving, the second's after loading, both's loss and weights after the next step, and the bytes
    ``export`` held."""
    torch.set_num_threads(1)
    patch_cuda_for_cpu()
    from reroll.strategies.megatron import MegatronStrategy

    cfg = load_config(cfg_path, RunConfig, ["strategy.name=megatron", *sizes])

    def strategy() -> MegatronStrategy:
        s = MegatronStrategy(cfg.model.path, cfg=cfg, device="cpu", rank=rank, world_size=world_size)
        s.init_distributed(address)
        s.configure_optimizer(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, warmup_steps=0)
        return s

    first = strategy()
    ids, mask = _batch(first.shape.vocab_size)
    _step(first, ids, mask)
    weights = first.full_state_dict()
    ck = Path(out) / "ck"
    first.save(ck, with_optimizer=True)
    held = first.export(Path(out) / "again")  # the bytes one export holds, measured
    second = strategy()
    second.load(ck)
    loaded = second.full_state_dict()
    losses = (_step(first, ids, mask), _step(second, ids, mask))
    stepped = (first.full_state_dict(), second.full_state_dict())
    layer_bytes = max(
        sum(w.numel() * w.element_size() for n, w in weights.items() if n.startswith(f"model.layers.{i}."))
        for i in range(first.shape.num_layers)
    )
    saved = {"weights": weights, "loaded": loaded, "losses": losses, "stepped": stepped}
    saved |= {"held": held, "layer": layer_bytes}
    torch.save(saved, f"{out}/rank{rank}.pt")


def _former_export(weights: dict[str, torch.Tensor], model_path: Path, dtype: torch.dtype, out: Path) -> None:
    """What ``MegatronStrategy.save`` wrote before ``hf_export``: every weight on one rank, assigned to a
    meta model, ``save_pretrained``."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tied = config.tie_word_embeddings
    weights = {k: v for k, v in weights.items() if not (tied and k == "lm_head.weight")}
    model.load_state_dict(weights, strict=not tied, assign=True)
    model.tie_weights()
    with contextlib.suppress(OSError):
        model.generation_config = GenerationConfig.from_pretrained(model_path)
    model.save_pretrained(out, safe_serialization=True)


def _files(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out |= {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    return out


def _model(root: Path, *, moe: bool) -> Path:
    from reroll.config.model import TinyMoEConfig
    from reroll.data.arithmetic import ARITHMETIC_ALPHABET
    from reroll.models.tiny import build_tiny_model

    experts = TinyMoEConfig(experts=4, top_k=2, expert_hidden_size=32) if moe else None
    return build_tiny_model(
        root / "model", alphabet=ARITHMETIC_ALPHABET, hidden_size=64, num_layers=4, num_heads=2,
        moe=experts, tie_word_embeddings=not moe,
    )  # fmt: skip


def _check(tmp_path: Path, world_size: int, sizes: tuple[str, ...], *, moe: bool, dtype: str) -> None:
    model = _model(tmp_path, moe=moe)
    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    assets = {"model": model, "train": data, "test": data}
    cfg = write_config(tmp_path / "c.yaml", assets, model={"path": str(model), "dtype": dtype})
    out = tmp_path / "ranks"
    out.mkdir()
    ranks = run_ranks(_save_rank, world_size, out, str(cfg), [f"strategy.megatron.{s}" for s in sizes])
    weights = ranks[0]["weights"]
    former = tmp_path / "former"
    _former_export(weights, model, getattr(torch, dtype), former)

    ours = out / "ck" / "model"
    written, expected = _files(ours), _files(former)
    assert written.keys() == expected.keys()
    assert ("lm_head.weight" in written) == moe  # a tied head's copy is not written (save_pretrained's way)
    assert all(written[k].dtype == v.dtype and torch.equal(written[k], v) for k, v in expected.items())
    assert json.loads((ours / "config.json").read_text()) == json.loads((former / "config.json").read_text())
    assert (ours / "generation_config.json").read_text() == (former / "generation_config.json").read_text()
    files = sorted(p.name for p in ours.glob("*.safetensors"))
    assert (
        len(files) == max(world_size, 1)
        and (len(files) == 1) != (ours / "model.safetensors.index.json").exists()
    )

    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(ours, dtype=getattr(torch, dtype)).state_dict()
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[k], v) for k, v in weights.items())
    for r in ranks:
        assert all(torch.equal(r["loaded"][k], v) for k, v in weights.items())  # load read what save wrote
        assert r["losses"][1] == r["losses"][0]
        after, resumed = r["stepped"]  # the step after resuming is the one that was not interrupted:
        assert not torch.equal(after["model.norm.weight"], weights["model.norm.weight"])  # (it moved)
        assert all(torch.equal(resumed[k], v) for k, v in after.items())  # fp32 main params, Adam moments
        # the export held whole tensors of about two layers at a time (the one written, the one gathered,
        # and the stream's unit beside them), never the model: 4 layers here
        assert 0 < r["held"] <= 3 * r["layer"] < sum(v.numel() * v.element_size() for v in weights.values())


def test_one_rank_saves_what_save_pretrained_wrote_and_resumes(tmp_path):
    """One rank, a tied model in bf16 (a dtype unlike the fp32 checkpoint it read)."""
    _check(tmp_path, 1, (), moe=False, dtype="bfloat16")


@pytest.mark.long  # two or four spawned ranks importing megatron-core: minutes on 2 CPU cores
@pytest.mark.parametrize(
    ("world_size", "sizes", "moe"),
    [
        (2, ("pipeline_parallel=2",), False),
        (2, ("tensor_parallel=2",), False),
        (2, ("pipeline_parallel=2",), True),
    ],
    ids=["pp2", "tp2", "moe-pp2"],
)
def test_ranks_each_write_a_file_of_what_one_rank_would(tmp_path, world_size, sizes, moe):
    """Two ranks: each writes one of two files (an index names them), which hold what one rank's
    ``save_pretrained`` of the gathered weights did; a mixture of experts' fused experts are written per
    expert, its untied head with them."""
    _check(tmp_path, world_size, sizes, moe=moe, dtype="float32")
