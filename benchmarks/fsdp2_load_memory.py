"""Host memory of FSDP2 ranks' load: every rank loading the whole model through transformers, then
keeping its shard (``whole``: the path before ranks read their shards, and still the fallback for
``.bin`` checkpoints), against each rank reading its own shards from the safetensors files (``share``:
``reroll.strategies.shard_fill``).

A Qwen3-MoE checkpoint of the given size (or with ``--model vl`` a Qwen2.5-VL one, whose checkpoint names
transformers renames on load: ``--layers`` and ``--hidden`` its language model's, its vision tower
``--vision-depth`` blocks of width 1280 as Qwen2.5-VL's) is written to a temporary directory (bf16); each case starts
``--ranks`` processes, each building an ``FSDP2Strategy``: over gloo on CPU (a rank's shards stay in
host memory, as with ``strategy.fsdp2.cpu_offload``), or with ``--device cuda`` over NCCL, rank r on GPU
r (its shards leave the host). It reports per rank the rise of its peak resident memory over the build
and shard (``VmHWM``, reset through ``/proc/self/clear_refs`` first; it counts the checkpoint's pages a
rank touches through safetensors' memory map too, and on CUDA the host memory of the CUDA context, alike
in both cases), its shards' bytes and the bytes it read.

    python benchmarks/fsdp2_load_memory.py --layers 8 --experts 32 --ranks 4
    python benchmarks/fsdp2_load_memory.py --device cuda --ranks 2 --layers 16 --experts 64 --hidden 1024
    python benchmarks/fsdp2_load_memory.py --model vl --layers 8 --hidden 1024 --ranks 2
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.host_memory import peak_rise  # noqa: E402
from benchmarks.megatron_load_memory import build  # noqa: E402


def _rank(rank: int, path: str, how: str, ranks: int, address: str, out: str, device: str) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    import reroll.strategies.fsdp2 as fsdp2
    from reroll.config.loader import load_config
    from reroll.config.schema import RunConfig

    cfg = load_config(Path(out) / "run.yaml", RunConfig, ["strategy.name=fsdp2", f"model.path={path}"])
    if how == "whole":
        fsdp2.checkpoint_files = lambda _path: None
    where = f"cuda:{rank}" if device == "cuda" else "cpu"

    def load() -> fsdp2.FSDP2Strategy:
        s = fsdp2.FSDP2Strategy(path, cfg=cfg, rank=rank, world_size=ranks, device=where)
        s.init_distributed(address)
        return s

    s, seconds, peak = peak_rise(load)
    held = sum(
        p.to_local().numel() * p.element_size() for p in s.model.parameters() if isinstance(p, DTensor)
    )
    result = {
        "held": held,
        "peak": peak,
        "seconds": seconds,
        "read": s.checkpoint_bytes_read,
    }
    Path(out, f"{how}{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def _build_vl(path: Path, layers: int, hidden: int, vision_depth: int) -> None:
    """A bf16 Qwen2.5-VL checkpoint (tied embeddings, as the 3B's) of the given shape."""
    from reroll.data.arithmetic import ARITHMETIC_ALPHABET
    from reroll.models.tiny_vision import build_tiny_vl_model

    build_tiny_vl_model(
        path, alphabet=ARITHMETIC_ALPHABET, hidden_size=hidden, num_layers=layers, num_heads=hidden // 128,
        num_kv_heads=2, intermediate_size=4 * hidden, vocab_size=32000, vision_hidden_size=1280,
        vision_depth=vision_depth, vision_num_heads=16, patch_size=14, dtype="bfloat16", for_cpu_engine=False,
    )  # fmt: skip


def main() -> None:
    import torch.multiprocessing as mp
    import yaml

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--model", choices=["moe", "vl"], default="moe")
    ap.add_argument("--vision-depth", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        if args.model == "vl":
            _build_vl(model, args.layers, args.hidden, args.vision_depth)
        else:
            build(model, args.layers, args.experts, args.hidden)
        base = {"pipeline": "rlvr", "model": {"path": str(model), "dtype": "bfloat16"},
                "data": {"train_files": ["x.jsonl"]}, "rollout": {"batch_size": 8, "group_size": 4}}  # fmt: skip
        (Path(tmp) / "run.yaml").write_text(yaml.safe_dump(base))
        size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        what = f"{args.vision_depth} vision blocks" if args.model == "vl" else f"{args.experts} experts"
        print(f"{platform.processor() or platform.machine()}, {platform.python_version()}; checkpoint "
              f"{size / 2**30:.2f} GiB bf16 ({args.model}: {args.layers} layers, {what}); {args.ranks} FSDP2 ranks on {args.device}")  # fmt: skip
        for how in ("whole", "share"):
            with socket.socket() as so:
                so.bind(("127.0.0.1", 0))
                address = f"127.0.0.1:{so.getsockname()[1]}"
            mp.start_processes(
                _rank,
                args=(str(model), how, args.ranks, address, tmp, args.device),
                nprocs=args.ranks,
                start_method="spawn",
            )
        print(
            f"{'rank':<5} {'held GiB':>9} {'whole GiB':>10} {'whole s':>8} {'share GiB':>10} {'share s':>8} {'read GiB':>9}"
        )
        for rank in range(args.ranks):
            w, s = (json.loads(Path(tmp, f"{how}{rank}.json").read_text()) for how in ("whole", "share"))
            print(
                f"{rank:<5} {s['held'] / 2**30:>9.2f} {w['peak'] / 2**30:>10.2f} {w['seconds']:>8.2f} "
                f"{s['peak'] / 2**30:>10.2f} {s['seconds']:>8.2f} {s['read'] / 2**30:>9.2f}"
            )


if __name__ == "__main__":
    main()
