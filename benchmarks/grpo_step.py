"""One GRPO step on one GPU: reroll as users run it (Ray roles colocated) against its peers, as a table.

    python benchmarks/grpo_step.py                        # Qwen2.5-0.5B shape, bf16, on the GPU
    python benchmarks/grpo_step.py --peers trl-vllm,verl  # against TRL with vLLM colocated, and verl
    python benchmarks/grpo_step.py --model-size 3b        # and a Qwen2.5-3B-shaped row
    python benchmarks/grpo_step.py --tiny --device cpu --skip-trl   # a smoke run of the script
    python benchmarks/grpo_step.py --sizes moe --skip-trl    # a small Qwen3-MoE (experts), reroll's rows

Rows, all in the same run on the same random-init model (Qwen2.5's shape, built locally, nothing
downloaded), the same prompts (``--prompts`` x ``--group`` samples of ``--prompt-len`` prompt tokens
and up to ``--new-tokens`` new ones, temperature 1), a KL term against a reference (beta 0.04, so
every row runs a reference pass), one optimizer step per batch in bf16 and a model-free reward:

- ``reroll ray``: the product path. RLVR on Ray with actor_train, actor_infer and reference
  colocated on one GPU (``placement.devices: 1``), ``strategy.name: auto`` (torch at one rank) and
  the vLLM engine (CUDA graphs, sleep mode, weights over CUDA IPC), ``placement.offload: auto``
  (``--compile`` adds ``model.compile: true``; the row ``ray-compile`` turns it on for that row alone;
  the row ``ray-cudnn`` lets the trainers' attention use cuDNN, ``model.cudnn_attention: true``; the row
  ``ray-mp`` runs vLLM's engine core in a process of its own, ``rollout.vllm.in_process: false``; the
  row ``ray-logprobs`` has the engine return its sampled log-probs, ``rollout.logprobs: true``, which
  ``auto`` leaves out here; the row ``ray-dp2`` runs two engines on the GPU,
  ``roles.actor_infer.world_size: 2``, each with half the prompts and half of ``--vllm-memory``
  (``ray-dpN``: N engines); the row ``ray-resident`` moves nothing between phases,
  ``placement.offload: never``, and the row ``ray-offload`` moves everything at every phase,
  ``placement.offload: always`` (what a model too big to stay resident costs); ``auto`` keeps the
  engine awake beside the trainers where the worst
  trainer phase fits beside its share, the row ``ray-sleep`` makes it sleep at every
  trainer phase, as ``auto`` did before 2026-12-05; the row ``ray-ownnorm`` runs the model's own
  RMSNorm code in the trainers, ``model.fused_norm: false``, as before 2026-12-05; the row
  ``ray-fusedhead`` computes the log-probs from the hidden states a chunk at a time, ``model.fused_head:
  true`` (the default keeps the response positions' logits for backward: faster on an H100, more memory);
  the row
  ``ray-padded`` computes the trainers' micro-batches as padded rows, ``optim.packing: false``, as
  before 2026-12-06; by default they pack each micro-batch's rows on torch's variable-length
  flash-attention kernel; the row ``ray-fwdsized`` leaves ``optim.logprob_micro_batch_size`` unset, so
  the forward-only passes take as many rows as hold a training micro-batch's memory, the library's
  default since 2026-12-06, where the other rows take ``--logprob-micro-batch``; the row ``ray-tail``
  turns on tail batching, ``rollout.tail_threshold: --tail-threshold``: responses longer than it are set
  aside and finished together in a later step, which the mean over steps then includes); the row
  ``ray-ckpt`` checkpoints every decoder layer, ``model.gradient_checkpointing: true``, beside the
  count ``--gradient-checkpointing`` gives the others (``auto``: the fewest by ``reroll plan``).
  A row's features compose: ``ray-async-dp2-compile`` is one step off-policy with two engines and
  ``model.compile``, each feature changing what it changes alone (``ROW_FEATURES``).
- ``reroll local``: everything in one process (``runtime.backend: local``), torch strategy and the
  Hugging Face engine with a static cache: the lower bound without Ray or colocation.

The peers (``--peers``, run first, each in a process of its own: ``benchmarks/peers/``), with the same
model, prompts, lengths, KL, learning rate and micro-batch (at 3B: activation checkpointing and
``--peer-micro-batch-3b`` rows):

- ``trl``: TRL's ``GRPOTrainer`` with its ``transformers`` generation (the default peer).
- ``trl-vllm``: TRL's documented fast setup, vLLM colocated in the trainer's process (``use_vllm=True,
  vllm_mode="colocate"``, ``--vllm-memory`` of the GPU), TRL's defaults otherwise (its importance-sampling
  correction against vLLM's log-probs adds a forward pass); ``trl-vllm-nois`` turns that correction off,
  the work reroll's on-policy step does.
- ``verl``: verl's GRPO, FSDP actor and its vLLM rollout on one GPU (``benchmarks/peers/verl_grpo.py``).

Per reroll row it prints each phase's seconds (offload/reload included), the step's wall time
(``timing/step``: the whole step, not a sum of phases), the engine's new tokens per second
(``tokens/generated`` over ``timing/generate``), training and reference MFU (model FLOPs: 6·N per
trained token, 2·N per scored one, N the parameters a token multiplies through, over the phase's wall
time and the card's peak dense bf16 TFLOP/s, ``--peak-tflops`` for a card not in ``PEAK_TFLOPS``), and
for every row the ratio to the fastest peer of its model size, named (of the means, and of the
medians: one slow step moves a mean of five).
The first ``--warmup`` steps (compilation, allocator growth) are left out of the means.
``--json PATH`` also writes every step's metrics of every row (to see which phase moved in a slow step).

What every row of a size runs is one ``PeerSpec`` (``bench_setting``; ``benchmarks/peers/spec.py``):
reroll's row config (``reroll_config``) and each peer's settings read it. The settings for the larger rows
(issue 40, item 5):

- ``--sizes 7b``: Qwen2.5-7B's shape (hidden 3584, 28 layers, 28 heads, 4 KV heads, MLP 18944, vocabulary
  152064, a head of its own), activation checkpointing in every row and ``--peer-micro-batch-3b`` rows per
  peer micro-batch, as at 3B. Building it (random init on the host, 15 GB written) takes a minute or two.
- ``--tune lora``: every row trains LoRA adapters with reroll's ``strategy.lora`` defaults (rank 16, alpha
  32, the seven projections of every layer; ``--lora-rank`` for another rank), TRL through ``peft``, verl
  through its ``lora_rank``/``lora_alpha``/``target_modules``; each takes its reference as the base model
  with the adapters off. ``--tune full`` (the default) at 7B: reroll's ``placement.offload: auto`` moves
  the trainers' weights and AdamW state (42.6 GiB) to pinned host memory while the engine runs and the
  engine's weights while they train; the peers get the like (``PeerSpec.offload``: TRL's vLLM sleep mode,
  verl's FSDP parameter and optimizer offload).
- Before each reroll row on a GPU, ``reroll plan``'s estimate of its config on this card: where it does
  not fit (e.g. 7B full fine-tuning with 2,048 new tokens at 16 rows a micro-batch: 89.8 GiB), the plan
  is printed and the row left out before anything loads (``--ignore-plan`` runs it anyway).
- ``--new-tokens N``: the engine's ``max_model_len``, the model's positions, TRL's
  ``max_completion_length``/``vllm_max_model_length`` and verl's ``max_response_length``/``max_model_len``
  all follow (prompt + N + 8).
- ``--lengths long-tail``: the model is edited after its random init so that EOS has probability
  1/``--mean-length`` (512) at every position (``benchmarks/long_tail.py``; it prints p(EOS) x 512 at
  held-out positions, 0.98 at the 0.5B shape), so response lengths are geometric with mean 512, capped
  at ``--new-tokens`` (4,096 unless given), one model file for every row. The table's mean and max
  response length show the tail; reroll's rows say whether they packed rows (``optim.packing``) and
  batched the tail (``rollout.tail_threshold``) and how many tail steps ran.

The lead's GPU calls for these rows, each under one 560 s call on an H100 80GB (estimates from the 0.5B
rows' 3-5 s steps in docs/benchmarks.md scaled by FLOPs and tokens, not measured: ``--peer-timeout``
keeps a slow peer from eating the call, ``--json`` keeps what finished):

    # 7B LoRA, reroll against TRL with vLLM (~1.5 min build, TRL ~4 min, reroll ~3 min at ~25-35 s a step)
    python benchmarks/grpo_step.py --sizes 7b --tune lora --peers trl-vllm --rows ray --steps 3 \
        --micro-batch 16 --logprob-micro-batch 16 --peer-timeout 300 --json /tmp/b7lora.json
    # 7B full fine-tuning, offloading between phases (plan: 62.5 GiB trainer peak; ~1.5 min build,
    # ~3.5 min a row at ~30-40 s a step, TRL maybe out of memory: it keeps 61 GB of state resident)
    python benchmarks/grpo_step.py --sizes 7b --peers trl-vllm --rows ray --steps 3 \
        --micro-batch 16 --logprob-micro-batch 16 --peer-timeout 270 --json /tmp/b7full.json
    # 2,048 new tokens at 0.5B (nearly every response runs to the cap; ~20-30 s a step reroll,
    # ~40-50 s TRL; ~6 min)
    python benchmarks/grpo_step.py --new-tokens 2048 --gradient-checkpointing --micro-batch 32 \
        --logprob-micro-batch 32 --peers trl-vllm --rows ray --steps 3 --peer-timeout 270 --json /tmp/b2048.json
    # long tail at 0.5B: geometric lengths, mean 512, cap 4,096 (~15 s a step reroll, ~12 s with tail
    # batching, ~25 s TRL; two calls of ~8 min: the peer in each, for a same-call ratio)
    python benchmarks/grpo_step.py --lengths long-tail --gradient-checkpointing --micro-batch 16 \
        --logprob-micro-batch 16 --peers trl-vllm --rows ray,ray-padded --steps 6 --peer-timeout 240
    python benchmarks/grpo_step.py --lengths long-tail --gradient-checkpointing --micro-batch 16 \
        --logprob-micro-batch 16 --peers trl-vllm --rows ray-tail --steps 8 --peer-timeout 240

A smoke run of the new options on the CPU (minutes on two cores):

    python benchmarks/grpo_step.py --tiny --device cpu --dtype float32 --skip-trl --rows local \
        --lengths long-tail --mean-length 16 --new-tokens 64 --tune lora --steps 2 --warmup 0 --prompts 4 \
        --group 4 --prompt-len 16 --micro-batch 16 --logprob-micro-batch 16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.peers.spec import PeerSpec  # noqa: E402

QWEN25_05B = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864)
QWEN25_3B = dict(hidden_size=2048, num_layers=36, num_heads=16, num_kv_heads=2, intermediate_size=11008)
# Qwen2.5-7B: a head of its own (untied) and a vocabulary of 152064 (VOCAB)
QWEN25_7B = dict(
    hidden_size=3584,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    intermediate_size=18944,
    tie_word_embeddings=False,
)
TINY = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128)
# A small Qwen3-MoE (37 item 3's "small MoE shape"): 16 layers of 32 experts, 4 routed a token, ~1.3B
# parameters of which ~0.3B a token passes through (Qwen3-30B-A3B's proportions at a twentieth of its size)
MOE_SMALL = dict(
    hidden_size=1024,
    num_layers=16,
    num_heads=16,
    num_kv_heads=4,
    moe={"experts": 32, "top_k": 4, "expert_hidden_size": 768},
)


SHAPES = {"0.5b": QWEN25_05B, "3b": QWEN25_3B, "7b": QWEN25_7B, "moe": MOE_SMALL}
VOCAB = {"7b": 152064}  # the others: Qwen2.5-0.5B's and 3B's 151936
# sizes whose rows turn on activation checkpointing and take --peer-micro-batch-3b rows per peer micro-batch
CHECKPOINTED = ("3b", "7b")
LENGTHS = ("uniform", "long-tail")
LONG_TAIL_CAP = 4096  # --lengths long-tail: new tokens at most (geometric with mean 512: e^-8 reach it)


def qwen2_config(shape: dict, vocab_size: int, **extra: object) -> object:
    """A Qwen2 ``transformers`` config of ``shape`` (one of the dicts above), tied embeddings; ``extra``
    config fields pass through (``max_position_embeddings``)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=shape["hidden_size"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        intermediate_size=shape["intermediate_size"],
        tie_word_embeddings=True,
        **extra,
    )


ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz "
PHASES = (
    "generate",
    "generate_tail",  # tail batching (ray-tail): continuing the responses set aside
    "reward",
    "reference",
    "old_logprobs",
    "advantages",
    "train",
    "weight_sync",
    "offload",
    "reload",
)


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    from benchmarks.generation import _cpu_name

    return _cpu_name()


def build_inputs(root: Path, args: argparse.Namespace, size: str) -> tuple[Path, list[str]]:
    from reroll.config.model import TinyMoEConfig
    from reroll.models.tiny import build_tiny_model

    shape = dict(TINY if args.tiny else SHAPES[size])
    if "moe" in shape:
        shape["moe"] = TinyMoEConfig(**shape["moe"])
    model = build_tiny_model(
        root / f"model-{size}",
        alphabet=ALPHABET,
        vocab_size=None if args.tiny else VOCAB.get(size, 151936),
        max_position_embeddings=args.prompt_len + args.new_tokens + 8,
        dtype=args.dtype,
        for_cpu_engine=args.device == "cpu",
        init_device=args.device,  # on a GPU: seconds, where a 7B shape took minutes on the CPU
        **shape,
    )
    if getattr(args, "lengths", "uniform") == "long-tail":  # one edited model file for every row
        from benchmarks.long_tail import make_long_tail

        done = make_long_tail(model, mean=args.mean_length)
        print(
            f"[long-tail {size}] p(EOS) x {args.mean_length:g} at held-out positions: min "
            f"{done['ratio_min']:.3f}, median {done['ratio_median']:.3f}, max {done['ratio_max']:.3f} "
            f"(1: geometric lengths of mean {args.mean_length:g})",
            flush=True,
        )
    rng = random.Random(0)
    n = args.prompts * (args.steps + 1)
    prompts = ["".join(rng.choice(ALPHABET) for _ in range(args.prompt_len)) for _ in range(n)]
    return model, prompts


# what each word after 'ray-' in a row's name changes (reroll_config); 'dpN' and 'mbN' take a number
ROW_FEATURES = (
    "async",
    "ckpt",
    "compile",
    "cudnn",
    "dp",
    "fusedhead",
    "fwdsized",
    "logprobs",
    "mb",
    "mp",
    "offload",
    "ownnorm",
    "padded",
    "resident",
    "sleep",
    "tail",
)
NUMBERED = ("dp", "mb")  # the features that take a count: ray-dp2, ray-mb32


def row_features(row: str) -> tuple[bool, dict[str, int]]:
    """Whether ``row`` runs on Ray, and its features: the words after ``ray-``, each a change to the
    ``ray`` row (``ray-async-dp2-compile``: one step off-policy, two engines, ``model.compile``); ``dpN``
    and ``mbN`` map to N, every other word to 1. Raises ``ValueError`` naming an unknown word."""
    if row == "local":
        return False, {}
    head, *words = row.split("-")
    if head != "ray":
        raise ValueError(f"row {row!r}: a row is 'local' or 'ray' followed by -feature words")
    features: dict[str, int] = {}
    for word in words:
        counted = word[:2] in NUMBERED and word[2:].isdigit() and int(word[2:]) >= 1
        name = word[:2] if counted else word
        if name not in ROW_FEATURES or (name in NUMBERED and not counted):
            raise ValueError(
                f"row {row!r}: unknown feature {word!r}; the features are {', '.join(ROW_FEATURES)} "
                "(dpN: N engines; mbN: N rows a training micro-batch)"
            )
        features[name] = int(word[2:]) if counted else 1
    if len(moves := [w for w in ("async", "offload", "resident", "sleep") if w in features]) > 1:
        raise ValueError(f"row {row!r}: {' and '.join(moves)} each set what moves between phases; keep one")
    return True, features


def reroll_config(root: Path, model: Path, args: argparse.Namespace, mode: str, setting: PeerSpec) -> dict:
    """The run config of reroll's row ``mode`` (``run_reroll``) in ``setting``, as a dict for YAML: its
    prompts in ``root/prompts.jsonl``, its reward ``bench_reward:digits``."""
    rows = root / "prompts.jsonl"
    gpu = args.device == "cuda"
    ray, features = row_features(mode)
    engine = args.engine if ray else "hf"
    name = f"reroll-{mode}-{model.name}"
    cfg = {
        "pipeline": "rlvr",
        "name": name,
        "output_dir": str(root / "{name}"),
        "total_steps": args.steps + 1,  # the last step also evaluates: left out below
        "model": {
            "path": str(model),
            "dtype": args.dtype,
            "gradient_checkpointing": checkpointing(args, setting.gradient_checkpointing),
            "compile": args.compile or "compile" in features,
            "cudnn_attention": "cudnn" in features,
            "fused_norm": "ownnorm" not in features,
            "fused_head": "fusedhead" in features,
        },
        "data": {"train_files": [str(rows)], "prompt_template": "{question}", "eval_limit": 1},
        "rollout": {
            "engine": engine,
            "batch_size": args.prompts * args.group,
            "group_size": args.group,
            "max_new_tokens": args.new_tokens,
            "temperature": 1.0,
            "generate_batch_size": args.prompts * args.group,
            "hf_static_cache": gpu,
            "vllm": {
                "gpu_memory_utilization": args.vllm_memory,
                "max_model_len": args.prompt_len + args.new_tokens + 8,
                "in_process": "mp" not in features,
            },
        },
        "reward": {"fn": "bench_reward:digits", "isolation": "thread"},
        "algorithm": {"preset": "grpo", "kl_coef": 0.04},
        "strategy": {"name": args.ray_strategy if ray else "torch", "lora": setting.lora},
        "optim": {
            "lr": 1e-6,
            "micro_batch_size": args.micro_batch,
            "logprob_micro_batch_size": args.logprob_micro_batch or None,
        },
        "eval": {"every": 0},
        # no save at the end: 94 s of the 7B LoRA row's call on an H100 (2026-12-07)
        "checkpoint": {"every": 0, "keep_last": 1, "at_end": False},
        "logging": {"tensorboard": False, "sample_every": 0, "profile_steps": args.profile_steps},
        "runtime": {"backend": "ray" if ray else "local"},
    }
    if "tail" in features:  # tail batching: responses past --tail-threshold tokens finish in a later step
        cfg["rollout"]["tail_threshold"] = args.tail_threshold
    if "logprobs" in features:  # the engine returns its log-probs (for mismatch/*) though nothing needs them
        cfg["rollout"]["logprobs"] = True
    if "padded" in features:  # the trainers compute padded rows instead of packing them
        cfg["optim"]["packing"] = False
    if "fwdsized" in features:  # forward-only passes sized by the library (optim.logprob_* unset)
        cfg["optim"].pop("logprob_micro_batch_size")
    if rows_a_pass := features.get("mb"):  # ray-mbN: N rows a training micro-batch, not --micro-batch
        cfg["optim"]["micro_batch_size"] = rows_a_pass
    if "ckpt" in features:  # every decoder layer checkpointed, whatever --gradient-checkpointing says
        cfg["model"]["gradient_checkpointing"] = True
    if ray:  # every role on the one GPU, taking turns as the phases say
        cfg["placement"] = {"devices": 1, "device_type": "cuda" if gpu else "cpu", "offload": "auto"}
    else:
        cfg["roles"] = {
            r: {"num_gpus_per_worker": 1.0 if gpu else 0.0}
            for r in ("actor_train", "actor_infer", "reference")
        }
    if "resident" in features:  # nothing moves between phases: the engine awake beside the trainers
        cfg["placement"]["offload"] = "never"
    if "offload" in features:  # everything moves at every phase: trainers to host memory, the engine asleep
        cfg["placement"]["offload"] = "always"
    if "async" in features:  # one step off-policy on the one GPU: the engine generates the next batch
        # while the reference and the trainer compute beside it (nothing moves), weights over CUDA IPC
        cfg["placement"]["offload"] = "never"
        cfg["rollout"]["async_steps"] = 1
    # ray-dpN: N engines on the one GPU, 1/N of the prompts each: N host loops
    if engines := features.get("dp", 0):
        cfg["roles"] = {"actor_infer": {"world_size": engines}}
        cfg["rollout"]["vllm"]["gpu_memory_utilization"] = args.vllm_memory / engines
    return cfg


def prepare_reroll(root: Path, prompts: list[str]) -> None:
    """What reroll's rows read besides their config: the prompts (``root/prompts.jsonl``) and the reward
    module, where this process and Ray's workers find it."""
    rows = root / "prompts.jsonl"
    rows.write_text("".join(json.dumps({"question": p, "answer": "0"}) + "\n" for p in prompts))
    reward_module = root / "bench_reward.py"
    reward_module.write_text(
        "from reroll.rewards.base import RewardResult\n"
        "def digits(prompt, response, row):\n"
        "    return RewardResult(sum(c.isdigit() for c in response) / max(len(response), 1))\n"
    )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    # Ray's workers start from this environment: they find the reward module (and reroll, where it is
    # run from a checkout without an install) there too
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(root), str(ROOT), os.environ.get("PYTHONPATH")])
    )


def write_reroll_config(
    root: Path, model: Path, args: argparse.Namespace, mode: str, setting: PeerSpec
) -> Path:
    """``reroll_config`` as the YAML file the row runs."""
    cfg = reroll_config(root, model, args, mode, setting)
    path = root / f"{cfg['name']}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_reroll(path: Path, args: argparse.Namespace, mode: str) -> list[dict]:
    """RLVR steps of the config at ``path`` (``write_reroll_config``: 'ray' colocated Ray roles and vllm,
    'ray-compile', 'ray-cudnn', 'ray-mp' the same with ``model.compile``, ``model.cudnn_attention``,
    ``rollout.vllm.in_process: false``, 'local' one process, ...). Returns each step's phases, the metrics
    it logged, and whether it packed rows and batched the tail."""
    from reroll.config.loader import load_config
    from reroll.config.schema import RunConfig
    from reroll.models.packed_attention import wants_packing
    from reroll.pipelines.rlvr import RLVR
    from reroll.pipelines.roles import Roles
    from reroll.pipelines.run import run

    cfg = load_config(path, RunConfig)
    try:
        # the engine sleeps at every trainer phase (auto before 2026-12-05)
        if "sleep" in row_features(mode)[1]:
            with mock.patch.object(Roles, "_staying", lambda self: set()):
                run(RLVR, cfg)
        else:
            run(RLVR, cfg)
        finished = True
    except Exception as e:  # a row that fails (out of memory at step 2) keeps its steps; the next rows run
        print(f"[reroll {mode}] failed: {type(e).__name__}: {str(e)[:600]}", flush=True)
        finished = False
    packing = wants_packing(cfg.optim.packing, torch.device(args.device), getattr(torch, args.dtype))
    tail = cfg.rollout.tail_threshold or 0
    run_dir = path.parent / cfg.name  # output_dir: root/{name}
    steps = read_steps(run_dir, args.prompts * args.group, finished)
    drop_saved_models(run_dir)
    extra = {"packing": packing, "tail_threshold": tail, "async_steps": cfg.rollout.async_steps}
    return [r | extra for r in steps]


def drop_saved_models(run_dir: Path) -> None:
    """Remove what a finished row saved besides its metrics (the reference's copy, the final checkpoint:
    about 40 GB at 3B), before the next row: the lent GPU machine's disk filled with three rows' copies
    at the 7B row (2026-12-07)."""
    for child in run_dir.iterdir() if run_dir.is_dir() else ():
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)


def fits_the_gpu(path: Path, args: argparse.Namespace, name: str) -> bool:
    """Whether ``reroll plan``'s estimate fits the run of ``path`` on this GPU: where it does not (a 7B
    full fine-tuning step beside its engine), the plan is printed and the row left out before any
    model loads, unless ``--ignore-plan``."""
    from reroll.config.loader import load_config
    from reroll.config.schema import RunConfig
    from reroll.plan import plan

    gib = torch.cuda.get_device_properties(0).total_memory / 1024**3
    text, fits = plan(
        load_config(path, RunConfig), gpus=1, gpu_memory_gib=gib, prompt_tokens=args.prompt_len + 2
    )
    print(f"[{name}] reroll plan: {text.splitlines()[-1] if fits else text}", flush=True)
    if not fits and not args.ignore_plan:
        print(
            f"[{name}] left out: reroll plan's estimate does not fit this GPU (--ignore-plan runs it)",
            flush=True,
        )
    return fits or args.ignore_plan


def read_steps(run_dir: Path, samples: int, finished: bool = True) -> list[dict]:
    """A bench run's steps from its ``metrics.jsonl``: each phase's seconds, the step's wall time, its new
    tokens (``samples`` responses) and, under "metrics", all the step logged (for ``--json``). Step 0 (the
    first evaluation) and the last step of a finished run (which also evaluates) are left
    out; a run that failed keeps every step it logged."""
    from reroll.runtime.metrics import read_metrics

    if not (run_dir / "metrics.jsonl").exists():  # failed before its first step
        return []
    out = []
    logged = read_metrics(run_dir)
    for row in logged[1:-1] if finished else logged[1:]:
        phases = {p: row.get(f"timing/{p}", 0.0) for p in PHASES}
        # the response tokens of the batch the step trains (``samples`` responses but with tail batching,
        # where a step trains its finished groups and a tail step the ones set aside: each response counted
        # once, in the step that trains it)
        tokens = row.get("tokens/generated", row["rollout/response_length"] * samples)
        lengths = {"mean_length": row["rollout/response_length"]}
        if "rollout/response_length_max" in row:
            lengths["max_length"] = row["rollout/response_length_max"]
        out.append({**phases, "step": row["timing/step"], "new_tokens": tokens, **lengths, "metrics": row})
    return out


PEERS = ("trl", "trl-vllm", "trl-vllm-nois", "verl")
PEER_SCRIPTS = {"verl": "verl_grpo.py"}  # the others: trl_grpo.py


def checkpointing(args: argparse.Namespace, default: bool) -> bool | int | str:
    """reroll's ``model.gradient_checkpointing`` for a row: ``--gradient-checkpointing``'s value (true,
    false, a count of first layers, auto), else ``default`` (the setting's: true at 3B and 7B)."""
    value = args.gradient_checkpointing
    if value is None:
        return default
    named = {"true": True, "false": False, "auto": "auto"}
    return named[value.lower()] if value.lower() in named else int(value)


def bench_setting(root: Path, model: Path, args: argparse.Namespace, size: str) -> PeerSpec:
    """What every row of ``size`` runs, reroll's and the peers': the model, prompts, lengths, KL, learning
    rate, dtype, LoRA (``--tune lora``: reroll's ``strategy.lora`` defaults, ``--lora-rank``) and, at 3B and
    7B, activation checkpointing and ``--peer-micro-batch-3b`` rows per peer micro-batch (reroll's rows
    take ``--micro-batch``). ``row`` and ``out`` are each peer's (``run_peer``)."""
    from reroll.config.training import LoRAConfig

    big = size in CHECKPOINTED and not args.tiny
    lora = None
    if args.tune == "lora":
        lora = LoRAConfig(**({"rank": args.lora_rank} if args.lora_rank else {})).model_dump(
            include={"rank", "alpha", "target_modules", "dropout"}
        )
    return PeerSpec(
        row="",
        model=str(model),
        prompts_file=str(root / "peer-prompts.json"),
        out="",
        prompts=args.prompts,
        group=args.group,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        steps=args.steps,
        micro_batch=args.peer_micro_batch_3b if big else args.micro_batch,
        dtype=args.dtype,
        device=args.device,
        vllm_memory=args.vllm_memory,
        gradient_checkpointing=bool(checkpointing(args, big)),  # peers: every layer or none
        lora=lora,
        offload=args.tune == "full" and size == "7b" and not args.tiny,
    )


def run_peer(
    root: Path, setting: PeerSpec, prompts: list[str], args: argparse.Namespace, row: str
) -> list[dict]:
    """A peer library's GRPO steps (``PEERS``) in ``setting``, in a process of its own
    (``benchmarks/peers/``): its engine's GPU memory goes back when it ends, before the reroll rows start."""
    spec = dataclasses.replace(
        setting, row=row, out=str(root / f"peer-{row}-{Path(setting.model).name}.json")
    )
    Path(spec.prompts_file).write_text(json.dumps(prompts))
    script = ROOT / "benchmarks" / "peers" / PEER_SCRIPTS.get(row, "trl_grpo.py")
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    }
    cmd = [sys.executable, str(script), str(spec.write(root / f"peer-{row}.json"))]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)  # its own group: stopped whole below
    try:
        code = proc.wait(timeout=args.peer_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # with what it started (verl's Ray, an engine's processes)
        proc.wait()
        print(
            f"[{row}] stopped after --peer-timeout {args.peer_timeout:.0f} s: the row is left out", flush=True
        )
        return []
    if code:
        print(f"[{row}] failed (exit {code}): the row is left out", flush=True)
        return []
    return json.loads(Path(spec.out).read_text())


# peak dense bf16 TFLOP/s by the name torch gives the card (without sparsity); others: --peak-tflops
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))


def peak_tflops(args: argparse.Namespace) -> float | None:
    """``--peak-tflops``, else the card's from ``PEAK_TFLOPS`` (None: unknown card, or no GPU)."""
    if args.peak_tflops:
        return args.peak_tflops
    if args.device != "cuda":
        return None
    name = torch.cuda.get_device_name(0)
    return next((tflops for key, tflops in PEAK_TFLOPS if key in name), None)


def matmul_params(model: Path) -> int:
    """N of the model-FLOPs count (6·N per trained token, 2·N per scored one): the parameters a token
    multiplies through, the non-embedding ones and the LM head (counted even where it is tied to the
    embedding, whose lookup costs nothing); attention's own FLOPs (about 2 % at 384 tokens) are left out.
    A mixture of experts counts the experts a token is routed to (``num_experts_per_tok`` of
    ``num_experts``), not all of them: the small MoE shape's 1.3B parameters are ~0.4B a token."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(config)
    embedding = m.get_input_embeddings().weight
    head = m.get_output_embeddings().weight
    total = sum(p.numel() for p in m.parameters())  # a tied head counted once, as the embedding
    experts = sum(p.numel() for n, p in m.named_parameters() if ".experts." in n)
    routed = experts * getattr(config, "num_experts_per_tok", 1) // max(getattr(config, "num_experts", 1), 1)
    return total - experts + routed - embedding.numel() + (head.numel() if head is embedding else 0)


def add_rates(rows: list[dict], n_params: int, peak: float | None, *, lora: bool = False) -> None:
    """Each reroll step's engine new tokens/s (``tokens/generated`` over ``timing/generate`` and, with tail
    batching, ``timing/generate_tail``: there only roughly, as a tail step's responses began in earlier
    steps; a step of an async row, ``async_steps`` > 0, whose generate phase is only the wait for a
    generation that ran beside the previous step: the engine's own ``engine/tokens_per_s``, its seconds
    inside generate) and, with a
    known peak, its training and reference MFU (6·N·``tokens/trained`` over ``timing/train``, 2·N·
    ``tokens/reference`` over ``timing/reference``; the phase's wall time, optimizer step included). With
    ``lora`` a trained token costs 4·N: the frozen weights take no gradient (the adapters' FLOPs, rank/hidden
    of a layer's, are left out)."""
    for r in rows:
        m = r.get("metrics", {})
        generating = m.get("timing/generate", 0.0) + m.get("timing/generate_tail", 0.0)
        if r.get("async_steps"):
            r["engine_tok_s"] = m.get("engine/tokens_per_s", 0.0)
        elif generating:
            r["engine_tok_s"] = m.get("tokens/generated", r["new_tokens"]) / generating
        for key, phase, flops in (("train_mfu", "train", 4 if lora else 6), ("ref_mfu", "reference", 2)):
            tokens, seconds = (
                m.get(f"tokens/{'trained' if phase == 'train' else phase}"),
                m.get(f"timing/{phase}"),
            )
            if peak and tokens and seconds:
                r[key] = flops * n_params * tokens / seconds / (peak * 1e12)


# per-step rates of the reroll rows (add_rates): (key, label, scale, digits)
RATES = (
    ("engine_tok_s", "engine tok/s", 1, 0),
    ("train_mfu", "train MFU %", 100, 1),
    ("ref_mfu", "ref MFU %", 100, 1),
)


def mean_after(rows: list[dict], key: str, warmup: int, average=statistics.mean) -> float:
    """``average`` of ``key`` over the steps after the first ``warmup`` (0 where no step has it)."""
    kept = [r[key] for r in (rows[warmup:] or rows) if key in r]
    return average(kept) if kept else 0.0


def print_row(name: str, rows: list[dict], warmup: int) -> None:
    """A row's result as soon as it is measured (a run cut short keeps what it printed)."""
    steps = [round(r["step"], 2) for r in rows]
    print(f"[{name}] s/step {mean_after(rows, 'step', warmup):.2f} (steps {steps})", flush=True)
    for p in PHASES:  # each step's phases: a slow step shows which phase moved
        if any(r.get(p) for r in rows):
            print(f"[{name}]   {p:<12} {[round(r[p], 2) for r in rows]}", flush=True)
    for key in sorted({k for r in rows for k in r.get("phases", {})}):  # a peer's own phase names (verl's)
        print(
            f"[{name}]   {key:<12} {[round(r.get('phases', {}).get(key, 0.0), 2) for r in rows]}", flush=True
        )
    for key, label, scale, digits in RATES:  # the engine's speed and the trainers' MFU, each step
        if any(key in r for r in rows):
            shown = [round(r[key] * scale, digits or None) if key in r else "-" for r in rows]
            print(f"[{name}]   {label:<12} {shown}", flush=True)

    def series(key: str) -> list:
        return [r.get("metrics", {}).get(key) for r in rows]

    # placement.offload auto: the engine awake through the trainers' phases; the trainers resident
    # through the engine's (nothing moves where every peak fits beside the engine at once); what the
    # trainers moved where they did move, and how fast. Each: (label, key, scale, digits)
    for label, key, scale, digits in (
        ("engine awake", "placement/actor_infer_stayed", 1, None),
        ("trainer kept", "placement/actor_train_stayed", 1, None),
        ("headroom GiB", "placement/engine_headroom_gb", 1, 1),
        ("resident GiB", "placement/resident_headroom_gb", 1, 1),
        ("offload GB", "offload/bytes", 1e-9, 2),
        ("offload GB/s", "offload/gb_per_s", 1, 1),
        ("reload GB/s", "reload/gb_per_s", 1, 1),
    ):
        values = series(key)
        if any(v is not None for v in values):
            shown = ["-" if v is None else round(v * scale, digits) if digits else int(v) for v in values]
            print(f"[{name}]   {label} {shown}", flush=True)


def resolved(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with what follows from others: ``--lengths long-tail`` generates up to its cap (4,096 new
    tokens) where ``--new-tokens`` was left at its default."""
    if args.lengths == "long-tail" and args.new_tokens == DEFAULT_NEW_TOKENS:
        return argparse.Namespace(**{**vars(args), "new_tokens": LONG_TAIL_CAP})
    return args


def setting_problems(args: argparse.Namespace, sizes: list[str]) -> list[str]:
    """What the bench refuses before it builds anything (all at once): an unknown size, a long-tail model
    of a shape ``benchmarks/long_tail.py`` cannot edit, a tail threshold at or past the cap."""
    problems = [f"unknown size {s!r}; the sizes are {', '.join(SHAPES)}" for s in sizes if s not in SHAPES]
    if args.lengths == "long-tail" and "moe" in sizes and not args.tiny:
        problems.append("--lengths long-tail edits a dense Qwen2 model's layers; leave out --sizes moe")
    rows = [r for r in args.rows.split(",") if r]
    for row in rows:
        try:
            row_features(row)
        except ValueError as e:
            problems.append(str(e))
    tailed = [r for r in rows if "tail" in r.split("-")[1:]]
    if tailed and args.tail_threshold >= args.new_tokens:
        problems.append(
            f"--tail-threshold ({args.tail_threshold}) must be below --new-tokens ({args.new_tokens}), or "
            f"{', '.join(tailed)} set nothing aside"
        )
    return problems


DEFAULT_NEW_TOKENS = 256


def parser() -> argparse.ArgumentParser:
    """The bench's command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument(
        "--new-tokens",
        type=int,
        default=DEFAULT_NEW_TOKENS,
        help="the most new tokens per sample, every row (engine, trainers and peers sized for it; "
        f"--lengths long-tail: {LONG_TAIL_CAP} unless given)",
    )
    ap.add_argument(
        "--lengths",
        default="uniform",
        choices=LENGTHS,
        help="uniform: the random-init model, whose EOS is one token among ~150k (nearly every response "
        "runs to --new-tokens); long-tail: the model edited so that p(EOS) is 1/--mean-length at every "
        "position (benchmarks/long_tail.py), geometric lengths capped at --new-tokens, the same file for "
        "every row",
    )
    ap.add_argument("--mean-length", type=float, default=512.0, help="--lengths long-tail: the mean length")
    ap.add_argument(
        "--tail-threshold",
        type=int,
        default=2048,
        help="the ray-tail row's rollout.tail_threshold (tail batching): responses past it finish in a later "
        "step",
    )
    ap.add_argument(
        "--tune",
        default="full",
        choices=["full", "lora"],
        help="full fine-tuning, or LoRA adapters in every row (reroll's strategy.lora defaults: rank, alpha, "
        "target modules; the peers the same through peft / verl's lora_*); at 7B full, the peers offload "
        "as reroll's placement.offload auto does (PeerSpec.offload)",
    )
    ap.add_argument("--lora-rank", type=int, default=0, help="--tune lora: the rank (0: reroll's default)")
    ap.add_argument(
        "--ignore-plan",
        action="store_true",
        help="run a reroll row even where reroll plan's estimate says it does not fit the GPU",
    )
    ap.add_argument(
        "--micro-batch", type=int, default=64, help="training rows per micro-batch, both libraries"
    )
    ap.add_argument(
        "--logprob-micro-batch",
        type=int,
        default=64,
        help="reroll's forward-only passes (reference, old log-probs): rows per pass "
        "(optim.logprob_micro_batch_size; 64, as the runs in docs/benchmarks.md had; 0 leaves it unset, the "
        "library's default: on a GPU as many rows as hold a training micro-batch's memory)",
    )
    ap.add_argument(
        "--gradient-checkpointing",
        nargs="?",
        const="true",
        default=None,
        help="reroll's model.gradient_checkpointing: true (the flag alone), false, a count of first layers, or "
        "auto (the fewest that fit, by reroll plan's estimate); the peers checkpoint every layer for any "
        "but false and 0. Default: true for the 3B and 7B rows (64 rows of 384 tokens through a 3B model do "
        "not fit beside the engine without it), false otherwise",
    )
    ap.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="model.compile in reroll's trainers (measured on the H200: no gain in training, -7 %% reference)",
    )
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument(
        "--ray-strategy", default="auto", help="the Ray row's training strategy (auto: torch at one rank)"
    )
    ap.add_argument("--engine", default="vllm", choices=["vllm", "hf"], help="the Ray row's engine")
    ap.add_argument("--vllm-memory", type=float, default=0.35, help="the engine's share of the GPU")
    ap.add_argument("--model-size", default="0.5b", choices=["0.5b", "3b"], help="3b: adds a 3B-shaped row")
    ap.add_argument(
        "--sizes",
        default=None,
        help="model shapes to run, e.g. '3b' alone, '7b' (Qwen2.5-7B's, untied head), 'moe' (a small "
        "Qwen3-MoE; default: 0.5b and --model-size)",
    )
    ap.add_argument(
        "--rows",
        default="ray,local",
        help="reroll rows to run: local, or ray followed by any of the features, each after a '-' (ray-async-dp2-compile): "
        + ", ".join(ROW_FEATURES)
        + " (dpN: N engines; mbN: N rows a training micro-batch)",
    )
    ap.add_argument("--json", type=Path, default=None, help="write every step's metrics of every row here")
    ap.add_argument(
        "--profile-steps",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[],
        help="reroll rows: logging.profile_steps, e.g. '3,4' (tables and traces under each run's profile/)",
    )
    ap.add_argument("--tiny", action="store_true", help="a tiny model instead of Qwen2.5's shape")
    ap.add_argument(
        "--peers",
        default="trl",
        help=f"peer rows, run first, each in a process of its own: {', '.join(PEERS)} (e.g. 'trl-vllm,verl'); "
        "the table's ratios are to the fastest of them",
    )
    ap.add_argument("--skip-trl", action="store_true", help="no peer rows (the same as --peers '')")
    ap.add_argument(
        "--peer-micro-batch-3b",
        type=int,
        default=16,
        help="the peers' training rows per micro-batch at 3B and 7B (with activation checkpointing; TRL fits 16 at 3B)",
    )
    ap.add_argument(
        "--peer-timeout",
        type=float,
        default=None,
        help="seconds a peer row may take (start included); past them it is stopped and left out",
    )
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the card's peak dense bf16 TFLOP/s for MFU (default: from the card's name, H100 SXM and H200 989)",
    )
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    peers = [] if args.skip_trl else [p for p in args.peers.split(",") if p]
    if unknown := [p for p in peers if p not in PEERS]:
        ap.error(f"unknown peer rows {unknown}; the peers are {', '.join(PEERS)}")
    sizes = args.sizes.split(",") if args.sizes else ["0.5b"] + (["3b"] if args.model_size == "3b" else [])
    args = resolved(args)
    if problems := setting_problems(args, sizes):
        ap.error("; ".join(problems))
    peak = peak_tflops(args)

    root = Path(tempfile.mkdtemp(prefix="grpo-bench-"))
    try:
        bench(args, sizes, peers, peak, root)
    finally:  # the models built for the rows (15 GB at 7B) and the rows' outputs; --json keeps the results
        shutil.rmtree(root, ignore_errors=True)


def bench(
    args: argparse.Namespace, sizes: list[str], peers: list[str], peak: float | None, root: Path
) -> None:
    """Every size's peers and reroll rows, each row printed as it ends, then the tables (scratch under
    ``root``)."""
    results: dict[str, list[dict]] = {}
    models: dict[str, Path] = {}
    for size in sizes:
        model, prompts = build_inputs(root, args, size)
        label = "tiny" if args.tiny else size
        models[label] = model
        setting = bench_setting(root, model, args, size)
        prepare_reroll(root, prompts)
        modes = [m for m in args.rows.split(",") if m]  # --rows "": the peers alone
        configs = {m: write_reroll_config(root, model, args, m, setting) for m in modes}
        # reroll plan's verdict on each Ray row before anything loads on the GPU
        fits = {
            m: fits_the_gpu(p, args, f"reroll {m} {label}")
            for m, p in configs.items()
            if m.startswith("ray") and args.device == "cuda"
        }
        # the peers first: once a reroll row has started Ray, its processes stay up beside the next rows
        for row in peers:
            results[f"{row} {label}"] = run_peer(root, setting, prompts, args, row)
            print_row(f"{row} {label}", results[f"{row} {label}"], args.warmup)
            save_json(args, results)
        n_params = matmul_params(model)
        for mode in modes:
            ran = fits.get(mode, True)
            name = f"reroll {mode} {label}"
            results[name] = run_reroll(configs[mode], args, mode) if ran else []
            add_rates(results[name], n_params, peak, lora=setting.lora is not None)
            print_row(name, results[name], args.warmup)
            save_json(args, results)
            if args.device == "cuda":
                torch.cuda.empty_cache()

    shape = "tiny" if args.tiny else "Qwen2.5-shaped"
    print(
        f"\nGRPO step, {shape} random init, {args.dtype}, {args.prompts} prompts x {args.group} samples, "
        f"{args.prompt_len} prompt + up to {args.new_tokens} new tokens, on {device_name(args.device)}; "
        f"mean of steps {args.warmup + 1}..{args.steps} (seconds); reroll: model.compile={args.compile}, "
        f"{args.micro_batch} rows per training micro-batch"
    )
    reroll_rows = [k for k in results if k.startswith("reroll")]
    width = max([20, *(len(k) + 2 for k in reroll_rows)])
    print(f"{'phase':<14}" + "".join(f"{k:>{width}}" for k in reroll_rows))
    for p in (*PHASES, "step"):
        print(
            f"{p:<14}" + "".join(f"{mean_after(results[k], p, args.warmup):>{width}.2f}" for k in reroll_rows)
        )
    for key, label, scale, digits in RATES:
        cells = [mean_after(results[k], key, args.warmup) * scale for k in reroll_rows]
        print(f"{label:<14}" + "".join(f"{c:>{width}.{digits}f}" if c else f"{'-':>{width}}" for c in cells))
    if reroll_rows and not peak:
        print("(MFU: unknown card; give --peak-tflops)")
    elif reroll_rows:
        n = ", ".join(f"{label} {matmul_params(m) / 1e6:.1f}M" for label, m in models.items())
        print(
            f"(MFU: model FLOPs, {'4·N (LoRA)' if args.tune == 'lora' else '6·N'} per trained token, 2·N per "
            f"reference token, N = {n}; peak {peak:.0f} TFLOP/s)"
        )
    print_ratios(results, args.warmup)
    save_json(args, results)


def print_ratios(results: dict[str, list[dict]], warmup: int) -> None:
    """Every row's step against the fastest peer row of its model: of the means, and of the medians (one
    slow step moves a mean of five; TRL's moved 8.0-11.2 s within one run), each peer named."""
    width = max(20, *(len(k) + 2 for k in results))
    fastest: dict[str, tuple[str, float, str, float]] = {}  # size: (by mean, its mean, by median, its median)
    for size in {k.split()[-1] for k in results}:
        peers = [k for k, rows in results.items() if k.split()[0] in PEERS and k.split()[-1] == size and rows]
        if peers:
            means = {k: mean_after(results[k], "step", warmup) for k in peers}
            medians = {k: mean_after(results[k], "step", warmup, statistics.median) for k in peers}
            by_mean, by_median = min(means, key=means.get), min(medians, key=medians.get)
            fastest[size] = (by_mean, means[by_mean], by_median, medians[by_median])
            print(
                f"\nfastest peer at {size}: {by_mean} by mean ({means[by_mean]:.2f} s), {by_median} by median "
                f"({medians[by_median]:.2f} s), of {', '.join(peers)}"
            )
    print(
        f"\n{'row':<{width}}{'s/step':>10}{'median':>10}{'new tokens':>12}{'tokens/s':>10}{'mean len':>10}"
        f"{'max len':>9}{'/ peer':>8}{'median / peer median':>22}{'tokens/s x peer':>17}"
    )
    for name, rows in results.items():
        if not rows:
            print(f"{name:<{width}}  failed or left out: see its log above")
            continue
        step, toks = mean_after(rows, "step", warmup), mean_after(rows, "new_tokens", warmup)
        median = mean_after(rows, "step", warmup, statistics.median)
        longest = max((r.get("max_length", 0.0) for r in rows[warmup:] or rows), default=0.0)
        peer = fastest.get(name.split()[-1])
        rate = toks / step if step else 0.0
        ratio = ""
        if (
            peer and step
        ):  # tokens/s against the fastest peer's: lengths differ step to step where they are long-tailed
            peer_rate = mean_after(results[peer[0]], "new_tokens", warmup) / peer[1]
            ratio = f"{step / peer[1]:>8.2f}{median / peer[3]:>22.2f}{rate / peer_rate if peer_rate else 0.0:>17.2f}"
        mean_len = mean_after(rows, "mean_length", warmup)
        print(
            f"{name:<{width}}{step:>10.2f}{median:>10.2f}{toks:>12.0f}{rate:>10.0f}{mean_len:>10.0f}"
            f"{f'{longest:.0f}' if longest else '-':>9}{ratio}"
        )
    for name, rows in results.items():  # what reroll's rows did about long and uneven responses
        if rows and "packing" in rows[0]:
            tail = rows[0]["tail_threshold"]
            tail_steps = sum(r.get("metrics", {}).get("tail/step", 0.0) for r in rows)
            print(
                f"{name}: optim.packing {'on' if rows[0]['packing'] else 'off'}, tail batching "
                + (f"on (rollout.tail_threshold {tail}, {tail_steps:.0f} tail steps)" if tail else "off")
            )


def save_json(args: argparse.Namespace, results: dict[str, list[dict]]) -> None:
    """``--json``: the rows measured so far (written after each, so a run cut short keeps them)."""
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": results}, indent=1)
        )


if __name__ == "__main__":
    main()
