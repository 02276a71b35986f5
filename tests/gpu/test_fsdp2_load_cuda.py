"""FSDP2 on one GPU reading its shards from the checkpoint (``reroll.strategies.shard_fill``): the weights
land on the GPU (with ``cpu_offload``, in page-locked host memory) bit-equal to ``from_pretrained``'s,
and a step's loss equals the whole-model load's. A bf16 Qwen3-MoE and a bf16 Qwen2.5-VL (its
checkpoint names renamed on load), with LoRA, tied embeddings. Two ranks over gloo on CPU: ``tests/integration/test_fsdp2_load.py``."""

from __future__ import annotations

import pytest
import torch

from reroll.config.model import TinyMoEConfig
from reroll.config.schema import RunConfig
from reroll.data.arithmetic import ARITHMETIC_ALPHABET
from reroll.models.loading import load_causal_lm
from reroll.models.tiny import build_tiny_model
from reroll.models.tiny_vision import build_tiny_vl_model
from tests.integration.test_fsdp2_load import two_steps

DEVICE = "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _load(path, *, cpu_offload: bool, by_shards: bool) -> dict:
    from torch.distributed.tensor import DTensor

    import reroll.strategies.fsdp2 as fsdp2

    raw = {
        "pipeline": "rlvr",
        "model": {"path": str(path), "dtype": "bfloat16"},
        "data": {"train_files": ["x"]},
    }
    strategy = {
        "name": "fsdp2",
        "fsdp2": {"cpu_offload": cpu_offload},
        "lora": {"rank": 4, "target_modules": ["q_proj"]},
    }
    cfg = RunConfig.model_validate(raw | {"strategy": strategy})
    files = fsdp2.checkpoint_files
    if not by_shards:
        fsdp2.checkpoint_files = lambda _path: None
    try:
        torch.manual_seed(0)
        s = fsdp2.FSDP2Strategy(str(path), cfg=cfg, device=DEVICE)
    finally:
        fsdp2.checkpoint_files = files
    home = "cpu" if cpu_offload else DEVICE
    assert all(p.to_local().device.type == home for p in s.model.parameters() if isinstance(p, DTensor))
    if cpu_offload:
        assert all(p.to_local().is_pinned() for p in s.model.parameters() if isinstance(p, DTensor))
    weights = {
        n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
        for n, t in [*s.model.state_dict().items(), *s.model.named_buffers()]
    }
    s.configure_optimizer(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0, warmup_steps=0)
    ids = torch.randint(3, 20, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = [loss.item() for loss in two_steps(s, ids)]
    tied = s.hf_model.get_output_embeddings().weight is s.hf_model.get_input_embeddings().weight
    buffers = {n: str(b.device) for n, b in s.model.named_buffers()}
    return {
        "weights": weights,
        "losses": losses,
        "read": s.checkpoint_bytes_read,
        "tied": tied,
        "buffers": buffers,
    }


@pytest.mark.parametrize("model", ["moe", "vl"])
@pytest.mark.parametrize("cpu_offload", [False, True])
def test_shards_read_on_a_gpu_equal_from_pretrained(tmp_path, cpu_offload, model):
    if model == "vl":  # its checkpoint names renamed on load (visual.* -> model.visual.*, ...)
        path = build_tiny_vl_model(tmp_path, alphabet=ARITHMETIC_ALPHABET, dtype="bfloat16")
    else:
        shape = dict(alphabet=ARITHMETIC_ALPHABET, hidden_size=64, num_layers=2, num_heads=2)
        path = build_tiny_model(tmp_path, **shape, moe=TinyMoEConfig(experts=4, top_k=2), dtype="bfloat16")
    new = _load(path, cpu_offload=cpu_offload, by_shards=True)
    old = _load(path, cpu_offload=cpu_offload, by_shards=False)
    assert old["read"] is None and new["read"] > 0  # each path ran
    assert new["tied"] and old["tied"]
    assert new["buffers"] == old["buffers"]  # where fully_shard put them (rotary frequencies)
    assert new["weights"].keys() == old["weights"].keys()
    for name, value in old["weights"].items():
        assert torch.equal(new["weights"][name], value), name
    ref = load_causal_lm(path, "bfloat16")
    base = {
        n.removeprefix("base_model.model.").replace(".base_layer", ""): v for n, v in new["weights"].items()
    }
    for name, value in [*ref.state_dict().items(), *ref.named_buffers()]:
        assert torch.equal(base[name], value), name
    # the first loss: one forward on the same weights; the one after the step is compared on CPU (the
    # experts' backward on CUDA adds in no fixed order, and Adam turns that noise into lr-sized steps)
    assert new["losses"][0] == old["losses"][0]
