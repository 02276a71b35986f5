"""The host memory a Megatron checkpoint's ``model/`` costs each rank: ``MegatronStrategy.export`` (every
rank writes its share of the files, one decoder layer at a time, ``hf_export``) against the export before
it, which gathered every weight in rank 0's host memory for ``save_pretrained``.

    python benchmarks/megatron_save_memory.py                     # 24 layers of hidden 1024, 1 and 2 ranks
    python benchmarks/megatron_save_memory.py --layers 4 --hidden 256 --ranks 2   # a smoke run

A Qwen2-shaped model with random init (nothing downloaded, bf16, tied embedding), Megatron-Core on CPU
ranks over gloo (its CUDA calls pointed at the CPU, ``tests/integration/megatron_cpu.py``), each rank a
process of its own, the ranks as pipeline stages. Each way is called twice in fresh processes, the
second measured (the first imports what it imports lazily): the rise of the process's peak resident
memory above its resident memory before the call (``benchmarks/checkpoint_memory.py``'s ``_rise``,
every allocation of 64 KiB or more mapped on its own and returned when freed).

- ``gathered``: ``named_weights`` with rank 0 keeping every weight, assigned to a meta model,
  ``save_pretrained`` on rank 0 (what ``MegatronStrategy.save`` did before 2026-12-07);
- ``layered``: ``MegatronStrategy.export`` as ``save`` calls it now; also the bytes it says it held.

Prints one row per way and world size: seconds, the rise on rank 0 and the largest on another rank.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.checkpoint_memory import _rise, rank_rows  # noqa: E402
from benchmarks.grpo_step import device_name  # noqa: E402

WAYS = ["gathered", "layered"]


def build_model(root: Path, layers: int, hidden: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, max_position_embeddings=512,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(root / "model")
    return root / "model"


def _layer_bytes(model: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in model.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if name.startswith("model.layers.0."):
                    t = f.get_slice(name)
                    total += 2 * int(torch.tensor(t.get_shape()).prod())  # bf16
    return total


def _gathered(s, directory: Path) -> None:
    """The export before 2026-12-07: every weight on rank 0, ``save_pretrained``."""
    import contextlib

    from transformers import AutoModelForCausalLM, GenerationConfig

    weights = {n: w for n, w in s.named_weights(on_device=False) if s.rank == 0}
    if s.rank != 0:
        return
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(s.hf_config, dtype=torch.bfloat16)
    weights = {k: v for k, v in weights.items() if not (s.shape.tied and k == "lm_head.weight")}
    model.load_state_dict(weights, strict=not s.shape.tied, assign=True)
    model.tie_weights()
    with contextlib.suppress(OSError):
        model.generation_config = GenerationConfig.from_pretrained(s.model_path)
    model.save_pretrained(directory, safe_serialization=True)


def _rank(rank: int, world_size: int, port: int, config: Path, way: str, out: Path, results) -> None:
    torch.set_num_threads(1)
    from tests.integration.megatron_cpu import patch_cuda_for_cpu

    patch_cuda_for_cpu()
    from reroll.config.loader import load_config
    from reroll.config.schema import RunConfig
    from reroll.strategies.megatron import MegatronStrategy

    sizes = [f"strategy.megatron.pipeline_parallel={world_size}"]
    cfg = load_config(config, RunConfig, ["strategy.name=megatron", *sizes])
    s = MegatronStrategy(
        cfg.model.path, cfg=cfg, device="cpu", trainable=False, rank=rank, world_size=world_size
    )
    s.init_distributed(f"127.0.0.1:{port}")
    held = [0]

    def layered(directory: Path) -> None:
        held[0] = s.export(directory)

    call = {"gathered": lambda d: _gathered(s, d), "layered": layered}[way]
    call(out / "first")
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(out / "first")
    torch.distributed.barrier()
    seconds, rise = _rise(lambda: call(out / "second"))
    results.put((rank, seconds, rise, held[0] / 2**30))
    torch.distributed.barrier()


def measure(config: Path, world_size: int, way: str, root: Path) -> tuple[float, float, float, float]:
    """(seconds on rank 0, rise on rank 0, the largest rise on another rank, GiB rank 0 said it held)."""
    rows = rank_rows(_rank, world_size, config, way, root / f"{way}_{world_size}")
    others = max((r[2] for r in rows[1:]), default=float("nan"))
    return rows[0][1], rows[0][2], others, rows[0][3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--ways", nargs="+", default=WAYS, choices=WAYS)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # as checkpoint_memory.py: freed memory is returned
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_model(root, args.layers, args.hidden)
        config = root / "c.yaml"
        config.write_text(
            f"pipeline: rlvr\nname: b\noutput_dir: {root}/runs\nmodel: {{path: {model}, dtype: bfloat16}}\n"
            f"data: {{train_files: [{root}/x.jsonl]}}\n"
        )
        size = sum(p.stat().st_size for p in model.glob("*.safetensors")) / 2**30
        print(
            f"Qwen2 shape, {args.layers} layers of hidden {args.hidden}, bf16 weights {size:.2f} GiB "
            f"({_layer_bytes(model) / 2**30:.3f} GiB a layer), {device_name('cpu')}"
        )
        print(
            f"{'way':<10}{'ranks':>6}{'seconds':>9}{'rank 0 GiB':>12}{'other ranks GiB':>17}{'held GiB':>10}"
        )
        for world_size in args.ranks:
            for way in args.ways:
                seconds, rank0, others, held = measure(config, world_size, way, root)
                said = f"{held:>10.3f}" if way == "layered" else ""
                print(
                    f"{way:<10}{world_size:>6}{seconds:>9.2f}{rank0:>12.2f}{others:>17.2f}{said}", flush=True
                )


if __name__ == "__main__":
    main()
