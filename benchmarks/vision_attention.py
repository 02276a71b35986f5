"""A Qwen2.5-VL vision tower's forward and backward with transformers' per-window sdpa loop against
reroll's windows batched by length (``reroll.models.vision_attention``).

    python benchmarks/vision_attention.py --device cpu                       # the narrow tower below
    python benchmarks/vision_attention.py --device cuda --hidden 1280 --heads 16 --depth 32 \
        --intermediate 3420 --images 16                               # Qwen2.5-VL-3B's tower

The tower is Qwen2.5-VL's (``Qwen2_5_VisionTransformerPretrainedModel``, random init): 14-pixel patches,
2x2 merge, 112-pixel windows (64 patches), every eighth block (7, 15, 23, 31 of the 3B's 32) and the
last attending over the whole image, the others within windows. ``--images`` images of ``--size`` pixels a side (448: 1024 patches, 16
windows an image); random pixels. One step is the forward of all images at once, as the trainer's
micro-batch runs it, and the backward of the merged features' sum. Seconds per step, median of
``--repeat`` taking turns after one warm-up, for each attention; the largest difference of the features
and of the input gradients from the loop's is printed as a check.

It also times the attention alone (forward and backward of q/k/v at the tower's heads and head size)
over the windows and over the whole images, the part the change touches.

Measured on the CPU (2026-12-06, AMD EPYC, 2 cores shared with other jobs at a load of ~4, fp32, 8
images of 448 px = 128 windows, hidden 128, 2 heads, 4 blocks; median of 5, each attention taking turns;
features and gradients bit-equal between the two):

| CPU threads | attention | tower, s | 128 windows alone, s | 8 images alone, s |
|---|---|---|---|---|
| 1 | sdpa, per window | 1.671 | 0.041 | 0.230 |
| 1 | batched by length | 1.700 | 0.021 | 0.194 |
| 2 (contended) | sdpa, per window | 8.486 | 0.241 | 1.228 |
| 2 (contended) | batched by length | 5.121 | 0.030 | 0.272 |

On one CPU thread the tower takes the same time: the CPU spends it in the matmuls, and a small SDPA
call costs it ~0.2 ms of work either way. With threads each small call is one more parallel region to
start and join (on contended cores, the loop's 8.5 s against 5.1 s). Hidden 64, 1 head, 16 images (256
windows), one thread: tower 1.676 s against 1.671 s, windows alone 0.059 s against 0.020 s. What the
change is for is the GPU, where each of the loop's ~7,000 calls a forward of Qwen2.5-VL-3B's tower is a
kernel launch of a few microseconds' work: ``--device cuda`` with the 3B tower's shape (second command
above) measures that.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.grpo_step import device_name  # noqa: E402
from reroll.models.vision_attention import NAME, segments_attention, switch_vision_config  # noqa: E402

PATCH, MERGE, TEMPORAL = 14, 2, 2
ATTENTION = {"sdpa, per window": "sdpa", "batched by length": NAME}


def tower(args: argparse.Namespace) -> torch.nn.Module:
    """Qwen2.5-VL's vision tower at ``args``' width and depth, on ``args.device`` in ``args.dtype``."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = Qwen2_5_VLVisionConfig(
        depth=args.depth,
        hidden_size=args.hidden,
        num_heads=args.heads,
        intermediate_size=args.intermediate or args.hidden * 2,
        out_hidden_size=args.hidden,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
        window_size=112,
        fullatt_block_indexes=sorted({*range(7, args.depth, 8), args.depth - 1}),  # 3B: 7, 15, 23, 31
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2_5_VisionTransformerPretrainedModel(config).to(args.device, getattr(torch, args.dtype))


def step(model: torch.nn.Module, pixels: torch.Tensor, grids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One forward and backward; the merged features and the pixels' gradient."""
    leaf = pixels.clone().requires_grad_()
    out = model(leaf, grid_thw=grids).pooler_output
    out.float().sum().backward()
    return out.detach().float(), leaf.grad.float()


def timed(
    model: torch.nn.Module, pixels: torch.Tensor, grids: torch.Tensor, repeat: int
) -> dict[str, list[float]]:
    """Seconds of ``repeat`` steps on each attention, taking turns (a busy machine slows both alike)."""
    seconds: dict[str, list[float]] = {name: [] for name in ATTENTION}
    for _ in range(repeat):
        for name, implementation in ATTENTION.items():
            model.config._attn_implementation = implementation
            _sync(pixels.device)
            start = time.perf_counter()
            step(model, pixels, grids)
            _sync(pixels.device)
            seconds[name].append(time.perf_counter() - start)
    return seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def attention_alone(args: argparse.Namespace, length: int, count: int) -> dict[str, float]:
    """Median seconds of the attention alone (forward and backward) over ``count`` segments of ``length``
    patches at the tower's heads and head size: transformers' loop's SDPA calls against ours."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    bounds = torch.arange(count + 1, dtype=torch.int32, device=device) * length
    gen = torch.Generator().manual_seed(2)
    shape = (count * length, args.heads, args.hidden // args.heads)
    q, k, v, grad = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(4))

    def loop(*xs: torch.Tensor) -> torch.Tensor:
        pieces = [x.split(length) for x in xs]  # transformers splits by the segments' lengths
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return torch.cat([sdpa(*(x.transpose(0, 1) for x in p)).transpose(0, 1) for p in zip(*pieces)])

    fns = {"sdpa, per window": loop, "batched by length": lambda *xs: segments_attention(*xs, bounds)}
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(args.repeat + 1):
        for name, fn in fns.items():
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            _sync(device)
            start = time.perf_counter()
            fn(*leaves).backward(grad)
            _sync(device)
            if i:  # the first round warms up
                seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in seconds.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--size", type=int, default=448, help="pixels a side, a multiple of 28")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 2 x hidden)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    device = torch.device(args.device)

    model = tower(args)
    side = args.size // PATCH
    grids = torch.tensor([[1, side, side]] * args.images, device=device)
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(args.images * side * side, 3 * TEMPORAL * PATCH * PATCH, generator=gen)
    pixels = pixels.to(device, getattr(torch, args.dtype))

    want = step(model, pixels, grids)  # transformers' loop; also the warm-up
    assert switch_vision_config(model.config)
    model.zero_grad()
    got = step(model, pixels, grids)
    seconds = timed(model, pixels, grids, args.repeat)

    windows = args.images * ((side // MERGE + 3) // 4) ** 2
    print(
        f"Qwen2.5-VL vision tower, hidden {args.hidden}, {args.heads} heads, {args.depth} blocks, {args.dtype}; "
        f"{args.images} images of {args.size} px ({side * side} patches, {windows} windows in all); "
        f"forward + backward on {device_name(args.device)}, {torch.get_num_threads()} CPU threads; "
        f"median of {args.repeat}"
    )
    alone = {
        f"{windows} windows": attention_alone(args, 64, windows),
        f"{args.images} images": attention_alone(args, side * side, args.images),
    }
    print(f"{'attention':<20}{'tower, s':>10}" + "".join(f"{f'{k}, s':>18}" for k in alone))
    for name, times in seconds.items():
        row = "".join(f"{a[name]:>18.4f}" for a in alone.values())
        print(f"{name:<20}{statistics.median(times):>10.3f}{row}")
    a, b = (statistics.median(t) for t in seconds.values())
    print(f"speed-up of the tower {a / b:.2f}x")
    for name, x, y in zip(("features", "pixel grads"), want, got):
        print(f"largest difference, {name}: {float((x - y).abs().max()):.2e} (of {float(x.abs().max()):.2e})")


if __name__ == "__main__":
    main()
