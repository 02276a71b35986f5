"""``reroll plan``'s per-GPU memory per phase: the phase's role alone where colocated roles offload, all
of them where they stay; the weight sync with the roles its transport holds at once."""

from __future__ import annotations

import pytest

from reroll.plan import plan
from tests.unit.test_placement import _cfg

SMALL = {"model.path": "Qwen/Qwen2.5-0.5B", "model.dtype": "bfloat16", "rollout.engine": "vllm"}


def _sections(text: str) -> tuple[dict[str, float], dict[str, str], dict[int, float]]:
    """(each role's peak, each phase's line after its name, each GPU's line) from a plan's text."""
    lines = text.splitlines()
    peaks = {
        line.split()[0]: float(line.split("ranks")[1].split("GiB")[0])
        for line in lines[lines.index("per role, per GPU at its peak:") + 1 :]
        if line.strip() and "ranks" in line
    }
    start = next(i for i, line in enumerate(lines) if line.startswith("per GPU, per phase"))
    phases = {}
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        name, _, rest = line.strip().partition("  ")
        phases[name] = rest.strip()
    gpus = {
        int(line.split()[1].rstrip(":")): float(line.split()[2])
        for line in lines
        if line.lstrip().startswith("gpu ")
    }
    return peaks, phases, gpus


def test_with_offloading_a_phase_holds_its_role_alone_and_the_busiest_is_the_gpus_peak(tmp_path):
    cfg = _cfg(tmp_path, **SMALL, **{"placement.devices": 2, "roles.actor_train.world_size": 2})
    text, fits = plan(cfg, gpus=2, gpu_memory_gib=80)
    peaks, phases, gpus = _sections(text)
    assert fits and "a phase holds its own roles" in text
    # actor_train on both GPUs; the engine and the reference (one rank each) on GPU 0 only
    assert phases["generate"] == f"{peaks['actor_infer']:.1f} GiB on gpu 0, 0.0 GiB on gpu 1  (actor_infer)"
    assert phases["reference log-probs"].startswith(
        f"{peaks['reference']:.1f} GiB on gpu 0, 0.0 GiB on gpu 1"
    )
    assert phases["train, old log-probs"] == f"{peaks['actor_train']:.1f} GiB on gpus 0-1  (actor_train)"
    assert gpus[0] == max(peaks.values())  # the busiest phase on GPU 0 is its per-GPU peak
    # the ipc sync holds the trainer's state and the awake engine at once, two buckets of 512 MiB each
    sync = phases["weight sync (ipc)"]
    held = float(sync.split(" GiB")[0])
    assert held > peaks["actor_infer"] + 1.0 and "host memory" not in sync


def test_without_offloading_every_phase_holds_every_role(tmp_path):
    cfg = _cfg(tmp_path, **SMALL, **{"placement.devices": 1, "placement.offload": "never"})
    text, _ = plan(cfg, gpus=1, gpu_memory_gib=80)
    peaks, phases, gpus = _sections(text)
    assert "colocated roles stay resident" in text
    total = sum(peaks.values())
    assert gpus[0] == pytest.approx(total, abs=0.11)
    for name in ("generate", "reference log-probs", "train, old log-probs"):
        assert phases[name].startswith(f"{gpus[0]:.1f} GiB on gpu 0"), (name, phases[name])


def test_an_engine_of_a_fixed_share_counts_at_the_share_it_takes(tmp_path):
    """vLLM takes ``gpu_memory_utilization`` of the GPU whatever its weights and batch need (its KV cache
    fills the rest): the plan counts that, so every role resident beside an engine of 0.6 needs 0.6 of
    the GPU and the trainers; an engine whose need is more than its share counts its need."""
    share = {"rollout.vllm.gpu_memory_utilization": 0.6}
    cfg = _cfg(tmp_path, **SMALL, **share, **{"placement.devices": 1, "placement.offload": "never"})
    peaks, _, gpus = _sections(plan(cfg, gpus=1, gpu_memory_gib=80)[0])
    assert peaks["actor_infer"] == pytest.approx(48.0)
    assert gpus[0] == pytest.approx(sum(peaks.values()), abs=0.11) and gpus[0] > 48.0
    tiny, _ = plan(cfg, gpus=1, gpu_memory_gib=1)  # 0.6 of 1 GiB is less than the weights (0.9)
    assert _sections(tiny)[0]["actor_infer"] > 0.9


def test_apart_the_engines_gpu_is_busy_only_while_generating_and_the_sync_is_a_broadcast(tmp_path):
    apart = {"placement.devices": 2, "roles.actor_infer.devices": "[1]", "algorithm.kl_coef": 0.0}
    text, _ = plan(_cfg(tmp_path, **SMALL, **apart), gpus=2, gpu_memory_gib=80)
    peaks, phases, _ = _sections(text)
    assert phases["generate"].startswith(f"0.0 GiB on gpu 0, {peaks['actor_infer']:.1f} GiB on gpu 1")
    assert phases["train, old log-probs"].startswith(
        f"{peaks['actor_train']:.1f} GiB on gpu 0, 0.0 GiB on gpu 1"
    )
    assert "weight sync (collective)" in phases
    assert "reference log-probs" not in phases  # no reference role: no phase for it


def test_an_ipc_sync_that_does_not_fit_says_it_goes_through_host_memory(tmp_path):
    cfg = _cfg(tmp_path, **SMALL, **{"placement.devices": 1})
    text, _ = plan(cfg, gpus=1, gpu_memory_gib=5)
    _, phases, _ = _sections(text)
    assert "this sync goes through host memory" in phases["weight sync (ipc)"]


def test_an_engine_merging_lora_adapters_counts_their_base_in_host_memory(tmp_path):
    """vLLM merges each adapter sync into the checkpoint's base weights, which it reads at its start
    and keeps in host memory: the model less its embedding, per engine (two here); an engine sent
    merged weights, or the hf engine (its own weights are the base), keeps none."""
    from reroll.models.shape import model_shape

    lora = {"strategy.lora.rank": 16, "placement.devices": 2, "roles.actor_infer.world_size": 2}
    text, _ = plan(_cfg(tmp_path, **SMALL, **lora), gpus=2, gpu_memory_gib=80)
    shape = model_shape(SMALL["model.path"])
    each = (shape.params - shape.vocab * shape.hidden) * 2 / 2**30  # bf16
    assert "actor_infer's LoRA base" in text and f"about {each:.1f} GiB x 2 engines" in text
    merged = _cfg(tmp_path, **SMALL, **lora, **{"strategy.lora.sync": "merged"})
    assert "LoRA base" not in plan(merged, gpus=2, gpu_memory_gib=80)[0]
    hf = _cfg(tmp_path, **{**SMALL, "rollout.engine": "hf"}, **lora)
    assert "LoRA base" not in plan(hf, gpus=2, gpu_memory_gib=80)[0]
