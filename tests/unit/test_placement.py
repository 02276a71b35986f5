"""The device map: where each rank sits, which roles are colocated, and the config checks."""

from __future__ import annotations

import math
import re
import time

import pytest
import torch

from reroll.config.loader import ConfigError
from reroll.config.placement import (
    device_map,
    engine_headroom,
    engine_may_stay,
    scaled_peak,
    trainer_strategy,
)
from reroll.pipelines.residency import ENGINE_AWAKE_OOM
from reroll.runtime.placement import Colocation, ResourceManager
from tests.conftest import small_config


def _cfg(tmp_path, **overrides):
    return small_config(tmp_path, *(f"{k}={v}" for k, v in overrides.items()))


def test_default_pool_colocates_every_model_role_on_device_0(tmp_path):
    cfg = _cfg(tmp_path, **{"placement.devices": 1})
    dmap = device_map(cfg, "cuda")
    assert dmap.ranks == {"actor_train": (0,), "actor_infer": (0,), "reference": (0,)}
    assert dmap.colocated("actor_train", "actor_infer")
    assert "cuda device 0: actor_train[0] actor_infer[0] reference[0]" in dmap.table()


def test_separate_devices_and_ranks_spread_in_contiguous_blocks(tmp_path):
    cfg = _cfg(
        tmp_path,
        **{
            "placement.devices": 4,
            "roles.actor_train.world_size": 4,
            "roles.actor_train.devices": "[0,1]",
            "roles.actor_infer.devices": "[2,3]",
            "roles.actor_infer.world_size": 2,
            "roles.reference.devices": "[0]",
        },
    )
    dmap = device_map(cfg, "cpu")
    assert dmap.ranks["actor_train"] == (0, 0, 1, 1)
    assert dmap.ranks["actor_infer"] == (2, 3)
    assert not dmap.colocated("actor_train", "actor_infer")
    assert dmap.colocated("actor_train", "reference")
    assert dmap.workers_on(0) == [("actor_train", 0), ("actor_train", 1), ("reference", 0)]


def test_bad_mappings_are_all_reported_with_the_fix(tmp_path):
    with pytest.raises(ConfigError) as e:
        _cfg(
            tmp_path,
            **{
                "placement.devices": 2,
                "roles.actor_infer.devices": "[1,2]",
                "roles.actor_train.world_size": 3,
                "roles.actor_train.devices": "[0,1]",
            },
        )
    text = str(e.value)
    assert "roles.actor_infer.devices" in text and "[2] are outside the pool of placement.devices=2" in text
    assert "roles.actor_train.devices" in text and "world_size (3) ranks cannot spread evenly" in text


def test_devices_without_a_pool_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"roles.actor_infer.devices.*needs placement.devices"):
        _cfg(tmp_path, **{"roles.actor_infer.devices": "[0]"})


class _Group:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def offload(self):
        self.log.append(f"offload {self.name}")

    def reload(self):
        self.log.append(f"reload {self.name}")


def test_colocation_offloads_only_roles_sharing_a_device_and_reloads_on_use(tmp_path):
    cfg = _cfg(
        tmp_path,
        **{"placement.devices": 2, "roles.reference.devices": "[1]"},
    )
    dmap = device_map(cfg, "cuda")
    log: list[str] = []
    groups = {r: _Group(log, r) for r in ("actor_train", "actor_infer", "reference")}
    col = Colocation(groups, dmap, offloads=True)
    col.use("actor_infer")
    assert log == ["offload actor_train"]  # the reference is on device 1: left alone
    col.use("reference")
    assert log == ["offload actor_train"]
    col.use("actor_train")
    assert log == ["offload actor_train", "offload actor_infer", "reload actor_train"]
    col.use("actor_train")  # already resident: nothing moves
    assert len(log) == 3
    assert set(col.pop_seconds()) == {"timing/offload", "timing/reload"}


def test_the_roles_let_stay_are_left_resident_while_they_fit(tmp_path):
    """At every eviction ``stays()`` names who stays resident: nothing before anything is measured, the
    engine alone where it fits beside the trainers' worst phase, everyone where all fit at once; the
    step's metrics say who stayed at their last eviction."""
    cfg = _cfg(tmp_path, **{"placement.devices": 1})
    log: list[str] = []
    groups = {r: _Group(log, r) for r in ("actor_train", "actor_infer", "reference")}
    col = Colocation(groups, device_map(cfg, "cuda"), offloads=True)
    everyone = {"actor_train", "actor_infer", "reference"}
    answers = iter([set(), set(), set(), {"actor_infer"}, everyone, everyone, everyone])
    asked: list[list[str]] = []
    col.let_stay(lambda: asked.append(list(log)) or next(answers))
    col.use("actor_infer")  # the engine's phase: the trainers leave
    assert log == ["offload actor_train", "offload reference"]
    col.use("reference")  # not measured yet: the engine sleeps
    assert log[2:] == ["offload actor_infer", "reload reference"]
    assert col.metrics() == {
        "placement/actor_train_stayed": 0.0,
        "placement/reference_stayed": 0.0,
        "placement/actor_infer_stayed": 0.0,
    }
    assert set(col.pop_seconds()) == {"timing/offload", "timing/reload"}
    col.use("actor_infer")
    assert log[4:] == ["offload reference", "reload actor_infer"]
    col.use("reference", "actor_train")  # the engine fits beside the worst phase: it stays awake
    assert log[6:] == ["reload reference", "reload actor_train"]
    assert "actor_infer" not in col.offloaded
    assert col.metrics()["placement/actor_infer_stayed"] == 1.0
    col.use("actor_infer")  # everyone fits at once: the trainers stay too
    col.use("reference")
    col.use("actor_train")
    assert log[8:] == [] and not col.offloaded
    assert set(col.metrics().values()) == {1.0}
    assert len(asked) == 7  # once per phase that would evict someone


def test_the_engine_fits_where_the_worst_phase_and_its_share_stay_under_90_percent():
    """Numbers of an 80 GB H100 (2026-12-05): the trainer's peak 45.8 GiB (6 GiB of it its state) and
    the reference's 8 GiB (1 GiB of weights). Phases run one trainer role at a time and an evicted role
    keeps its state alone, so the worst phase is the trainer's: 45.8 + 1 GiB beside the engine."""
    gib, total = 2**30, int(79.2 * 2**30)
    needs = [(int(45.8 * gib), 6 * gib), (8 * gib, 1 * gib)]
    fits = engine_headroom(needs, 0.2, total)
    assert fits == pytest.approx(5.64 * gib, rel=1e-3)  # 71.3 - 46.8 - 15.8 - 3 GiB of contexts
    short = engine_headroom(needs, 0.35, total)
    assert short == pytest.approx(-6.24 * gib, rel=1e-3)  # 0.35: the engine sleeps
    # the reference's peak while the trainer keeps its state: not the worst phase here
    assert engine_headroom([(8 * gib, 1 * gib)], 0.2, total) > fits
    # nothing moves only where both peaks fit beside the engine at once: not on this card, on an H200
    assert engine_headroom(needs, 0.2, total, resident=True) == pytest.approx(-1.36 * gib, rel=1e-2)
    h200 = int(140.4 * 2**30)  # 71.3 - 53.8 - 15.8 - 3 on the H100; 126.4 - 53.8 - 49.1 - 3 on the H200
    assert engine_headroom(needs, 0.35, h200, resident=True) == pytest.approx(20.4 * gib, rel=1e-2)
    assert engine_headroom([(0, 0), (7 * gib, gib)], 0.2, total) is None  # a role not measured yet
    assert engine_headroom([], 0.2, total) is None
    gb = 10**9
    # the part above the resting state grows with the rows' width; a narrower longest row keeps the peak
    assert scaled_peak(30 * gb, 10 * gb, widest=256, longest=512) == 50 * gb
    assert scaled_peak(30 * gb, 10 * gb, widest=512, longest=256) == 30 * gb
    assert scaled_peak(30 * gb, 10 * gb, widest=0, longest=256) == 0


def test_the_run_asks_every_trainer_colocated_with_the_engine_what_it_needs(tmp_path, capsys):
    """``Roles._staying``: the needs of the trainer roles on the engine's GPU, not of one elsewhere;
    a colocated role that cannot say what it needs keeps the engine sleeping."""
    from reroll.pipelines.roles import Roles

    class Measured(_Group):
        def __init__(self, log, name, need):
            super().__init__(log, name)
            self.need = need

        def memory_need(self):
            self.log.append(f"asked {self.name}")
            return self.need, 2**30, 80 * 2**30

    log: list[str] = []
    gib = 2**30

    def roles_with(train_gib: int, reference_gib: int, **placement) -> tuple[Roles, dict]:
        overrides = {"rollout.engine": "vllm", "rollout.vllm.gpu_memory_utilization": 0.35, **placement}
        cfg = _cfg(tmp_path, **overrides)
        groups = {
            "actor_train": Measured(log, "actor_train", train_gib * gib),
            "actor_infer": _Group(log, "actor_infer"),
            "reference": Measured(log, "reference", reference_gib * gib),
        }
        colocation = Colocation(groups, device_map(cfg, "cuda"), True)
        return Roles(cfg, {}, colocation=colocation), groups

    roles, groups = roles_with(40, 60, **{"placement.devices": 2, "roles.reference.devices": "[1]"})
    # one trainer beside the engine: its peak is the worst phase, so it keeps its cache too
    assert roles._staying() == {"actor_infer", "actor_train"}  # 40 + 0.35 x 80 + 2 GiB <= 72 GiB
    assert log == ["asked actor_train"]  # the reference on GPU 1 is not asked
    timings = roles.pop_timings()
    assert timings["placement/engine_headroom_gb"] == pytest.approx(2.0)
    assert timings["placement/resident_headroom_gb"] == pytest.approx(2.0)
    groups["actor_train"].need = 50 * gib
    assert roles._staying() == set()
    assert roles.pop_timings()["placement/engine_headroom_gb"] == pytest.approx(-8.0)
    out = capsys.readouterr().out  # once a run: what share would keep the engine awake
    assert "the vLLM engine sleeps" in out and "8.0 GiB short" in out
    assert "stay awake at a share of 0.25 or less" in out and out.count("\n") == 1  # 0.35 - 8 / 80
    roles._staying()
    assert capsys.readouterr().out == ""
    groups["actor_train"] = _Group(log, "actor_train")
    assert roles._staying() == set()
    # both trainers on the engine's GPU: the engine fits beside the worst phase (the trainer's peak,
    # the reference's 1 GiB of state), both peaks at once do not: the engine alone stays
    roles, _ = roles_with(39, 20, **{"placement.devices": 1})
    assert roles._staying() == {"actor_infer"}
    timings = roles.pop_timings()  # 72 - (38 + 2) - 28 - 3 and 72 - 59 - 28 - 3 GiB
    assert timings["placement/engine_headroom_gb"] == pytest.approx(1.0)
    assert timings["placement/resident_headroom_gb"] == pytest.approx(-18.0)
    # two engines on the GPU (roles.actor_infer.world_size: 2) each take their share and a context:
    # both peaks fit beside one engine's 16 GiB (72 - 40 - 16 - 3 = 13), not beside two (72 - 40 - 32 - 4)
    two = {
        "placement.devices": 1,
        "roles.actor_infer.world_size": 2,
        "rollout.vllm.gpu_memory_utilization": 0.2,
    }
    roles, groups = roles_with(30, 10, **two)
    assert roles._staying() == {"actor_infer"}  # the worst phase: 72 - (29 + 2) - 32 - 4 GiB
    timings = roles.pop_timings()
    assert timings["placement/engine_headroom_gb"] == pytest.approx(5.0)
    assert timings["placement/resident_headroom_gb"] == pytest.approx(-4.0)
    groups["actor_train"].need = 45 * gib  # 72 - 46 - 32 - 4: both engines sleep
    capsys.readouterr()
    assert roles._staying() == set()
    out = capsys.readouterr().out  # the share that would keep them awake: 0.2 - 10 / (2 x 80)
    assert "the 2 vLLM engines on the GPU sleep" in out and "16.0 GiB each" in out
    assert "stay awake at a share of 0.13 or less" in out


def test_the_share_hint_names_the_shares_that_would_keep_the_engine_awake_or_move_nothing():
    """Run I's H100 numbers at the default share 0.35: the engine slept; the measured peaks say it
    stays awake at 0.27 (I2 ran 0.2: awake) and nothing moves at 0.18 (J ran 0.15: nothing moved)."""
    from reroll.pipelines.residency import share_hint as _share_hint

    gib, total = 2**30, int(79.2 * 2**30)
    needs = [(int(45.8 * gib), 6 * gib), (8 * gib, 1 * gib)]
    engine = engine_headroom(needs, 0.35, total)
    resident = engine_headroom(needs, 0.35, total, resident=True)
    hint = _share_hint(0.35, engine, resident, total)
    assert "rollout.vllm.gpu_memory_utilization 0.35 = 27.7 GiB" in hint and "6.2 GiB short" in hint
    assert "stay awake at a share of 0.27 or less, and nothing would move at 0.18 or less" in hint
    for share, expected in ((0.27, True), (0.28, False)):  # the share shown is the last that fits
        assert (engine_headroom(needs, share, total) >= 0) is expected
    crowded = _share_hint(0.35, -int(0.33 * total), -int(0.5 * total), total)
    assert "no room to stay awake" in crowded and "share of" not in crowded


def test_a_trainer_out_of_memory_beside_the_awake_engine_is_told_why_and_the_fix(tmp_path):
    from reroll.errors import RoleError
    from reroll.pipelines.roles import Roles

    cfg = _cfg(tmp_path, **{"placement.devices": 1})
    groups = {r: _Group([], r) for r in ("actor_train", "actor_infer")}
    roles = Roles(cfg, {}, colocation=Colocation(groups, device_map(cfg, "cuda"), True))
    oom = RoleError(
        "actor_train", 0, "train", "OutOfMemoryError: CUDA out of memory. Tried to allocate 4.64 GiB."
    )
    for stayed, explained in ((False, False), (True, True)):
        roles.colocation.stayed = {"actor_infer": stayed}
        with pytest.raises(RoleError) as e, roles.phase("train", "actor_train"):
            raise oom
        assert ("The vLLM engine was awake beside the trainers" in str(e.value)) == explained
        assert "Tried to allocate 4.64 GiB" in str(e.value)
    roles.colocation.stayed = {"actor_infer": True}
    with pytest.raises(RoleError) as e, roles.phase("train", "actor_train"):
        raise RoleError("actor_train", 0, "train", "ValueError: bad")
    assert "awake" not in str(e.value)
    assert "lower rollout.vllm.gpu_memory_utilization" in ENGINE_AWAKE_OOM and "--resume" in ENGINE_AWAKE_OOM


def test_a_move_inside_a_phase_is_timed_as_the_move_alone(tmp_path):
    """A phase that evicts a role part-way (``hold``: the weight sync through host memory, whose trainer
    leaves as the engine wakes) times that move as ``timing/offload`` and ``timing/reload``, not as the
    phase's own seconds too: a slow first offload read as a slow sync as well."""
    from reroll.pipelines.roles import Roles

    class Slow(_Group):
        def offload(self):
            time.sleep(0.5)
            super().offload()

    cfg = _cfg(tmp_path, **{"placement.devices": 1})
    log: list[str] = []
    groups = {r: Slow(log, r) for r in ("actor_train", "actor_infer")}
    roles = Roles(cfg, {}, colocation=Colocation(groups, device_map(cfg, "cuda"), True))
    roles.colocation.offloaded.add("actor_infer")
    with roles.phase("weight_sync", "actor_train"):
        time.sleep(0.05)
        roles.hold("actor_infer")
    assert log == ["offload actor_train", "reload actor_infer"]  # the move ran inside the phase
    timings = roles.pop_timings()
    # the phase's own 0.05 s, not the 0.5 s offload (sleep is at least what it asks, so each bound holds)
    assert 0.05 <= timings["timing/weight_sync"] < 0.5
    assert timings["timing/offload"] >= 0.5


def test_the_engine_may_stay_awake_with_vllm_on_gpus_in_single_response_pipelines(tmp_path):
    vllm = {"rollout.engine": "vllm"}
    assert engine_may_stay(_cfg(tmp_path, **vllm), "cuda")
    assert not engine_may_stay(_cfg(tmp_path, **vllm), "cpu")
    assert not engine_may_stay(_cfg(tmp_path), "cuda")  # the hf engine's memory has no bound
    assert not engine_may_stay(_cfg(tmp_path, **vllm, **{"placement.offload": "always"}), "cuda")


def test_colocation_that_does_not_offload_moves_nothing(tmp_path):
    cfg = _cfg(tmp_path, **{"placement.devices": 1})
    log: list[str] = []
    groups = {r: _Group(log, r) for r in ("actor_train", "actor_infer")}
    col = Colocation(groups, device_map(cfg, "cpu"), offloads=False)
    col.use("actor_infer")
    assert log == [] and col.pop_seconds() == {}


def test_strategy_auto_is_fsdp2_where_it_shards_on_gpus_and_torch_elsewhere(tmp_path):
    """Resolved once, where the run resolves the device type (ResourceManager), from actor_train's
    device and ranks; an explicit name stays. The run writes this config (config.yaml) and gives it to
    the workers. One GPU rank gets torch (fsdp2 shards nothing there and was 1.5x slower on an H200)
    unless an fsdp2 option asks for it."""

    def resolved(**overrides):
        return ResourceManager(_cfg(tmp_path, **{"runtime.backend": "local", **overrides})).cfg.strategy.name

    assert _cfg(tmp_path).strategy.name == "auto"
    assert resolved() == "torch"  # no pool, no GPU asked for: CPU workers
    assert resolved(**{"roles.actor_train.num_gpus_per_worker": 1}) == "torch"
    two_gpus = {"roles.actor_train.num_gpus_per_worker": 1, "roles.actor_train.world_size": 2}
    assert resolved(**two_gpus) == "fsdp2"
    assert resolved(**{"placement.devices": 1, "placement.device_type": "cuda"}) == "torch"
    offload = {"placement.devices": 1, "placement.device_type": "cuda", "strategy.fsdp2.cpu_offload": True}
    assert resolved(**offload) == "fsdp2"
    assert resolved(**{"placement.devices": 1, "placement.device_type": "cpu"}) == "torch"
    explicit = {"placement.devices": 1, "placement.device_type": "cuda", "strategy.name": "torch"}
    assert resolved(**explicit) == "torch"
    # a worker built from an unresolved config (tests, benchmarks) gets the same rule for its device
    assert trainer_strategy(_cfg(tmp_path), "cuda") == "torch"
    assert trainer_strategy(_cfg(tmp_path, **{"roles.actor_train.world_size": 2}), "cuda") == "fsdp2"
    assert trainer_strategy(_cfg(tmp_path), "cpu") == "torch"


def test_plan_shows_the_strategy_auto_chose(tmp_path):
    from reroll.plan import plan

    two = {"model.path": "Qwen/Qwen2.5-0.5B-Instruct", "roles.actor_train.world_size": 2}
    auto, _ = plan(_cfg(tmp_path, **two), gpus=2, gpu_memory_gib=80)
    torch_, _ = plan(_cfg(tmp_path, **two, **{"strategy.name": "torch"}), gpus=2, gpu_memory_gib=80)
    assert "strategy fsdp2 (strategy.name auto)," in auto and "strategy torch," in torch_

    def actor_line(text):
        return next(line for line in text.splitlines() if line.strip().startswith("actor_train"))

    assert actor_line(auto) != actor_line(torch_)  # the plan shards weights and Adam state over 2 ranks


def test_the_plans_trainer_peak_is_the_measured_one(tmp_path):
    """Run K (an H100): the Qwen2.5-0.5B shape's training pass over 64 rows of 128 prompt + 256 response
    tokens in bf16 peaked at 41.6 GiB with fused RMSNorm, 45.6 GiB with the model's own, without the
    optimizer's state (benchmarks/train_passes.py). The plan's parts but Adam's and the log-prob
    workspace are that peak."""
    from reroll.config.memory import KNOWN
    from reroll.plan import estimate

    def trainer_gib(fused: bool) -> float:
        cfg = _cfg(
            tmp_path,
            **{
                "model.path": "Qwen/Qwen2.5-0.5B",
                "model.dtype": "bfloat16",
                "model.fused_norm": fused,
                "rollout.max_new_tokens": 256,
                "optim.micro_batch_size": 64,
                "strategy.name": "torch",
            },
        )
        [actor] = [
            p for p in estimate(cfg, KNOWN["qwen2.5-0.5b"], prompt_tokens=128) if p.role == "actor_train"
        ]
        adam = float(actor.parts.split("adam ")[1].split()[0])
        return actor.gib - adam - 1.0  # LOGPROB_WORKSPACE: 1 GiB of fp32 chunks

    assert trainer_gib(True) == pytest.approx(41.6, rel=0.05)
    assert trainer_gib(False) == pytest.approx(45.6, rel=0.05)


def test_the_plan_counts_the_pinned_host_memory_of_offloaded_roles(tmp_path):
    """benchmarks/offload.py (an H200): the Qwen2.5-0.5B shape's bf16 weights and Adam moments, 2.76 GiB,
    stayed pinned in host memory while offloaded. A sleeping vLLM engine keeps its weights there at
    sleep_level 1; roles on GPUs of their own move nothing."""
    from reroll.plan import plan

    base = {"model.path": "Qwen/Qwen2.5-0.5B", "model.dtype": "bfloat16", "rollout.engine": "vllm"}

    def host_line(**overrides) -> str | None:
        text, _ = plan(_cfg(tmp_path, **base, **overrides), gpus=2, gpu_memory_gib=80)
        return next((line for line in text.splitlines() if line.startswith("host memory")), None)

    line = host_line(**{"placement.devices": 1})
    parked = dict(part.rsplit(" ", 1) for part in line.split("(")[1].rstrip(")").split(", "))
    assert float(parked["actor_train"]) == pytest.approx(2.76, abs=0.05)
    assert float(parked["actor_infer"]) == float(parked["reference"]) == pytest.approx(0.92, abs=0.05)
    assert "actor_infer" not in host_line(**{"placement.devices": 1, "rollout.vllm.sleep_level": 2})
    assert host_line(**{"placement.devices": 1, "placement.offload": "never"}) is None
    apart = {"placement.devices": 2, "roles.actor_infer.devices": "[1]"}  # actor_train beside reference
    assert "actor_infer" not in host_line(**apart) and "actor_train" in host_line(**apart)


def test_weight_sync_transport_auto_rule(tmp_path):
    from reroll.config.placement import weight_sync_transport

    colocated = _cfg(tmp_path, **{"placement.devices": 1})
    assert weight_sync_transport(colocated, "cuda") == "ipc"  # CUDA IPC on the trainer's GPU
    assert weight_sync_transport(colocated, "cpu") == "ipc"  # shared memory beside the trainer
    local = _cfg(tmp_path, **{"placement.devices": 1, "runtime.backend": "local"})
    assert weight_sync_transport(local, "cuda") == "object_store"  # one process: tensors as they are
    apart = _cfg(tmp_path, **{"placement.devices": 2, "roles.actor_infer.devices": "[1]"})
    assert weight_sync_transport(apart, "cuda") == "collective"  # the engine is on another GPU
    assert weight_sync_transport(apart, "cpu") == "object_store"  # host memory either way
    apart_async = _cfg(
        tmp_path, **{"placement.devices": 2, "roles.actor_infer.devices": "[1]", "rollout.async_steps": 1}
    )
    assert weight_sync_transport(apart_async, "cuda") == "object_store"  # loads queue behind generations
    straddles = _cfg(
        tmp_path,
        **{"placement.devices": 2, "roles.actor_infer.world_size": 2, "roles.actor_infer.devices": "[0, 1]"},
    )
    assert weight_sync_transport(straddles, "cuda") == "object_store"  # no trainer rank on device 1
    shared = _cfg(
        tmp_path,
        **{
            "placement.devices": 2,
            "roles.actor_train.world_size": 2,
            "roles.actor_train.devices": "[0, 1]",
            "roles.actor_infer.devices": "[1]",
        },
    )
    assert weight_sync_transport(shared, "cuda") == "ipc"  # trainer rank 1 shares with the engine on its GPU
    apart_mp = _cfg(
        tmp_path,
        **{
            "placement.devices": 2,
            "roles.actor_infer.devices": "[1]",
            "rollout.engine": "vllm",
            "rollout.vllm.in_process": "false",
        },
    )
    assert weight_sync_transport(apart_mp, "cuda") == "object_store"  # received outside vLLM's workers
    no_pool = _cfg(tmp_path)
    assert weight_sync_transport(no_pool, "cuda") == "object_store"  # Ray places it: unknown GPU
    multiprocess = _cfg(
        tmp_path, **{"placement.devices": 1, "rollout.engine": "vllm", "rollout.vllm.in_process": "false"}
    )
    assert weight_sync_transport(multiprocess, "cuda") == "ipc"  # each vLLM worker opens its own handle
    sglang = _cfg(tmp_path, **{"placement.devices": 1, "rollout.engine": "sglang"})
    assert weight_sync_transport(sglang, "cuda") == "object_store"  # its spec: opens_shared False
    forced = _cfg(tmp_path, **{"rollout.weight_sync_transport": "object_store", "placement.devices": 1})
    assert weight_sync_transport(forced, "cuda") == "object_store"


def _spanning(tmp_path, **overrides):
    """Two fsdp2 ranks of actor_train on a pool of ``placement.devices`` with vLLM engines of TP=2."""
    base = {
        "rollout.engine": "vllm",
        "rollout.vllm.tensor_parallel_size": 2,
        "roles.actor_train.world_size": 2,
        "placement.devices": 2,
    }
    return _cfg(tmp_path, **(base | overrides))


def test_an_engine_of_tp_k_takes_k_consecutive_pool_devices_beside_the_trainers(tmp_path):
    from reroll.config.placement import check_placement, ipc_senders, weight_sync_transport

    one = _spanning(tmp_path)
    dmap = device_map(one, "cpu")
    assert dmap.ranks["actor_infer"] == (0,) and dmap.span["actor_infer"] == 2
    assert dmap.covered("actor_infer") == {0, 1} == dmap.covered("actor_train")
    assert dmap.workers_on(1) == [("actor_train", 1), ("actor_infer", 0)]
    assert check_placement(one) == []
    assert weight_sync_transport(one, "cpu") == weight_sync_transport(one, "cuda") == "ipc"
    assert ipc_senders(one, "cpu") == {0: 0, 1: 1}  # each trainer rank to the worker on its device

    # data-parallel engines over the rest: 2 engines of TP=2 beside 4 trainer ranks on 4 devices
    four = _spanning(
        tmp_path,
        **{"placement.devices": 4, "roles.actor_train.world_size": 4, "roles.actor_infer.world_size": 2},
    )
    assert device_map(four, "cuda").ranks["actor_infer"] == (0, 2)
    assert ipc_senders(four, "cuda") == {0: 0, 1: 1, 2: 2, 3: 3}


def test_a_spanning_engine_that_does_not_fit_its_devices_is_refused_naming_the_span_key(tmp_path):
    from reroll.config.loader import ConfigError

    cases = [
        (
            {"roles.actor_infer.world_size": 2},
            "roles.actor_infer.world_size: 2 engine ranks of rollout.vllm.tensor_parallel_size=2 devices "
            "each need 4 pool devices",
        ),
        (
            {"placement.devices": 3, "roles.actor_infer.devices": "[0, 2]"},
            "roles.actor_infer.devices: engine rank 0 would take devices [0, 2]: each rank of "
            "rollout.vllm.tensor_parallel_size=2 takes 2 consecutive pool devices",
        ),
        ({"roles.actor_infer.devices": "[1]"}, "list exactly 2 devices, not 1"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError) as refused:
            _spanning(tmp_path, **overrides)
        assert message in str(refused.value), overrides


def test_an_explicit_ipc_transport_needs_a_trainer_rank_on_every_engine_device(tmp_path):
    from reroll.config.loader import ConfigError
    from reroll.config.placement import check_weight_sync

    ipc = {"rollout.weight_sync_transport": "ipc"}
    cases = [
        (
            {"placement.devices": 2, "roles.actor_infer.devices": "[1]"},
            "rollout.weight_sync_transport: 'ipc': engine workers on pool devices [1] have no actor_train "
            "rank beside them",
        ),
        ({"placement.devices": 1, "runtime.backend": "local"}, "it needs runtime.backend=ray"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError) as refused:
            _cfg(tmp_path, **ipc, **overrides)
        assert message in str(refused.value), overrides
    assert check_weight_sync(_spanning(tmp_path, **ipc), "cpu") == []


def test_the_old_cuda_ipc_name_says_what_it_became(tmp_path):
    with pytest.raises(Exception, match="'cuda_ipc' is now 'ipc'"):
        _cfg(tmp_path, **{"rollout.weight_sync_transport": "cuda_ipc", "placement.devices": 1})


def test_trainer_roles_and_engines_sharing_a_device_are_counted(tmp_path):
    from reroll.config.placement import colocated_engines, colocated_trainer_roles

    one = _cfg(tmp_path, **{"placement.devices": 1})  # actor_train, reference and the engine on device 0
    assert colocated_trainer_roles(one, "actor_train") == 2
    assert colocated_engines(one, "actor_train") == 1
    two = _cfg(tmp_path, **{"placement.devices": 2, "roles.reference.devices": "[1]"})
    assert colocated_trainer_roles(two, "actor_train") == 1
    assert colocated_trainer_roles(_cfg(tmp_path), "actor_train") == 1
    engines = _cfg(tmp_path, **{"placement.devices": 1, "roles.actor_infer.world_size": 2})
    assert colocated_engines(engines, "actor_train") == 2  # each takes gpu_memory_utilization of it
    own = _cfg(tmp_path, **{"placement.devices": 2, "roles.actor_infer.devices": "[1]"})
    assert colocated_engines(own, "actor_train") == 0


def test_explicit_collective_is_checked(tmp_path):
    from reroll.config.loader import ConfigError
    from reroll.config.placement import check_weight_sync

    with pytest.raises(ConfigError, match=r"rollout.weight_sync_transport: .*needs runtime.backend=ray"):
        _cfg(tmp_path, **{"rollout.weight_sync_transport": "collective", "runtime.backend": "local"})
    on_one_gpu = _cfg(tmp_path, **{"rollout.weight_sync_transport": "collective", "placement.devices": 1})
    [(_, message)] = check_weight_sync(on_one_gpu, "cuda")
    assert "no actor_train rank uses (train [0], infer [0])" in message
    assert check_weight_sync(on_one_gpu, "cpu") == []  # CPU slots: both stay resident (no offload)
    apart = _cfg(
        tmp_path,
        **{
            "rollout.weight_sync_transport": "collective",
            "placement.devices": 2,
            "roles.actor_infer.devices": "[1]",
        },
    )
    assert check_weight_sync(apart, "cuda") == []


def test_worker_threads_default_to_the_cores_a_worker_has_to_itself(tmp_path, monkeypatch):
    """Ray gives a worker of num_cpus 0.25 one OMP thread; on CPU, roles that take turns get the
    machine's cores (over a role's ranks), roles on a CPU pool their device's cpus_per_device."""
    from reroll.runtime.placement import driver_threads, with_threads, worker_threads

    monkeypatch.setattr("os.cpu_count", lambda: 8)
    cpu = {"placement.device_type": "cpu"}
    cfg = _cfg(tmp_path, **cpu, **{"roles.actor_train.world_size": 2})
    assert worker_threads(cfg, "actor_infer") == 8  # roles take turns: all cores
    assert worker_threads(cfg, "actor_train") == 4  # two ranks run together
    assert worker_threads(cfg, "reward") is None  # not a model role: Ray's default
    pool = _cfg(tmp_path, **cpu, **{"placement.devices": 2, "placement.cpus_per_device": 3.5})
    assert worker_threads(pool, "actor_train") == 3
    assert worker_threads(_cfg(tmp_path, **cpu, **{"placement.devices": 2}), "actor_train") == 1
    assert worker_threads(_cfg(tmp_path, **cpu, **{"roles.actor_infer.torch_threads": 5}), "actor_infer") == 5
    gpu = {"placement.device_type": "cuda", "roles.actor_train.num_gpus_per_worker": 1}
    assert worker_threads(_cfg(tmp_path, **gpu), "actor_train") is None
    gpu_pool = {"placement.device_type": "cuda", "placement.devices": 1}
    assert worker_threads(_cfg(tmp_path, **gpu_pool), "actor_train") is None
    assert worker_threads(_cfg(tmp_path, **cpu, **{"runtime.backend": "local"}), "actor_train") is None
    assert driver_threads(cfg) == 1  # the roles are Ray workers: the driver's tensors are a batch's
    assert driver_threads(_cfg(tmp_path, **cpu, **{"runtime.backend": "local"})) is None  # roles in it
    resolved = with_threads(cfg)  # what config.yaml records
    assert (resolved.roles.actor_train.torch_threads, resolved.roles.reference.torch_threads) == (4, 8)
    assert resolved.roles.reward.torch_threads is None


def test_a_worker_process_lets_attention_use_cudnn_only_when_the_config_says_so(tmp_path):
    """torch picks cuDNN's attention first on Hopper GPUs, and cuDNN builds a plan per new shape;
    model.cudnn_attention (default off) sets the process-wide flag, torch threads as before. Checked in a
    fresh process, as a worker is one: in the whole suite's process, after the integration tests,
    CI read 1 thread after set_num_threads(3) (process-wide state an earlier test left)."""
    import subprocess
    import sys

    check = """
import sys, torch
from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.runtime.placement import configure_process
path, flag = sys.argv[1], sys.argv[2]
cfg = load_config(path, RunConfig, ["placement.device_type=cpu", "roles.actor_infer.torch_threads=3",
                                    f"model.cudnn_attention={flag}"])
configure_process(cfg, "actor_infer")
print(torch.get_num_threads(), torch.backends.cuda.cudnn_sdp_enabled())
"""
    _cfg(tmp_path)  # writes run.yaml
    seen = [
        subprocess.run(
            [sys.executable, "-c", check, str(tmp_path / "run.yaml"), flag],
            capture_output=True, text=True, check=True,
        ).stdout.split()
        for flag in ("false", "true")
    ]  # fmt: skip
    assert seen == [["3", "False"], ["3", "True"]]


def test_the_moves_report_the_bytes_the_trainers_moved_and_their_rate(tmp_path, monkeypatch):
    """A trainer rank's offload/reload returns the GPU bytes its state gave up / took back (0 where it
    stays); the colocation sums them per step as ``offload/bytes``, ``reload/bytes`` and their GB/s
    over the calls that moved something (an engine's sleep reports nothing)."""
    from reroll.roles.strategy_worker import StrategyWorker

    held = {"bytes": 3 * 10**9}

    class Strategy:
        device = torch.device("cuda", 0)

        def offload(self):
            held["bytes"] -= 2 * 10**9

        def reload(self):
            held["bytes"] += 2 * 10**9

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: held["bytes"])
    emptied: list[int] = []  # the cache is given back once the state has moved, for the role taking the GPU
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(held["bytes"]))
    worker = object.__new__(StrategyWorker)
    worker.strategy, worker._resting = Strategy(), 0
    fits = iter([True, False])
    worker._fits_beside_engine = lambda: next(fits)
    assert worker.offload() == 0 and worker.reload() == 0  # it fitted: nothing moved
    assert worker.offload() == 2 * 10**9 and worker._resting == 3 * 10**9
    assert emptied == [10**9]
    assert worker.reload() == 2 * 10**9 and held["bytes"] == 3 * 10**9

    cfg = _cfg(tmp_path, **{"placement.devices": 1})
    log: list[str] = []

    class Moving(_Group):
        def offload(self):
            super().offload()
            return 4 * 10**9

        def reload(self):
            super().reload()
            return 4 * 10**9

    groups = {"actor_train": Moving(log, "actor_train"), "actor_infer": _Group(log, "actor_infer")}
    col = Colocation(groups, device_map(cfg, "cuda"), offloads=True)
    col.use("actor_infer")
    col.use("actor_train")
    moves = col.pop_moves()
    assert moves["offload/bytes"] == moves["reload/bytes"] == 4e9
    assert moves["offload/gb_per_s"] > 0 and moves["reload/gb_per_s"] > 0
    assert col.pop_moves() == {"offload/bytes": 0.0, "reload/bytes": 0.0}
    assert Colocation(groups, None, offloads=True).pop_moves() == {}  # nothing colocated


def test_a_trainer_keeps_its_state_where_it_fits_beside_every_engine_on_its_gpu(tmp_path, monkeypatch):
    """``StrategyWorker._fits_beside_engine`` (CUDA's memory calls faked): the role's reserved memory
    times the trainer roles on the GPU, plus each engine's share, under 90 % of the GPU. Where it keeps
    its state that near the limit (1.5 x 20 GiB would not fit), it has its host buffers prepared then."""
    import types

    from reroll.roles import strategy_worker
    from reroll.roles.strategy_worker import StrategyWorker

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=80 * gib)
    )
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 20 * gib)
    monkeypatch.setattr(strategy_worker, "worker_device", lambda cfg, role: "cuda")

    prepared: list[bool] = []

    class Strategy:
        device = torch.device("cuda", 0)

        def prepare_offload(self, worth_it):
            prepared.append(worth_it(gib))  # a 1 GiB state, 20 GiB measured

    def fits(**overrides) -> bool:
        worker = object.__new__(StrategyWorker)
        base = {"placement.devices": 1, "placement.device_type": "cuda", "rollout.engine": "vllm"}
        worker.cfg = _cfg(tmp_path, **base, **overrides)
        worker.role, worker.strategy = "actor_train", Strategy()
        worker._shape, worker._room = None, (0, math.inf)  # no shape: the other phases bound nothing
        return worker._fits_beside_engine()

    # two trainer roles x 20 GiB + 0.3 x 80 GiB = 64 <= 72 GiB
    assert fits(**{"rollout.vllm.gpu_memory_utilization": 0.3})
    assert prepared == [True]  # 2 x 1.5 x 20 + 24 = 84 > 72 GiB: it may move at a later eviction
    # two engines at 0.3 each: 40 + 48 GiB > 72 GiB
    assert not fits(**{"rollout.vllm.gpu_memory_utilization": 0.3, "roles.actor_infer.world_size": 2})
    assert prepared == [True]  # it moves now: its offload makes what is not prepared
    assert fits(**{"rollout.vllm.gpu_memory_utilization": 0.15, "roles.actor_infer.world_size": 2})
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 5 * gib)
    assert fits(**{"rollout.vllm.gpu_memory_utilization": 0.3})
    assert prepared == [True, True, False]  # 2 x 1.5 x 5 + 24 = 39 <= 72 GiB: far from moving


def test_storage_parking_leaves_host_storages_alone():
    """``HostParking.park_storages`` (Megatron's offload) frees GPU storages only: a storage already in
    host memory keeps its bytes and nothing is returned to bring back."""
    from reroll.strategies.host_parking import HostParking

    t = torch.arange(6.0)
    assert HostParking().park_storages([t.untyped_storage()]) == []
    assert t.untyped_storage().nbytes() == 24 and torch.equal(t, torch.arange(6.0))


def test_the_plans_forward_only_passes_hold_a_training_micro_batchs_memory(tmp_path):
    """Forward-only passes (``optim.logprob_*`` unset) keep no activations for backward: on GPUs they
    take as many rows (or tokens) as hold a training micro-batch's memory, and ``reroll plan`` says how
    many, at the peak it had with training's cut; colocated roles that never offload keep training's
    cut, and a user's setting is kept."""
    from reroll.plan import plan

    base = {
        "model.path": "Qwen/Qwen2.5-0.5B",
        "model.dtype": "bfloat16",
        "rollout.engine": "vllm",
        "rollout.max_new_tokens": 1024,
        "optim.micro_batch_size": 8,
        "placement.devices": 1,
    }

    def planned(**overrides) -> tuple[float, str]:
        text, _ = plan(_cfg(tmp_path, **base, **overrides), gpus=1, gpu_memory_gib=80)
        peak = float(re.search(r"fits?: peak ([\d.]+)", text)[1])
        line = next(line for line in text.splitlines() if line.startswith("forward-only"))
        return peak, line.split(": ", 1)[1]

    peak, said = planned()
    rows = int(said.split()[0])
    assert rows >= 12 and "optim.logprob_* unset" in said
    assert planned(**{"optim.logprob_micro_batch_size": 8})[0] == peak  # training's peak, as before
    assert planned(**{"optim.logprob_micro_batch_size": rows}) == (
        peak,
        f"{rows} rows at a time (optim.logprob_*)",
    )
    assert planned(**{"optim.logprob_micro_batch_size": 4 * rows})[0] > peak
    budget = {"optim.max_tokens_per_micro_batch": 8 * 1536}
    peak, said = planned(**budget)
    assert said.endswith("unset: as many as hold a training micro-batch's memory)")
    assert int(said.split()[0]) >= rows * 1536 and said.split()[1] == "tokens"
    assert planned(**budget, **{"optim.logprob_max_tokens_per_micro_batch": 8 * 1536})[0] == peak
    # resident: every role keeps its passes' memory beside the others'
    assert planned(**{"placement.offload": "never"})[1].startswith("8 rows at a time (as training's")


@pytest.mark.parametrize("checkpointing", [False, True])
def test_forward_only_passes_hold_no_more_than_a_training_micro_batch(tmp_path, checkpointing):
    """``forward_only_limits``: the rows a forward-only pass takes hold at most what a training
    micro-batch holds (activations for backward, the head's output and its gradient) and one row more
    would not; a teacher's pass, its head at every position, takes fewer rows."""
    from reroll.config.memory import KNOWN, forward_only_limits, token_bytes

    cfg = _cfg(
        tmp_path,
        **{
            "model.dtype": "bfloat16",
            "model.gradient_checkpointing": checkpointing,
            "rollout.max_new_tokens": 1024,
            "optim.micro_batch_size": 8,
        },
    )
    shape, seq = KNOWN["qwen2.5-7b"], 1536
    per = token_bytes(cfg, shape, seq)
    training = 8 * seq * (per.kept + per.train_logits)
    for everywhere, logits in ((False, per.scored_logits), (True, per.all_logits)):
        rows, tokens = forward_only_limits(cfg, shape, seq, every_position=everywhere)
        assert tokens is None and rows > 8
        assert rows * seq * (per.layer + logits) <= training < (rows + 1) * seq * (per.layer + logits)
    assert (
        forward_only_limits(cfg, shape, seq, every_position=True)[0] < forward_only_limits(cfg, shape, seq)[0]
    )


def test_plan_puts_each_engine_worker_on_its_device_with_its_tensor_parallel_share(tmp_path):
    from reroll.plan import plan

    small = {"model.path": "Qwen/Qwen2.5-0.5B", "model.dtype": "bfloat16", "strategy.name": "fsdp2"}
    text, _ = plan(_spanning(tmp_path, **small), gpus=2, gpu_memory_gib=80)
    assert "cannot start" not in text
    assert "gpu 0:" in text and "gpu 1:" in text
    lines = [line for line in text.splitlines() if line.lstrip().startswith("gpu ")]
    assert all("actor_infer" in line and "actor_train" in line for line in lines), lines
    one, _ = plan(
        _spanning(tmp_path, **small, **{"rollout.vllm.tensor_parallel_size": 1}), gpus=2, gpu_memory_gib=80
    )

    def engine_weights(out: str) -> float:
        row = next(line for line in out.splitlines() if line.lstrip().startswith("actor_infer"))
        return float(row.split("weights ")[1].split(" ")[0])

    assert engine_weights(text) == pytest.approx(engine_weights(one) / 2, abs=0.06)  # each worker half


def test_an_ipc_sync_holds_both_roles_only_where_they_fit_together(tmp_path):
    """An 'ipc' sync keeps actor_train and the awake engine resident for its length; on a GPU where the
    trainers' measured memory does not leave room for the awake engine (the 3B shape on one GPU), or
    before they measured it, the sync goes through host memory as the trainer leaves the device, and
    the reason is said once."""
    from reroll.pipelines.roles import Roles

    class Measured(_Group):
        need = 0

        def memory_need(self):
            return self.need, 2**30, 80 * 2**30

    cfg = _cfg(
        tmp_path,
        **{"placement.devices": 1, "rollout.engine": "vllm", "rollout.vllm.gpu_memory_utilization": 0.35},
    )
    groups = {"actor_train": Measured([], "actor_train"), "actor_infer": _Group([], "actor_infer")}
    colocation = Colocation(groups, device_map(cfg, "cuda"), True)
    roles = Roles(cfg, {}, colocation=colocation)
    colocation.let_stay(roles._staying)
    assert not roles._both_fit() and not roles.host_sync_said  # not measured yet: nothing to say
    groups["actor_train"].need = 40 * 2**30  # 40 + 0.35 x 80 + 2 GiB of contexts <= 72 GiB
    assert roles._both_fit()
    groups["actor_train"].need = 50 * 2**30
    assert not roles._both_fit() and roles.host_sync_said
    assert Roles(cfg, {}, colocation=Colocation(groups, device_map(cfg, "cuda"), False))._both_fit()


def test_a_sync_into_a_sleeping_engine_wakes_its_weights_alone_where_they_fit_beside_the_trainer(tmp_path):
    """Where the engine sleeps through the trainers' phases, an 'ipc' sync wakes the engine's weights
    alone, loads them from the resident trainer over CUDA IPC, and only then lets the trainer leave and
    the engine's KV cache come back, its prefix cache dropped once awake; where the trainer's state,
    the weights and a CUDA context per process do not fit in 90 % of the GPU, or at the first sync
    (no weights measured yet), the weights go through host memory as before. The roles are stand-ins:
    what is checked is the order of their calls."""
    from reroll.pipelines.roles import Roles

    GiB = 2**30
    log: list[str] = []

    class Trainer(_Group):
        weights_version, rest = 1, 20 * GiB

        def memory_need(self):
            return 70 * GiB, self.rest, 80 * GiB  # a phase too large for the engine to stay awake

        def begin_share(self, bucket_mb, senders):  # through the role's handles, as TrainerGroup's does
            self.residency_check("actor_train")
            self.left = 2
            log.append("begin_share")

        def share_next(self):
            self.residency_check("actor_train")
            self.left -= 1
            return None if self.left < 0 else [f"bucket {1 - self.left}"]

        def release_shared(self):
            log.append("release_shared")

        def sync_bytes(self):
            return 6 * GiB

        def weight_buckets(self, bucket_mb, transport):
            log.append(f"buckets via {transport}")
            return []

    class Engine(_Group):
        weights_version = 0

        def wake_weights(self):
            log.append("wake_weights actor_infer")

        def submit_shared(self, shared):  # through the role's handles, as EngineGroup's does
            self.residency_check("actor_infer")
            log.append(f"load {shared[0]}")
            return []

        def wait_loaded(self, loads):
            self.residency_check("actor_infer")

        def finish_weight_update(self):
            log.append("finish_weight_update")

        def load_weight_buckets(self, buckets):
            log.append("load from host")

    cfg = _cfg(
        tmp_path,
        **{"placement.devices": 1, "rollout.engine": "vllm", "rollout.vllm.gpu_memory_utilization": 0.35},
    )
    cfg.placement.device_type = "cuda"
    groups = {"actor_train": Trainer(log, "actor_train"), "actor_infer": Engine(log, "actor_infer")}
    colocation = Colocation(groups, device_map(cfg, "cuda"), True)
    roles = Roles(cfg, groups, colocation=colocation)
    for group in groups.values():  # as Roles.build sets it where colocated roles offload
        group.residency_check = roles._check_resident
    colocation.let_stay(roles._staying)  # 70 GiB + 28 GiB of share: the engine sleeps

    def sync_after_a_train_phase() -> list[str]:
        colocation.use("actor_train")  # the train phase: the engine asleep, the trainer resident
        log.clear()
        groups["actor_train"].weights_version += 1
        roles.sync_weights()
        return list(log)

    # the first sync: no weights measured yet, so through host memory
    assert sync_after_a_train_phase() == [
        "buckets via object_store",
        "offload actor_train",
        "reload actor_infer",
        "load from host",
    ]
    assert roles.weights_bytes == 6 * GiB
    # 20 GiB of state + 6 of weights + 2 contexts <= 72 GiB: the weights wake alone, over CUDA IPC
    assert sync_after_a_train_phase() == [
        "wake_weights actor_infer",
        "begin_share",
        "load bucket 0",
        "load bucket 1",
        "release_shared",
        "offload actor_train",
        "reload actor_infer",
        "finish_weight_update",
    ]
    # the engine's calls passed the residency check while its weights alone were awake, and only then
    # (on an H100 the check refused the first load: the path had run only with stand-ins that skipped it)
    assert not roles.engine_weights_awake
    with pytest.raises(RuntimeError, match="actor_infer was called in phase"):
        colocation.use("actor_train")
        groups["actor_infer"].submit_shared(["bucket 0"])
    groups["actor_train"].rest = 65 * GiB  # 65 + 6 + 2 > 72: through host memory again
    assert sync_after_a_train_phase()[0] == "buckets via object_store"


def test_a_trainers_need_adds_its_pass_to_the_state_it_holds_now_not_to_the_one_it_started_from(
    tmp_path, monkeypatch
):
    """``StrategyWorker.memory_need`` (CUDA's memory calls faked) after a first step: what the training
    pass took above the state it started from (weights), added to the state now (weights and the
    optimizer's moments, created at that step's end). Reading the peak against the state now counted
    the moments once, in the state, where step 2 holds them beside the pass: the 3B row's engine was
    kept awake from that reading and step 2 ran out of memory (H100 80GB, 2026-12-07)."""
    import types

    from reroll.roles import strategy_worker
    from reroll.roles.strategy_worker import StrategyWorker

    gib = 2**30
    memory = {"allocated": 6 * gib, "peak": 7 * gib}  # the weights built, the load's transient peak
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: memory["allocated"])
    monkeypatch.setattr(strategy_worker, "reserved_peak", lambda device: memory["peak"])
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=80 * gib)
    )

    class Strategy:
        device = torch.device("cuda", 0)

    worker = object.__new__(StrategyWorker)
    worker.cfg = _cfg(tmp_path, **{"rollout.max_new_tokens": 256})
    worker.strategy, worker._resting, worker._widest = Strategy(), 0, (384, 128)
    worker._transient, worker._pass = (0, 0), None
    assert worker.memory_need() == (0, 0, 0)  # no pass yet

    worker._begin_pass(384)  # old log-probs: 4 GiB of logits above the weights
    memory["peak"] = 10 * gib
    worker._begin_pass(384)  # training: gradients (6) and activations (20) above the weights
    memory["peak"] = 32 * gib
    memory["allocated"] = 18 * gib  # the step's end: the moments (12 GiB) are kept
    need, rest, total = worker.memory_need()
    assert (rest, total) == (18 * gib, 80 * gib)
    assert need == 18 * gib + 26 * gib  # what step 2 holds: 44 GiB, not the 32 measured before the moments

    worker._begin_pass(384)  # step 2's forward-only pass, under the peak: the training pass's reading stays
    memory["peak"] = 32 * gib
    assert worker.memory_need()[0] == 44 * gib
    worker._begin_pass(384)  # step 2's training, from the full state: 26 GiB above it again
    memory["peak"] = 44 * gib
    assert worker.memory_need()[0] == 44 * gib
    worker._begin_pass(192)  # a narrower pass raising the peak scales from its own width to 384 tokens
    memory["peak"] = 45 * gib
    assert worker.memory_need()[0] == 18 * gib + 2 * 27 * gib
