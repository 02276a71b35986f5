"""A LoRA checkpoint's ``model/`` on a GPU: the adapters merge where the weights are (the host's merge
took most of a 7B LoRA checkpoint's 94 s on an H100 machine), and the files hold what a host merge of
the same weights gives."""

from __future__ import annotations

import pytest
import torch

from reroll.config.schema import RunConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}


def test_lora_export_merges_on_the_gpu_as_the_host_would(assets, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from reroll.strategies import lora
    from reroll.strategies.torch_strategy import TorchStrategy

    raw = {"pipeline": "rlvr", "data": {"train_files": ["x.jsonl"]}, "strategy": {"lora": LORA}}
    cfg = RunConfig.model_validate(raw | {"model": {"path": str(assets["model"]), "dtype": "float32"}})
    s = TorchStrategy(cfg.model.path, cfg=cfg, device="cuda")
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in s.model.named_parameters():
            if ".lora_" in name:
                p.normal_(std=0.2)
    state = {k: v.detach().cpu() for k, v in s.model.state_dict().items()}
    scale = LORA["alpha"] / LORA["rank"]
    on_host = lora.merged_state_dict(state, scale=scale)

    devices, merged_weight = [], lora.merged_weight

    def recording(w0, a, b, k):
        devices.append(w0.device.type)
        return merged_weight(w0, a, b, k)

    monkeypatch.setattr(lora, "merged_weight", recording)
    s.export(tmp_path / "model")
    assert set(devices) - {"meta"} == {"cuda"}  # (meta: the files' layout, planned first)
    written = {}
    for f in sorted((tmp_path / "model").glob("*.safetensors")):
        written |= load_file(f)
    assert on_host.keys() - written.keys() <= {"lm_head.weight"}  # a tied head is not written twice
    for name, got in written.items():
        # exact but for the delta scale * B @ A, whose GPU product may run in TF32 (10-bit mantissa):
        # each of its r terms off by at most 2^-10 of its size
        module = name.removesuffix(".weight")
        a = next((v for k, v in state.items() if f"{module}.lora_A." in k), None)
        b = next((v for k, v in state.items() if f"{module}.lora_B." in k), None)
        bound = 0.0 if a is None else float(scale * (b.abs() @ a.abs()).max()) * 2**-10
        torch.testing.assert_close(got, on_host[name], atol=bound, rtol=0)
