"""Host memory of one Megatron rank's load: the whole model through transformers, converted and split
(``whole``, the path before ranks read their share, and still the fallback for ``.bin`` checkpoints),
against the rank's share read from the safetensors files (``share``: ``CheckpointReader`` +
``megatron_convert.rank_from_hf``).

A Qwen3-MoE checkpoint of the given size is written to a temporary directory (bf16); each case runs in a
process of its own and reports the rise of its peak resident memory over the load (``VmHWM``, reset
through ``/proc/self/clear_refs`` first; it counts the checkpoint's pages a case touches through
safetensors' memory map too) and the bytes of the state dict the rank keeps, for every rank of
``--pp`` stages x ``--ep`` expert ranks that --ranks names (default: the first stage's first EP rank).

    python benchmarks/megatron_load_memory.py --layers 8 --experts 32 --pp 2 --ep 4
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.host_memory import peak_rise  # noqa: E402


def build(path: Path, layers: int, experts: int, hidden: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2, head_dim=hidden // 8,
        num_experts=experts, num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path, max_shard_size="200MB")


def case(path: str, how: str, stage: int, pp: int, ep_rank: int, ep: int) -> dict[str, float]:
    """One rank's load (``how``: whole or share); its state dict's bytes, peak rise and seconds."""
    import torch
    from transformers import AutoConfig

    from reroll.models import megatron_convert as mc
    from reroll.models.checkpoint_reader import CheckpointReader, checkpoint_files
    from reroll.models.loading import load_causal_lm

    s = mc.gpt_shape(AutoConfig.from_pretrained(path))
    where = dict(stage=stage, pp=pp, ep_rank=ep_rank, ep=ep)

    def load() -> dict[str, torch.Tensor]:
        if how == "whole":
            return mc.rank_from_hf(load_causal_lm(path, "bfloat16").state_dict(), s, **where)
        with CheckpointReader(checkpoint_files(path), torch.bfloat16) as reader:
            return mc.rank_from_hf(reader, s, **where)

    ours, seconds, peak = peak_rise(load)
    held = sum(t.numel() * t.element_size() for t in ours.values())
    return {"held": held, "peak": peak, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--ranks", nargs="+", default=["0,0"], metavar="STAGE,EP_RANK")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: path,how,stage,ep_rank -> JSON
    args = ap.parse_args()
    if args.case:
        path, how, stage, ep_rank = args.case.split(",")
        print(json.dumps(case(path, how, int(stage), args.pp, int(ep_rank), args.ep)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp), args.layers, args.experts, args.hidden)
        size = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors"))
        print(f"{platform.processor() or platform.machine()}, {platform.python_version()}; checkpoint "
              f"{size / 2**30:.2f} GiB bf16 ({args.layers} layers, {args.experts} experts); PP {args.pp} x EP {args.ep}")  # fmt: skip
        print(
            f"{'rank':<10} {'held GiB':>9}"
            + "".join(f" {h + ' GiB':>11} {h + ' s':>8}" for h in ("whole", "share"))
        )
        for rank in args.ranks:
            stage, ep_rank = rank.split(",")
            line, held = f"{stage + ',' + ep_rank:<10}", None
            for how in ("whole", "share"):
                cmd = [sys.executable, __file__, f"--pp={args.pp}", f"--ep={args.ep}", "--case", f"{tmp},{how},{stage},{ep_rank}"]  # fmt: skip
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    line += f" {'failed':>11} {'':>8}"
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                held = r["held"]
                line += f" {r['peak'] / 2**30:>11.2f} {r['seconds']:>8.2f}"
            print(f"{line[:10]} {(held or 0) / 2**30:>9.2f}{line[10:]}", flush=True)


if __name__ == "__main__":
    main()
