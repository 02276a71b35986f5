"""LoRA on the Megatron strategy (``reroll.strategies.megatron_lora``), on CPU ranks over gloo with CUDA
calls pointed at the CPU (``tests/integration/megatron_cpu.py``).

One rank (CI): the adapters start at B = 0, so the merged weights are the checkpoint's bit for bit; after
Adam steps the base is untouched (adapters off, the logits are the first ones exactly), only the targeted
layers' merged weights moved, and a Hugging Face model loaded with the merged weights computes the
adapted model's logits; a save resumes into a fresh strategy, and another layout is refused.
Several ranks (long): TP 2, TP 2 with sequence parallelism and two pipeline stages train as one rank.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from reroll.algorithms.logprobs import token_logprobs
from tests.integration.megatron_cpu import run_ranks
from tests.integration.test_megatron_pipeline import (
    STEPS,
    _megatron_rank,
    assert_train_as_one,
    tiny_megatron_config,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install 'reroll[megatron]')",
)

LORA = {"rank": 4, "alpha": 8.0, "sync": "merged"}
TARGETED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _with_lora(cfg: Path) -> Path:
    import yaml

    raw = yaml.safe_load(cfg.read_text())
    raw.setdefault("strategy", {})["lora"] = LORA
    out = cfg.with_name(cfg.stem + "-lora.yaml")
    out.write_text(yaml.safe_dump(raw))
    return out


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "two": _with_lora(tiny_megatron_config(root / "two", 2)),
        "four": _with_lora(tiny_megatron_config(root / "four", 4)),
    }


def _one_rank(rank: int, world_size: int, address: str, out: str, cfg_path: str) -> None:
    """What the CI test checks, measured on one rank (the module doc)."""
    from transformers import AutoModelForCausalLM

    s, ids, mask, n_tokens = _megatron_rank(rank, world_size, address, cfg_path, [])
    base = AutoModelForCausalLM.from_pretrained(s.model_path, dtype=torch.float32).state_dict()
    saved: dict = {"adapted": sum(hasattr(m, "lora_on") for m in s.module.modules())}
    saved["trainable"] = sorted(n for n, p in s.module.named_parameters() if p.requires_grad)
    saved["start_merged_equal"] = all(torch.equal(w, base[n]) for n, w in s.full_state_dict().items())
    with torch.no_grad():
        first = s.logits(ids, mask)
    for _ in range(STEPS):
        loss = -(token_logprobs(s.logits(ids, mask), ids) * mask).sum() / n_tokens
        s.backward(loss)
        s.step(1.0)
    with torch.no_grad():
        adapted = s.logits(ids, mask)
        with s.adapters_disabled():
            off = s.logits(ids, mask)
    merged = s.full_state_dict()
    saved["moved"] = sorted(n for n, w in merged.items() if not torch.equal(w, base[n]))
    saved["base_unchanged"] = torch.equal(off, first)
    saved["adapters_moved_logits"] = float((adapted - first).abs().max())
    hf = AutoModelForCausalLM.from_pretrained(s.model_path, dtype=torch.float32)
    hf.load_state_dict(merged)
    real = mask.bool()  # positions past a row's end are not compared (each side fills them its own way)
    with torch.no_grad():
        saved["hf_minus_adapted"] = float((hf(ids, attention_mask=mask).logits - adapted)[real].abs().max())
        hf.load_state_dict(base)
        saved["hf_minus_first"] = float((hf(ids, attention_mask=mask).logits - first)[real].abs().max())
    saved["peft_minus_adapted"] = _peft_logits(s, s.adapter_update(), ids, mask, adapted)

    s.save(Path(out) / "ckpt", with_optimizer=True)  # then one more step, and the same from a fresh strategy
    saved["saved_peft_minus_adapted"] = _peft_logits(s, Path(out) / "ckpt" / "adapter", ids, mask, adapted)
    loss = -(token_logprobs(s.logits(ids, mask), ids) * mask).sum() / n_tokens
    s.backward(loss)
    saved["next"] = (float(loss), s.step(1.0)["grad_norm"])
    torch.save(saved, f"{out}/rank{rank}.pt")


def _peft_logits(s, adapters, ids: torch.Tensor, mask: torch.Tensor, adapted: torch.Tensor) -> float:
    """How far peft's model (the base, and ``adapters``: an ``AdapterUpdate`` or a saved ``adapter/``
    directory) is from ``adapted``, the Megatron model's logits, on the rows' real positions."""
    from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(s.model_path, dtype=torch.float32)
    if isinstance(adapters, Path):
        model = PeftModel.from_pretrained(base, str(adapters))
    else:
        model = get_peft_model(base, LoraConfig(**adapters.config))
        result = set_peft_model_state_dict(model, adapters.tensors)
        assert not result.unexpected_keys, result.unexpected_keys[:3]
    with torch.no_grad():
        return float((model(ids, attention_mask=mask).logits - adapted)[mask.bool()].abs().max())


def _resumed_rank(rank: int, world_size: int, address: str, out: str, cfg_path: str) -> None:
    s, ids, mask, n_tokens = _megatron_rank(rank, world_size, address, cfg_path, [])
    s.load(Path(out).parent / "one" / "ckpt")
    loss = -(token_logprobs(s.logits(ids, mask), ids) * mask).sum() / n_tokens
    s.backward(loss)
    torch.save({"next": (float(loss), s.step(1.0)["grad_norm"])}, f"{out}/rank{rank}.pt")


def test_one_rank_trains_only_its_adapters_and_resumes_them(tmp_path, lora_models):
    (tmp_path / "one").mkdir()
    [one] = run_ranks(_one_rank, 1, tmp_path / "one", str(lora_models["two"]))
    # 2 layers x 4 adapted layers (qkv, proj, fc1, fc2), and only their adapters train
    assert one["adapted"] == 8 and one["trainable"] and all(".lora_" in n for n in one["trainable"])
    assert len(one["trainable"]) == 16
    assert one["start_merged_equal"]  # B = 0: the merged weights are the checkpoint's, bit for bit
    assert one["base_unchanged"]  # adapters off after the steps: the first logits exactly
    assert one["adapters_moved_logits"] > 1e-3  # the steps did move the adapted model
    assert one["moved"] and all(n.split(".")[-2] in TARGETED for n in one["moved"]), one["moved"]
    # the merged weights in a Hugging Face model compute the adapted logits: the same sums in fp32, in
    # another order (W x + s B (A x) against (W + s B A) x), over 64-wide rows: within 1e-4
    assert one["hf_minus_adapted"] < 1e-4, (one["hf_minus_adapted"], one["hf_minus_first"])
    # the adapters in peft's names (sync, and the checkpoint's adapter/) on the Hugging Face base model
    # compute the same: W x + s B (A x) in both, the fused layers' parts one by one there (1e-4, as above)
    assert one["peft_minus_adapted"] < 1e-4 and one["saved_peft_minus_adapted"] < 1e-4

    (tmp_path / "resumed").mkdir()
    [resumed] = run_ranks(_resumed_rank, 1, tmp_path / "resumed", str(lora_models["two"]))
    # the adapters, Adam's moments and step read back bit for bit: the same next step, exactly
    assert resumed["next"] == one["next"]


def copy_peft_a(peft_model: torch.nn.Module, megatron: torch.nn.Module) -> int:
    """peft's A of each o_proj and down_proj adapter (``...layers.{i}.self_attn.o_proj.lora_A.default.
    weight``) into the Megatron model's adapter on the same layer (the row layers: no fused parts, so one
    A each on both sides); returns how many were copied. B is zero on both sides."""
    ours = dict(megatron.named_parameters())
    layer = {"o_proj": "self_attention.linear_proj", "down_proj": "mlp.linear_fc2"}
    copied = 0
    with torch.no_grad():
        for name, a in peft_model.named_parameters():
            if ".lora_A." in name:
                i, kind = (
                    int(name.split(".layers.")[1].split(".")[0]),
                    name.split(".lora_A")[0].rsplit(".", 1)[1],
                )
                ours[f"decoder.layers.{i}.{layer[kind]}.lora_A"].copy_(a)
                copied += 1
    return copied


def _against_peft_rank(rank: int, world_size: int, address: str, out: str, cfg_path: str) -> None:
    """Megatron's adapters on the row layers (o_proj, down_proj: no fused parts) and the torch strategy's
    peft adapters on the same layers, peft's A copied into Megatron's (B = 0 in both): the same steps."""
    from reroll.config.loader import load_config
    from reroll.config.schema import RunConfig
    from reroll.strategies.torch_strategy import TorchStrategy

    rows = ["strategy.lora.target_modules=[o_proj,down_proj]"]
    s, ids, mask, n_tokens = _megatron_rank(rank, world_size, address, cfg_path, rows)
    cfg = load_config(cfg_path, RunConfig, rows)
    peft = TorchStrategy(cfg.model.path, cfg=cfg, device="cpu")
    peft.configure_optimizer(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, warmup_steps=0)
    copied = copy_peft_a(peft.model, s.module)
    steps = {"megatron": [], "peft": []}
    for _ in range(STEPS):
        for key, strategy in (("megatron", s), ("peft", peft)):
            loss = -(token_logprobs(strategy.logits(ids, mask), ids) * mask).sum() / n_tokens
            strategy.backward(loss)
            steps[key].append((float(loss), strategy.step(1.0)["grad_norm"]))
    saved = {
        "steps": steps,
        "megatron": s.full_state_dict(),
        "peft": peft.full_state_dict(),
        "copied": copied,
    }
    torch.save(saved, f"{out}/rank{rank}.pt")


def test_adapters_on_one_rank_train_as_peft_adapters_do(tmp_path, lora_models):
    """The same losses and gradient norms as peft's LoRA in the torch strategy (rel 1e-5: fp32, another
    order of the same sums) and merged weights within 2 * lr * steps (Adam's bound on rounding)."""
    (tmp_path / "peft").mkdir()
    [got] = run_ranks(_against_peft_rank, 1, tmp_path / "peft", str(lora_models["two"]))
    assert got["copied"] == 4  # 2 layers x (o_proj, down_proj)
    for (loss, norm), (loss_p, norm_p) in zip(got["steps"]["megatron"], got["steps"]["peft"], strict=True):
        assert loss == pytest.approx(loss_p, rel=1e-5) and norm == pytest.approx(norm_p, rel=1e-5)
    assert got["steps"]["megatron"][0][1] > 0  # gradients flowed
    for name, w in got["peft"].items():
        torch.testing.assert_close(got["megatron"][name], w, atol=2 * 1e-3 * STEPS, rtol=0)


def test_another_layout_is_refused_naming_the_one_that_wrote_it(tmp_path):
    from types import SimpleNamespace

    from reroll.errors import UserError
    from reroll.strategies import megatron_lora

    wrote = SimpleNamespace(world_size=1, tp=1, pp=1, vp=1, cp=1, rank=0, steps=3, optimizer=None, chunks=[])
    megatron_lora.save(wrote, tmp_path, with_optimizer=False)
    other = SimpleNamespace(world_size=2, tp=2, pp=1, vp=1, cp=1, rank=0, steps=0, optimizer=None, chunks=[])
    with pytest.raises(UserError, match="resumes at the layout that wrote it") as e:
        megatron_lora.load(other, tmp_path)
    assert "'tensor_parallel': 1" in str(e.value) and "model.path=" in str(e.value)


def _train_rank(rank: int, world_size: int, address: str, out: str, cfg_path: str, sizes: list[str]) -> None:
    """``test_megatron_pipeline._train_rank`` on a LoRA model (this module's, so that it imports here)."""
    from tests.integration.test_megatron_pipeline import _train_rank as train

    train(rank, world_size, address, out, cfg_path, sizes)


@pytest.mark.long  # three spawned ranks importing megatron-core: about a minute each on 2 CPU cores
@pytest.mark.parametrize(
    ("model", "sizes"),
    [("two", ("tensor_parallel=2",)), ("two", ("tensor_parallel=2", "sequence_parallel=true")),
     ("four", ("pipeline_parallel=2",))],
    ids=["tp2", "tp2-sp", "pp2"],
)  # fmt: skip
def test_lora_ranks_train_as_one_rank(tmp_path, lora_models, model, sizes):
    """Each rank half the rows, against one rank on all: losses, gradient norms, log-probs after the
    steps and the merged weights (``assert_train_as_one``'s bounds: summation order only). Under TP the
    column layers' A is whole on every rank and their B split, the row layers' A split and B whole; under
    sequence parallelism the column branch gathers the sequence and the row branch cuts it; on two stages
    each layer's A is drawn by its number in the whole model, so both layouts start from the same one."""

    def run(world: int, *s: str) -> list[dict]:
        out = tmp_path / f"ranks{world}{'-'.join(s)}"
        out.mkdir()
        overrides = [f"strategy.megatron.{x}" for x in s]
        return run_ranks(_train_rank, world, out, str(lora_models[model]), overrides)

    one, two = run(1)[0], run(2, *sizes)
    assert_train_as_one(one, two)
    # rank 0's adapters in peft's names: the TP shards and the stages gathered as one rank holds them
    # (the same rounding bound as the weights); the other ranks get none
    assert one["adapters"] and one["adapters"].keys() == two[0]["adapters"].keys()
    for name, t in one["adapters"].items():
        torch.testing.assert_close(two[0]["adapters"][name], t, atol=2 * 1e-3 * STEPS, rtol=0)
    assert two[1]["adapters"] == {}
    # and it was the adapters that trained: every other weight is the checkpoint's, bit for bit
    base = _base_weights(lora_models[model])
    for weights in (one["weights"], *(r["weights"] for r in two)):
        moved = {n for n, w in weights.items() if not torch.equal(w, base[n])}
        assert moved and all(n.split(".")[-2] in TARGETED for n in moved), sorted(moved)


def _base_weights(cfg: Path) -> dict[str, torch.Tensor]:
    import yaml
    from transformers import AutoModelForCausalLM

    path = yaml.safe_load(cfg.read_text())["model"]["path"]
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
