"""The Megatron-Core strategy on a GPU: the same numbers as the torch strategy, and a quickstart-shaped run.

Megatron-Core's forward runs on CUDA only, so everything here skips without a GPU or without
megatron-core (pip install 'reroll[megatron]'). The TP=2 (also with sequence parallelism, a MoE's too), PP=2
and EP=2 tests also need two GPUs. Run alone with
``python -m pytest -q tests/gpu/test_megatron.py``.
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from reroll.algorithms.logprobs import token_logprobs
from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.runtime.metrics import read_metrics
from tests.conftest import QUICKSTART, write_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("megatron") is None,
        reason="needs a CUDA device and megatron-core (pip install 'reroll[megatron]')",
    ),
]


def _cfg(tmp_path, assets, *overrides: str) -> RunConfig:
    path = write_config(tmp_path / "c.yaml", assets)
    base = ["strategy.name=megatron", "roles.actor_train.num_gpus_per_worker=1"]
    return load_config(path, RunConfig, [*base, *overrides])


def _batch(rows: int = 8, width: int = 24, vocab: int = 21) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows of random tokens, lengths from 3 to ``width``."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, width), generator=g)
    lengths = torch.linspace(width, 3, rows).long()
    return ids, (torch.arange(width) < lengths[:, None]).long()


def _train(strategy, ids, mask, steps: int, micro: int = 4) -> list[tuple[float, float]]:
    """``steps`` optimizer steps of next-token loss (token mean over the whole batch) in micro-batches."""
    n_tokens = mask[:, 1:].sum()
    out = []
    for _ in range(steps):
        total = 0.0
        for start in range(0, len(ids), micro):
            i, m = ids[start : start + micro], mask[start : start + micro]
            logits = strategy.logits(i, m)
            loss = -(token_logprobs(logits, i.to(logits.device)) * m.to(logits.device)).sum() / n_tokens
            strategy.backward(loss)
            total += float(loss)
        out.append((total, strategy.step(1.0)["grad_norm"]))
    return out


def _assert_same_steps(got: list[tuple[float, float]], expected: list[tuple[float, float]]) -> None:
    """Equal losses and grad norms (rel 1e-6: the same kernels on the same device)."""
    assert len(got) == len(expected)
    for (loss, norm), (loss_e, norm_e) in zip(got, expected):
        assert loss == pytest.approx(loss_e, rel=1e-6) and norm == pytest.approx(norm_e, rel=1e-6), (
            got,
            expected,
        )


def _pair(cfg, model_path, **megatron_kwargs):
    from reroll.strategies.megatron import MegatronStrategy
    from reroll.strategies.torch_strategy import TorchStrategy

    made = [
        TorchStrategy(model_path, cfg=cfg, device="cuda"),
        MegatronStrategy(model_path, cfg=cfg, device="cuda"),
    ]
    for s in made:
        s.configure_optimizer(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, warmup_steps=2)
    return made


@pytest.mark.parametrize("distributed_optimizer", [True, False])
def test_fp32_loss_grad_norm_and_weights_equal_torch(tmp_path, assets, distributed_optimizer):
    """fp32, TP=1: three steps give the torch strategy's losses and grad norms (rel 1e-4) and weights (1e-4)."""
    cfg = _cfg(tmp_path, assets, f"strategy.megatron.distributed_optimizer={distributed_optimizer}")
    ref, ours = _pair(cfg, str(assets["model"]))
    ids, mask = _batch()
    expected, got = _train(ref, ids, mask, 3), _train(ours, ids, mask, 3)
    for (loss_a, norm_a), (loss_b, norm_b) in zip(expected, got):
        assert loss_b == pytest.approx(loss_a, rel=1e-4)
        assert norm_b == pytest.approx(norm_a, rel=1e-4)
    a, b = ref.full_state_dict(), ours.full_state_dict()
    assert a.keys() == b.keys()
    for k in a:  # CPU dev run (fp32, TP=1 and TP=2): <= 2e-5 after 3 steps at lr 1e-2
        torch.testing.assert_close(b[k], a[k], atol=1e-4, rtol=0)


def test_bf16_loss_and_grad_norm_close_to_torch(tmp_path, assets):
    """bf16, TP=1, first step: loss within 1%, grad norm within 5% of the torch strategy's (bf16 rounding
    differs: Megatron keeps softmax and gradient accumulation in fp32)."""
    cfg = _cfg(tmp_path, assets, "model.dtype=bfloat16")
    ref, ours = _pair(cfg, str(assets["model"]))
    ids, mask = _batch()
    [(loss_a, norm_a)], [(loss_b, norm_b)] = _train(ref, ids, mask, 1), _train(ours, ids, mask, 1)
    assert loss_b == pytest.approx(loss_a, rel=1e-2)
    assert norm_b == pytest.approx(norm_a, rel=5e-2)


def test_save_load_resumes_exactly_and_exports_hf(tmp_path, assets):
    from transformers import AutoModelForCausalLM

    from reroll.strategies.megatron import MegatronStrategy

    cfg = _cfg(tmp_path, assets, "model.dtype=bfloat16")
    ids, mask = _batch()
    first = MegatronStrategy(str(assets["model"]), cfg=cfg, device="cuda")
    first.configure_optimizer(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, warmup_steps=3)
    _train(first, ids, mask, 2)
    first.save(tmp_path / "ck", with_optimizer=True)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "ck" / "model", dtype=torch.bfloat16)
    exported = exported.state_dict()
    weights = first.full_state_dict()
    differ = {
        k: (
            str(exported[k].dtype),
            str(weights[k].dtype),
            float((exported[k].cpu().float() - weights[k].float()).abs().max()),
        )
        for k in weights
        if exported[k].dtype != weights[k].dtype or not torch.equal(exported[k].cpu(), weights[k])
    }
    assert not differ, f"exported != trained (dtype exported, dtype ours, max diff): {differ}"

    second = MegatronStrategy(str(assets["model"]), cfg=cfg, device="cuda")
    second.configure_optimizer(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, warmup_steps=3)
    second.load(tmp_path / "ck")
    _assert_same_steps(_train(second, ids, mask, 2), _train(first, ids, mask, 2))  # fp32 main params, Adam


def test_lora_on_the_row_layers_trains_as_peft_and_resumes_exactly(tmp_path, assets):
    """LoRA on o_proj and down_proj (layers Megatron does not fuse), bf16: peft's A copied into Megatron's
    adapters (B = 0 in both), three steps give the torch strategy's losses and grad norms (rel 1e-2: bf16
    matmuls in another order); a save resumes into a fresh strategy with the same next steps."""
    from reroll.strategies.megatron import MegatronStrategy
    from reroll.strategies.torch_strategy import TorchStrategy

    lora = [
        "strategy.lora.sync=merged",
        "strategy.lora.target_modules=[o_proj,down_proj]",
        "model.dtype=bfloat16",
    ]
    cfg = _cfg(tmp_path, assets, *lora)
    made = [TorchStrategy(str(assets["model"]), cfg=cfg, device="cuda")]
    made.append(MegatronStrategy(str(assets["model"]), cfg=cfg, device="cuda"))
    for s in made:
        s.configure_optimizer(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, warmup_steps=0)
    peft, ours = made
    from tests.integration.test_megatron_lora import copy_peft_a

    assert copy_peft_a(peft.model, ours.module) > 0
    ids, mask = _batch()
    for (loss_a, norm_a), (loss_b, norm_b) in zip(_train(peft, ids, mask, 3), _train(ours, ids, mask, 3)):
        assert loss_b == pytest.approx(loss_a, rel=1e-2) and norm_b == pytest.approx(norm_a, rel=1e-2)
    ours.save(tmp_path / "ck", with_optimizer=True)
    again = MegatronStrategy(str(assets["model"]), cfg=cfg, device="cuda")
    again.configure_optimizer(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, warmup_steps=0)
    again.load(tmp_path / "ck")
    _assert_same_steps(_train(again, ids, mask, 2), _train(ours, ids, mask, 2))


@pytest.mark.parametrize("distributed_optimizer", [True, False])
def test_offload_frees_memory_and_reload_restores(tmp_path, assets, distributed_optimizer):
    """Offload frees params, grads and Adam state; after reload the logits are the same and a step equals
    a twin's that never moved (DDP's grad hooks and the optimizer's views of the buffers survive)."""
    from reroll.strategies.megatron import MegatronStrategy

    cfg = _cfg(tmp_path, assets, f"strategy.megatron.distributed_optimizer={distributed_optimizer}")
    ids, mask = _batch()
    twin = [MegatronStrategy(str(assets["model"]), cfg=cfg, device="cuda") for _ in range(2)]
    for s in twin:
        s.configure_optimizer(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0, warmup_steps=0)
        _train(s, ids, mask, 1)
    moved, kept = twin
    with torch.no_grad():
        before = moved.logits(ids, mask)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    moved.offload()
    param_bytes = sum(p.numel() * p.element_size() for p in moved.module.parameters())
    freed = allocated - torch.cuda.memory_allocated()
    assert freed >= 2 * param_bytes, (freed, param_bytes)  # params, grads, Adam state: about 4x
    moved.reload()
    with torch.no_grad():
        after = moved.logits(ids, mask)
    assert torch.equal(after, before), float((after - before).abs().max())
    _assert_same_steps(_train(moved, ids, mask, 1), _train(kept, ids, mask, 1))


def test_qwen25_05b_shaped_round_trip_and_logits():
    """A random-init Qwen2.5-0.5B-shaped model: HF -> Megatron -> HF is exact (also through TP=2
    shards); the GPTModel holding the converted weights gives HF's fp32 logits."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from transformers import AutoModelForCausalLM, Qwen2Config

    from reroll.models import megatron_convert as mc

    config = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    s = mc.gpt_shape(config)
    state = hf.state_dict()
    full = mc.hf_to_megatron(state, s)
    back = mc.megatron_to_hf(mc.merge([mc.shard(full, s, r, 2) for r in range(2)]), s)
    assert back.keys() == state.keys() and all(torch.equal(back[k], v) for k, v in state.items())

    _one_rank_groups()
    gpt = GPTModel(
        mc.transformer_config(s, params_dtype=torch.float32),
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        **mc.gpt_model_kwargs(s, 1),
    )
    gpt = gpt.cuda().eval()  # without Apex, the local spec's torch.nn.RMSNorm weights are built on the CPU
    extra = {k: v for k, v in gpt.state_dict().items() if k.endswith("_extra_state")}
    gpt.load_state_dict(full | extra, strict=True)
    ids = torch.randint(0, 151936, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    causal = torch.triu(torch.ones(64, 64, dtype=torch.bool, device="cuda"), 1)[None, None]
    with torch.no_grad():
        ours = gpt(ids, torch.arange(64, device="cuda").expand(2, 64), causal)
        theirs = hf(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=1e-3)
    assert ps.get_tensor_model_parallel_world_size() == 1


def _one_rank_groups() -> None:
    """megatron-core's groups over this process alone (as MegatronStrategy sets them up for one rank)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1)
        tensor_parallel.model_parallel_cuda_manual_seed(0)


def _two_ranks_equal_torch(tmp_path, assets, rank_fn, *, shared_rows: bool = False) -> None:
    """``rank_fn`` on two GPUs, each rank given half the rows (``shared_rows``: both every row, as a
    context-parallel group's ranks), against the torch strategy on the whole batch: the losses (summed
    over the halves) and the grad norm within rel 1e-4, both ranks' gathered weights equal to each
    other and within 1e-4 of the torch strategy's (the TP=2, PP=2 and CP=2 tests)."""
    import torch.multiprocessing as mp

    from reroll.strategies.torch_strategy import TorchStrategy

    cfg_path = write_config(
        tmp_path / "c.yaml", assets, model={"path": str(assets["model"]), "dtype": "float32"}
    )
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{so.getsockname()[1]}"
    mp.start_processes(rank_fn, args=(address, str(cfg_path), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    ref = TorchStrategy(str(assets["model"]), cfg=load_config(cfg_path, RunConfig), device="cuda")
    ref.configure_optimizer(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, warmup_steps=2)
    ids, mask = _batch()
    expected = _train(ref, ids, mask, 3, micro=8)
    for i, (loss, norm) in enumerate(expected):
        losses = [r["steps"][i][0] for r in ranks]
        got = losses if shared_rows else [sum(losses)]  # shared rows: each rank the whole loss
        assert all(x == pytest.approx(loss, rel=1e-4) for x in got), (losses, loss)
        assert ranks[0]["steps"][i][1] == ranks[1]["steps"][i][1] == pytest.approx(norm, rel=1e-4)
    for k, v in ref.full_state_dict().items():
        assert torch.equal(ranks[0]["weights"][k], ranks[1]["weights"][k]), k
        torch.testing.assert_close(ranks[0]["weights"][k], v, atol=1e-4, rtol=0)


def _rank_of_two(rank: int, address: str, cfg_path: str, *parallel: str):
    """This process as Megatron rank ``rank`` of two on GPU ``rank`` (``parallel``: the layout's
    overrides), its optimizer configured as the torch strategy's in ``_two_ranks_equal_torch``."""
    from reroll.strategies.megatron import MegatronStrategy

    torch.cuda.set_device(rank)
    cfg = load_config(cfg_path, RunConfig, ["strategy.name=megatron", *parallel])
    s = MegatronStrategy(cfg.model.path, cfg=cfg, device=f"cuda:{rank}", rank=rank, world_size=2)
    s.init_distributed(address)
    s.configure_optimizer(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, warmup_steps=2)
    return s


def _half_batch_steps(s, rank: int, result_dir: str) -> None:
    """Three optimizer steps of rank ``rank`` of two on its half of ``_batch()``'s rows (token mean over
    the whole batch), saved with the gathered weights for ``_two_ranks_equal_torch``. Under context
    parallelism both ranks take every row, and each rank's columns' logits are gathered as the worker
    gathers them."""
    ids, mask = _batch()
    half = slice(0, 4) if rank == 0 else slice(4, 8)  # the role splits rows over all ranks
    if s.context_parallel is not None:  # ... but a context-parallel group's ranks get the same rows
        half = slice(0, 8)
    width = int(mask[half].sum(-1).max())
    ids, mask = ids[half, :width], mask[half, :width]
    n_tokens = _batch()[1][:, 1:].sum()
    out = []
    for _ in range(3):
        logits = s.logits(ids, mask)
        if s.context_parallel is not None:  # this rank's columns: the group's gathered
            logits = s.context_parallel.gather(logits, ids.shape[1])
        loss = -(token_logprobs(logits, ids.to(logits.device)) * mask.to(logits.device)).sum() / n_tokens
        s.backward(loss)
        out.append((float(loss), s.step(1.0)["grad_norm"]))
    torch.save({"steps": out, "weights": s.full_state_dict()}, f"{result_dir}/rank{rank}.pt")


def _tp2_rank(rank: int, address: str, cfg_path: str, result_dir: str) -> None:
    s = _rank_of_two(rank, address, cfg_path, "strategy.megatron.tensor_parallel=2")
    _half_batch_steps(s, rank, result_dir)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP=2 needs two GPUs")
def test_tp2_equals_torch_on_the_whole_batch(tmp_path, assets):
    """Two TP ranks, each given half the rows: summed losses, grad norms and weights equal the torch
    strategy's on the whole batch (CPU dev run over gloo: loss exact, norm rel 1e-7, weights 2e-5)."""
    _two_ranks_equal_torch(tmp_path, assets, _tp2_rank)


def _tp2_sp_rank(rank: int, address: str, cfg_path: str, result_dir: str) -> None:
    sp = ("strategy.megatron.tensor_parallel=2", "strategy.megatron.sequence_parallel=true")
    s = _rank_of_two(rank, address, cfg_path, *sp)
    assert s.module.decoder.final_layernorm.weight.sequence_parallel  # the local spec's SP norm
    _half_batch_steps(s, rank, result_dir)


@pytest.mark.multigpu(gpus=2)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP=2 needs two GPUs")
def test_tp2_with_sequence_parallel_equals_torch_on_the_whole_batch(tmp_path, assets):
    """As the TP=2 test, with sequence parallelism on the local spec (no Transformer Engine; on CPU over
    gloo TP=2 with SP equals one rank: tests/integration/test_megatron_sequence_parallel.py)."""
    _two_ranks_equal_torch(tmp_path, assets, _tp2_sp_rank)


def _cp2_rank(rank: int, address: str, cfg_path: str, result_dir: str, *more: str) -> None:
    s = _rank_of_two(rank, address, cfg_path, "strategy.megatron.context_parallel=2", *more)
    assert s.context_parallel is not None and s.dp == 1
    _half_batch_steps(s, rank, result_dir)


def _cp2_recomputed_rank(rank: int, address: str, cfg_path: str, result_dir: str) -> None:
    _cp2_rank(rank, address, cfg_path, result_dir, "model.gradient_checkpointing=true")


@pytest.mark.multigpu(gpus=2)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="CP=2 needs two GPUs")
@pytest.mark.parametrize("rank_fn", [_cp2_rank, _cp2_recomputed_rank], ids=["cp2", "cp2-recomputed"])
def test_cp2_equals_torch_on_the_whole_batch(tmp_path, assets, rank_fn):
    """Two context-parallel ranks (Ulysses in the core attention, no Transformer Engine; one of the two
    heads each), both given every row, each running half of every row's tokens, and the same with every
    layer recomputed in backward (its all-to-alls run again there: Megatron's recompute needs CUDA's RNG
    state, so this is checked on GPUs only): each rank's loss, the grad norms and weights equal the
    torch strategy's on the whole batch, to the TP=2 test's tolerances (on CPU over gloo CP=2 equals one
    Megatron rank bit for bit in losses and norms: tests/integration/test_megatron_context.py)."""
    _two_ranks_equal_torch(tmp_path, assets, rank_fn, shared_rows=True)


def _quickstart_30(tmp_path, strategy: str) -> tuple[float, float, str]:
    """The quickstart cut to 30 GRPO steps in one process on the GPU: the mean training reward of the
    first 5 and of the last 10 steps, and the log's tail. (Held-out greedy accuracy after 30 steps is
    too noisy to compare two runs by: on the H200, torch went 0.312 -> 0.284 -> 0.49 at steps 0/10/30
    and megatron 0.412 -> 0.45 -> 0.43, while their training rewards rose alike, 0.13 -> 0.21.)"""
    assets, runs = tmp_path / "assets", tmp_path / strategy
    overrides = [
        f"output_dir={runs}/{{name}}",
        f"model.path={assets}/tiny-arithmetic",
        f"data.train_files=[{assets}/arithmetic/train.jsonl]",
        f"data.eval_files=[{assets}/arithmetic/test.jsonl]",
        "total_steps=30",
        "eval.every=0",
        "checkpoint.every=0",
        "runtime.backend=local",
        f"strategy.name={strategy}",
        "roles.actor_train.num_gpus_per_worker=1",
        "roles.actor_infer.num_gpus_per_worker=1",
    ]
    command = [sys.executable, "-m", "reroll.cli", "train", str(QUICKSTART), *overrides]
    out = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stdout + out.stderr
    assert "step 30/30 | reward" in log, log[-3000:]
    assert (runs / "quickstart" / "checkpoints" / "step_000030" / "model" / "config.json").exists()
    rows = [r for r in read_metrics(runs / "quickstart") if r["step"] > 0]
    first = sum(r["rollout/reward_mean"] for r in rows[:5]) / 5
    last = sum(r["rollout/reward_mean"] for r in rows[-10:]) / 10
    return first, last, log[-1500:]


@pytest.mark.slow
def test_quickstart_shaped_run_with_megatron_learns_as_torch(tmp_path):
    """The quickstart (SFT warm start, then 30 GRPO steps) with the policy in Megatron-Core: its training
    reward rises, and ends within 0.05 of the torch strategy's run on the same GPU."""
    torch_first, torch_last, torch_log = _quickstart_30(tmp_path, "torch")
    first, last, log = _quickstart_30(tmp_path, "megatron")
    numbers = f"training reward, first 5 -> last 10 steps: torch {torch_first:.3f} -> {torch_last:.3f}, megatron {first:.3f} -> {last:.3f}"
    print(numbers)
    assert last >= torch_last - 0.05, f"{numbers}\n--- megatron log\n{log}\n--- torch log\n{torch_log}"
    assert last - first >= 0.03, numbers


# -- a Qwen2.5-0.5B shape and a small Qwen3-MoE, random-init, built locally (nothing downloaded) ----------


def _save_random(config, path, seed: int = 0) -> str:
    """A random-init causal LM of ``config`` saved in fp32 at ``path`` (what the strategies load)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return str(path)


def _small_moe_config(experts: int = 8):
    """A small Qwen3-MoE: 4 layers, ``experts`` experts, top-2 with renormalised top-k probabilities (as
    Qwen3-30B-A3B), q/k norm, untied head."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
        num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
        tie_word_embeddings=False,
    )  # fmt: skip


def _train_routed(strategy, routers, ids, mask, steps: int, micro: int, coef: float, total_rows: int):
    """``_train`` plus the trainer's router term (``reroll.roles.trainer.TrainerWorker.train``): each
    micro-batch's load-balancing loss times ``coef`` and its share of the step's ``total_rows`` joins its
    loss. Returns per step ``(loss with the router term, grad norm, router_aux_loss, expert_load_max)``."""
    from reroll.models.moe import StepRouting

    n_tokens = mask[:, 1:].sum()
    out = []
    for _ in range(steps):
        total, routing = 0.0, StepRouting(routers, coef)
        for start in range(0, len(ids), micro):
            i, m = ids[start : start + micro], mask[start : start + micro]
            with routers.capture() as routed:
                logits = strategy.logits(i, m)
            loss = -(token_logprobs(logits, i.to(logits.device)) * m.to(logits.device)).sum() / n_tokens
            loss = loss + routing.term(routed, len(i) / total_rows).to(loss.device)
            strategy.backward(loss)
            total += float(loss)
        metrics = routing.metrics("actor")
        norm = strategy.step(1.0)["grad_norm"]
        out.append((total, norm, metrics["actor/router_aux_loss"], metrics["actor/expert_load_max"]))
    return out


def test_qwen25_05b_shape_fp32_trains_as_the_torch_strategy(tmp_path, assets):
    """A random-init Qwen2.5-0.5B shape (24 layers, vocabulary 151936), fp32, TP=1: four optimizer steps
    (two micro-batches each, lr 1e-5, weight decay 0.1) give the torch strategy's losses and grad norms.

    Tolerance, from the math: both start from the same weights, so step 0 differs only by the order of
    fp32 sums (fused qkv and gate/up, Megatron's own attention): a 2-layer model on CPU differed by rel
    1.4e-5 in the loss and 1e-5 in the grad norm; errors add up over 24 layers, so 2e-4 for the loss and
    1e-3 for the grad norm. After an Adam step the weights differ by up to lr (1e-5)
    where a gradient is near zero and its sign is noise; those weights barely move the loss (their
    gradient is ~0), so later losses stay within rel 1e-3 and grad norms within 1e-2."""
    from benchmarks.grpo_step import QWEN25_05B, qwen2_config

    path = _save_random(qwen2_config(QWEN25_05B, 151936, max_position_embeddings=512), tmp_path / "m")
    cfg = _cfg(tmp_path, assets, "model.dtype=float32")
    ids, mask = _batch(rows=8, width=64, vocab=151936)
    from reroll.strategies.megatron import MegatronStrategy
    from reroll.strategies.torch_strategy import TorchStrategy

    results = []
    for make in (TorchStrategy, MegatronStrategy):  # one at a time: 8 GB of weights and Adam state each
        s = make(path, cfg=cfg, device="cuda")
        s.configure_optimizer(lr=1e-5, betas=(0.9, 0.99), weight_decay=0.1, warmup_steps=0)
        results.append(_train(s, ids, mask, 4))
        del s
        torch.cuda.empty_cache()
    expected, got = results
    print("torch", expected, "\nmegatron", got)
    assert got[0][0] == pytest.approx(expected[0][0], rel=2e-4)
    assert got[0][1] == pytest.approx(expected[0][1], rel=1e-3)
    for (loss, norm), (loss_e, norm_e) in zip(got[1:], expected[1:]):
        assert loss == pytest.approx(loss_e, rel=1e-3) and norm == pytest.approx(norm_e, rel=1e-2)
    assert expected[-1][0] < expected[0][0]  # the steps trained (the comparison is not of a still model)


def test_small_moe_ep1_fp32_trains_as_the_torch_strategy(tmp_path, assets):
    """A small Qwen3-MoE (8 experts, top-2), fp32, EP=1: four steps with the router's load-balancing
    term (coef 0.01, reroll's own loss on the logits Megatron's routers give) match the torch strategy
    on the Hugging Face model: loss (with the router term), grad norm, router_aux_loss and the experts'
    load.

    Tolerance: as the dense test (step 0: summation order only, rel 1e-4 loss, 1e-3 grad norm; a 2-layer
    4-expert MoE on CPU through this strategy matched the torch strategy to rel 1e-7 in loss, grad norm,
    router loss and expert load over 3 steps at lr 1e-3). Later,
    the lr (1e-5) bounds how far Adam's noise moves a router logit (~1e-5 x sqrt(256) x |x| ~ 1e-3), so
    a token whose top-2 choice sits within that of a tie may route differently; with 8 rows x 48 tokens x
    4 layers that is rare and moves one token's output: rel 2e-3 on the loss, 2e-2 on the grad norm;
    router_aux_loss rel 2e-3 (one moved assignment of ~400 changes E x f x P by ~8 x 1/400 x 0.1); the expert-load maximum (a share of a layer's
    top-k assignments, times k) within 2 moved assignments."""
    from reroll.models.moe import Routers
    from reroll.strategies.megatron import MegatronStrategy
    from reroll.strategies.torch_strategy import TorchStrategy

    path = _save_random(_small_moe_config(), tmp_path / "moe")
    cfg = _cfg(tmp_path, assets, "model.dtype=float32")
    ids, mask = _batch(rows=8, width=48, vocab=2048)
    assignments = int(mask.sum()) * 2  # a layer's top-2 assignments over the step's real tokens
    results = []
    for make in (TorchStrategy, MegatronStrategy):
        s = make(path, cfg=cfg, device="cuda")
        s.configure_optimizer(lr=1e-5, betas=(0.9, 0.99), weight_decay=0.1, warmup_steps=0)
        routers = s.moe_routers if make is MegatronStrategy else Routers.of(s.model)
        assert routers is not None and len(routers.modules) == 4
        results.append(_train_routed(s, routers, ids, mask, 4, micro=4, coef=0.01, total_rows=8))
        del s
    expected, got = results
    print("torch", expected, "\nmegatron", got)
    assert got[0][0] == pytest.approx(expected[0][0], rel=1e-4)
    assert got[0][1] == pytest.approx(expected[0][1], rel=1e-3)
    for (loss, norm, aux, load), (loss_e, norm_e, aux_e, load_e) in zip(got, expected):
        assert loss == pytest.approx(loss_e, rel=2e-3) and norm == pytest.approx(norm_e, rel=2e-2)
        assert aux == pytest.approx(aux_e, rel=2e-3)
        assert load == pytest.approx(load_e, abs=2 * 2 / assignments)
    assert expected[-1][0] < expected[0][0]


def test_small_moe_full_state_dict_save_and_export_round_trip(tmp_path, assets):
    """The MoE's full_state_dict (what weight sync sends) has the Hugging Face names and shapes, equals
    the checkpoint before training, and after a step the exported model/ holds what was trained."""
    from transformers import AutoModelForCausalLM

    from reroll.strategies.megatron import MegatronStrategy

    path = _save_random(_small_moe_config(), tmp_path / "moe")
    cfg = _cfg(tmp_path, assets, "model.dtype=float32")
    s = MegatronStrategy(path, cfg=cfg, device="cuda")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    ours = s.full_state_dict()
    assert ours.keys() == hf.keys()
    assert all(torch.equal(ours[k], v) for k, v in hf.items())
    s.configure_optimizer(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0, warmup_steps=0)
    ids, mask = _batch(rows=8, width=48, vocab=2048)
    _train(s, ids, mask, 1)
    s.save(tmp_path / "ck", with_optimizer=True)
    exported = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ck" / "model", dtype=torch.float32
    ).state_dict()
    trained = s.full_state_dict()
    assert not torch.equal(
        trained["model.layers.0.mlp.experts.gate_up_proj"], hf["model.layers.0.mlp.experts.gate_up_proj"]
    )
    assert all(torch.equal(exported[k], v) for k, v in trained.items())


# -- two GPUs: pipeline and expert parallelism (the TP=2 test is above) ---------------------------------


def _pp2_scheduled_rank(rank: int, address: str, cfg_path: str, result_dir: str, *more: str) -> None:
    """``_half_batch_steps`` through ``train_micro_batches``, one-row micro-batches scheduled 1F1B over the
    two stages (NCCL's point-to-point), then a forward-only pass scheduled and (but under a virtual
    pipeline, which runs only scheduled) one after the other. ``more``: further overrides."""
    import reroll.strategies.megatron_pipeline as pipeline
    from reroll.strategies.micro_batches import MicroBatchLoop

    calls, run = [], pipeline.run_schedule
    pipeline.run_schedule = lambda *a, **k: calls.append(k["forward_only"]) or run(*a, **k)
    s = _rank_of_two(rank, address, cfg_path, "strategy.megatron.pipeline_parallel=2", *more)
    ids, mask = _batch()
    n_tokens = mask[:, 1:].sum()
    mbs = [
        _Rows(ids[r : r + 1, : int(mask[r].sum())], mask[r : r + 1, : int(mask[r].sum())]) for r in range(8)
    ]
    mbs = mbs[:4] if rank == 0 else mbs[4:]  # the role splits rows over all ranks

    def loss_of(mb):
        logits = s.logits(mb.input_ids, mb.attention_mask)
        on = lambda t: t.to(logits.device)  # noqa: E731
        loss = -(token_logprobs(logits, on(mb.input_ids)) * on(mb.attention_mask)).sum() / on(n_tokens)
        return loss, float(loss)

    def scored(mb):
        logits = s.logits(mb.input_ids, mb.attention_mask)
        return token_logprobs(logits, mb.input_ids.to(logits.device)).cpu()

    out = []
    for step in range(3):
        losses = s.train_micro_batches(mbs, loss_of)
        out.append((sum(losses), s.step(1.0)["grad_norm"]))
        if step == 0 and s.vp > 1:  # offload moves every model chunk's parameters, grads and Adam state
            _offload_frees_every_chunk(s)
    with torch.no_grad():
        scheduled = s.score_micro_batches(mbs, scored)
        one_by_one = MicroBatchLoop.score_micro_batches(s, mbs, scored) if s.vp == 1 else scheduled
    assert calls == [False, False, False, True], calls  # the schedule ran
    for a, b in zip(scheduled, one_by_one):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)  # the same rows, kernels: a few fp32 ulps of ~3
    torch.save({"steps": out, "weights": s.full_state_dict()}, f"{result_dir}/rank{rank}.pt")


def _offload_frees_every_chunk(s) -> None:
    """``offload`` frees at least twice every model chunk's parameter bytes (params, grads, Adam state:
    about 4x), and ``reload`` brings them back (the steps after it are checked against the torch
    strategy's)."""
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    s.offload()
    param_bytes = sum(p.numel() * p.element_size() for chunk in s.chunks for p in chunk.parameters())
    freed = allocated - torch.cuda.memory_allocated()
    assert freed >= 2 * param_bytes, (freed, param_bytes)
    s.reload()


@dataclass(frozen=True)
class _Rows:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


@pytest.mark.multigpu(gpus=2)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="PP=2 needs two GPUs")
def test_pp2_scheduled_equals_torch_on_the_whole_batch(tmp_path, assets):
    """``test_pp2_equals_torch_on_the_whole_batch`` with each rank's rows as four one-row micro-batches run
    by the 1F1B schedule (``MegatronStrategy.train_micro_batches``; the last stage computes both ranks'
    losses): the same tolerances (gradients accumulated over micro-batches differ from the torch strategy's
    whole batch by summation order only). On CPU over gloo the schedule equals the micro-batches one after
    the other bit for bit (tests/integration/test_megatron_pipeline.py)."""
    _two_ranks_equal_torch(tmp_path, assets, _pp2_scheduled_rank)


def _pp2_vpp2_rank(rank: int, address: str, cfg_path: str, result_dir: str) -> None:
    _pp2_scheduled_rank(rank, address, cfg_path, result_dir, "strategy.megatron.virtual_pipeline=2")


@pytest.mark.multigpu(gpus=2)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="PP=2 x VPP=2 needs two GPUs")
def test_pp2_vpp2_scheduled_equals_torch_on_the_whole_batch(tmp_path, assets):
    """``test_pp2_scheduled_equals_torch_on_the_whole_batch`` with two model chunks a stage (a 4-layer
    model: stage 0 holds layers 0 and 2, stage 1 layers 1 and 3), run by Megatron-Core's interleaved
    schedule over NCCL (each micro-batch at its own shape, ``known_shapes_exchange``; tensors sent unbatched), a
    forward-only pass scheduled too, offload and reload after the first step freeing every chunk's
    state: the same tolerances (the torch strategy's whole batch differs by
    summation order only). On CPU over gloo PP=2 x VPP=2 trains as PP=2 and as one rank within rounding
    (tests/integration/test_megatron_virtual_pipeline.py)."""
    from reroll.data.arithmetic import ARITHMETIC_ALPHABET
    from reroll.models.tiny import build_tiny_model

    model = build_tiny_model(
        tmp_path / "four_layers", alphabet=ARITHMETIC_ALPHABET, hidden_size=64, num_layers=4, num_heads=2
    )
    (tmp_path / "run").mkdir()
    _two_ranks_equal_torch(tmp_path / "run", {**assets, "model": Path(model)}, _pp2_vpp2_rank)


def _pp2_rank(rank: int, address: str, cfg_path: str, result_dir: str) -> None:
    s = _rank_of_two(rank, address, cfg_path, "strategy.megatron.pipeline_parallel=2")
    layers = {n.split(".")[2] for n, _ in s.module.named_parameters() if n.startswith("decoder.layers.")}
    assert layers == {"0"}, layers  # one of the two layers on each stage
    _half_batch_steps(s, rank, result_dir)


@pytest.mark.multigpu(gpus=2)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="PP=2 needs two GPUs")
def test_pp2_equals_torch_on_the_whole_batch(tmp_path, assets):
    """Two pipeline stages (one layer each; the tied embedding's copy on the last stage), each rank given
    half the rows: summed losses, grad norms and the weights gathered from both stages equal the torch
    strategy's on the whole batch, to the TP=2 test's tolerances (on CPU over gloo two stages equal one
    Megatron rank bit for bit: tests/integration/test_megatron_pipeline.py)."""
    _two_ranks_equal_torch(tmp_path, assets, _pp2_rank)


def _moe2_rank(
    rank: int,
    address: str,
    model_path: str,
    cfg_path: str,
    result_dir: str,
    size: str,
    scheduled: bool = False,
) -> None:
    from reroll.strategies.megatron import MegatronStrategy

    torch.cuda.set_device(rank)
    sizes = [f"strategy.megatron.{x}" for x in size.split(",")]
    cfg = load_config(cfg_path, RunConfig, ["strategy.name=megatron", *sizes, "model.dtype=float32"])
    s = MegatronStrategy(model_path, cfg=cfg, device=f"cuda:{rank}", rank=rank, world_size=2)
    s.init_distributed(address)
    s.configure_optimizer(lr=1e-5, betas=(0.9, 0.99), weight_decay=0.1, warmup_steps=0)
    mine = [n for n, _ in s.module.named_parameters() if n.startswith("decoder.layers.0.mlp.experts.")]
    layers = {n.split(".")[2] for n, _ in s.module.named_parameters() if n.startswith("decoder.layers.")}
    if "virtual_pipeline=2" in size:  # two model chunks of one layer each, every expert in both
        held = [n for n, _ in s.module.named_parameters() if ".mlp.experts." in n]
        assert len(held) == 2 * 8 * 2 and len(s.moe_routers.modules) == 2, held
    elif size == "expert_parallel=2":
        assert len(mine) == 4 * 2, mine  # this rank's 4 of the 8 experts, fc1 and fc2 each
    elif size.startswith("tensor_parallel=2"):  # every expert, each split over the TP ranks
        assert len(mine) == 8 * 2 and s.moe_routers.split.columns is not None, mine
    else:
        assert len(mine) == 8 * 2 and layers == {"0", "1"}, (mine, layers)  # 2 of the 4 layers
    ids, mask = _batch(rows=8, width=48, vocab=2048)
    n_tokens = mask[:, 1:].sum()
    half = slice(0, 4) if rank == 0 else slice(4, 8)  # the role splits rows over all ranks
    ids, mask = ids[half], mask[half]
    train = _train_routed_scheduled if scheduled else _train_routed_ranked
    steps = train(s, ids, mask, n_tokens)
    torch.save({"steps": steps, "weights": s.full_state_dict()}, f"{result_dir}/rank{rank}.pt")


def _train_routed_scheduled(s, ids, mask, n_tokens, steps: int = 3, coef: float = 0.01):
    """``_train_routed_ranked`` through ``train_micro_batches`` with the router term handed over
    (``RouterLoss``): the stages run it by the 1F1B schedule, each adding its routers' part
    (``ScheduledRouting``); the loss reported is the rank's next-token loss plus its router loss times
    its share, what the one-by-one rank reports summed over the ranks."""
    import reroll.strategies.megatron_pipeline as pipeline
    from reroll.models.moe import StepRouting
    from reroll.strategies.micro_batches import RouterLoss

    calls, run = [], pipeline.run_schedule
    pipeline.run_schedule = lambda *a, **k: calls.append(k["forward_only"]) or run(*a, **k)

    def loss_of(mb):
        logits = s.logits(mb.input_ids, mb.attention_mask)
        on = lambda t: t.to(logits.device)  # noqa: E731
        loss = -(token_logprobs(logits, on(mb.input_ids)) * on(mb.attention_mask)).sum() / on(n_tokens)
        return loss, float(loss)

    out = []
    for _ in range(steps):
        routing = StepRouting(s.moe_routers, coef)
        (ce,) = s.train_micro_batches([_Rows(ids, mask)], loss_of, RouterLoss(routing, [0.5]))
        norm = s.step(1.0)["grad_norm"]
        out.append((ce + coef * routing.metrics("actor")["actor/router_aux_loss"] * 0.5, norm))
    assert calls == [False] * steps, calls  # the schedule ran
    return out


def _train_routed_ranked(s, ids, mask, n_tokens, steps: int = 3, coef: float = 0.01):
    """One micro-batch per rank and step, the loss normalised by the whole batch's tokens and the router
    term by this rank's share (half the rows): what the trainer does on each of two ranks."""
    from reroll.models.moe import StepRouting

    out = []
    for _ in range(steps):
        routing = StepRouting(s.moe_routers, coef)
        with s.moe_routers.capture() as routed:
            logits = s.logits(ids, mask)
        loss = -(token_logprobs(logits, ids.to(logits.device)) * mask.to(logits.device)).sum() / n_tokens
        loss = loss + routing.term(routed, 0.5).to(loss.device)
        s.backward(loss)
        out.append((float(loss), s.step(1.0)["grad_norm"]))
    return out


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="expert parallelism over 2 ranks needs two GPUs")
def test_moe_ep2_equals_torch_on_the_whole_batch(tmp_path, assets):
    """Two ranks at EP=2 (4 of 8 experts each; data parallel 2), each given half the rows: summed losses
    (router term included), grad norms and the gathered weights equal the torch strategy's on the whole
    batch in two micro-batches (rel 1e-4 on step 0, 2e-3 later, as the EP=1 test; weights 1e-4 after
    3 steps at lr 1e-5)."""
    _moe_two_ranks_equal_torch(tmp_path, assets, "expert_parallel=2")


@pytest.mark.multigpu(gpus=2)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two pipeline stages of a MoE need two GPUs")
def test_moe_pp2_equals_torch_on_the_whole_batch(tmp_path, assets):
    """As the EP=2 test, on two pipeline stages of 2 layers each (every expert on both): each stage
    routes both ranks' rows through its layers, and each rank's router loss is its own rows' over every
    layer (``SplitRouted``); same tolerances."""
    _moe_two_ranks_equal_torch(tmp_path, assets, "pipeline_parallel=2")


@pytest.mark.multigpu(gpus=2)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two pipeline stages of a MoE need two GPUs")
def test_moe_pp2_scheduled_equals_torch_on_the_whole_batch(tmp_path, assets):
    """As the PP=2 test, the step run by the 1F1B schedule with the router term handed to the strategy
    (each stage adds its part; the top-k counts gathered over the stages on a second NCCL communicator
    while the schedule's point-to-point goes on: this checks it does not hang); same tolerances."""
    _moe_two_ranks_equal_torch(tmp_path, assets, "pipeline_parallel=2", scheduled=True)


@pytest.mark.multigpu(gpus=2)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two pipeline stages of a MoE need two GPUs")
def test_moe_pp2_vpp2_scheduled_equals_torch_on_the_whole_batch(tmp_path, assets):
    """As the scheduled PP=2 test, with two model chunks a stage (one layer each) run by the interleaved
    schedule: each chunk adds its routers' part, the top-k counts of every chunk gathered after its
    forward while the schedule's point-to-point goes on (this checks it does not hang over NCCL); one
    micro-batch a rank, so the schedule runs a one-token filler beside it, without the router term; same
    tolerances (on CPU over gloo it trains as PP=2: tests/integration/test_megatron_virtual_pipeline.py)."""
    _moe_two_ranks_equal_torch(tmp_path, assets, "pipeline_parallel=2,virtual_pipeline=2", scheduled=True)


@pytest.mark.multigpu(gpus=2)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a MoE at TP=2 needs two GPUs")
def test_moe_tp2_with_sequence_parallel_equals_torch_on_the_whole_batch(tmp_path, assets):
    """As the EP=2 test, at TP=2 with sequence parallelism (each rank routes its half of the sequence of
    both ranks' rows; each rank's router loss is its own rows' over every column: ``SplitRouted``); same
    tolerances (on CPU over gloo it equals one rank: tests/integration/test_megatron_sequence_parallel.py)."""
    _moe_two_ranks_equal_torch(tmp_path, assets, "tensor_parallel=2,sequence_parallel=true")


def _moe_two_ranks_equal_torch(tmp_path, assets, size: str, scheduled: bool = False) -> None:
    import torch.multiprocessing as mp

    from reroll.models.moe import Routers
    from reroll.strategies.torch_strategy import TorchStrategy

    model_path = _save_random(_small_moe_config(), tmp_path / "moe")
    cfg_path = write_config(tmp_path / "c.yaml", assets, model={"path": model_path, "dtype": "float32"})
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{so.getsockname()[1]}"
    mp.start_processes(
        _moe2_rank,
        args=(address, model_path, str(cfg_path), str(tmp_path), size, scheduled),
        nprocs=2,
        start_method="spawn",
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    ref = TorchStrategy(model_path, cfg=load_config(cfg_path, RunConfig), device="cuda")
    ref.configure_optimizer(lr=1e-5, betas=(0.9, 0.99), weight_decay=0.1, warmup_steps=0)
    ids, mask = _batch(rows=8, width=48, vocab=2048)
    expected = _train_routed(ref, Routers.of(ref.model), ids, mask, 3, micro=4, coef=0.01, total_rows=8)
    for i, (loss, norm, _, _) in enumerate(expected):
        rel = 1e-4 if i == 0 else 2e-3
        assert ranks[0]["steps"][i][0] + ranks[1]["steps"][i][0] == pytest.approx(loss, rel=rel)
        assert ranks[0]["steps"][i][1] == ranks[1]["steps"][i][1] == pytest.approx(norm, rel=10 * rel)
    for k, v in ref.full_state_dict().items():
        assert torch.equal(ranks[0]["weights"][k], ranks[1]["weights"][k]), k
        torch.testing.assert_close(ranks[0]["weights"][k], v, atol=1e-4, rtol=0)


def test_first_layers_recomputed_train_as_none(tmp_path, assets):
    """fp32, TP=1: model.gradient_checkpointing 1 (the first of the 2 layers recomputed, Megatron's block
    method) and true give the losses and grad norms of no recompute: the recompute replays the same
    kernels on the same inputs, so equal up to rel 1e-6."""
    from reroll.strategies.megatron import MegatronStrategy

    ids, mask = _batch()
    results = {}
    for setting in (False, 1, True):
        cfg = _cfg(
            tmp_path, assets, "model.dtype=float32", f"model.gradient_checkpointing={str(setting).lower()}"
        )
        s = MegatronStrategy(str(assets["model"]), cfg=cfg, device="cuda")
        s.configure_optimizer(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, warmup_steps=2)
        results[setting] = _train(s, ids, mask, 2)
        del s
        torch.cuda.empty_cache()
    _assert_same_steps(results[1], results[False])
    _assert_same_steps(results[True], results[False])
