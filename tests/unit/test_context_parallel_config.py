"""``strategy.context_parallel``: what the config refuses (with the fix named), how a role's ranks and a
batch are laid out over the groups, and which columns and scored tokens each rank of a group takes
(the two-rank equality with the unsplit run: tests/integration/test_context_parallel.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from reroll.config.loader import ConfigError, load_config
from reroll.config.placement import trainer_strategy
from reroll.config.schema import RunConfig
from reroll.config.startable import data_parallel_size, start_problems
from reroll.strategies.context_parallel import ContextParallel, data_shards, group_leaders, group_ranks


def _cfg(tmp_path: Path, *overrides: str, heads: int = 4, kv_heads: int = 2, **extra) -> RunConfig:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    fields = {"model_type": "qwen2", "num_attention_heads": heads, "num_key_value_heads": kv_heads} | extra
    (model / "config.json").write_text(json.dumps(fields))
    base = {
        "pipeline": "rlvr",
        "model": {"path": str(model)},
        "data": {"train_files": ["x.jsonl"]},
        "rollout": {"batch_size": 8, "group_size": 4},
        "algorithm": {"kl_coef": 0.1},  # a reference role
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(base))
    return load_config(path, RunConfig, list(overrides))


def test_a_config_that_splits_sequences_starts(tmp_path):
    cfg = _cfg(
        tmp_path,
        "strategy.context_parallel=2",
        "roles.actor_train.world_size=4",
        "roles.reference.world_size=2",
    )
    assert start_problems(cfg, "cpu") == start_problems(cfg, "cuda") == []
    assert trainer_strategy(cfg, "cpu") == trainer_strategy(cfg, "cuda") == "fsdp2"  # auto: only fsdp2 splits
    assert data_parallel_size(cfg, "actor_train") == 2 and data_parallel_size(cfg, "reference") == 1


def test_what_context_parallel_refuses_is_listed_with_the_fix(tmp_path):
    cfg = _cfg(
        tmp_path,
        "strategy.context_parallel=4",
        "strategy.name=torch",
        "roles.actor_train.world_size=6",
        "roles.reference.world_size=4",
        heads=6,
        kv_heads=2,
    )
    problems = start_problems(cfg, "cpu")
    messages = " | ".join(m for _, m in problems)
    assert "built for strategy.name=fsdp2 (Ulysses sequence parallelism), not torch" in messages
    assert "set strategy.name=fsdp2, or strategy.context_parallel=1" in messages
    [world] = [m for p, m in problems if p.startswith("roles.")]  # the reference's 4 ranks: one group
    assert world.startswith("6 is not a multiple of strategy.context_parallel (4)")
    assert "must divide the model's num_attention_heads (6)" in messages
    assert "must divide the model's num_key_value_heads (2)" in messages and "use one of [1, 2]" in messages


def test_megatron_and_windowed_models_are_refused(tmp_path):
    megatron = _cfg(
        tmp_path, "strategy.context_parallel=2", "strategy.name=megatron", "roles.actor_train.world_size=2"
    )
    assert any("megatron has its own" in m for _, m in start_problems(megatron, "cuda"))
    windowed = _cfg(
        tmp_path, "strategy.context_parallel=2", "roles.actor_train.world_size=2", "roles.reference.world_size=2",
        use_sliding_window=True,
    )  # fmt: skip
    assert [p for p, m in start_problems(windowed, "cuda") if "sliding-window" in m] == [
        "strategy.context_parallel"
    ]


def test_the_batch_splits_over_the_data_parallel_ranks(tmp_path):
    """rollout.batch_size must split into mini-batches x data-parallel ranks, not x all ranks."""
    ok = _cfg(
        tmp_path,
        "strategy.context_parallel=4",
        "roles.actor_train.world_size=8",
        "roles.reference.world_size=4",
    )
    assert not [p for p in ok.check() if p.path == "optim.mini_batches"]  # 8 rows over 2 x 4 ranks
    with pytest.raises(ConfigError) as e:
        _cfg(
            tmp_path,
            "strategy.context_parallel=2",
            "roles.actor_train.world_size=6",
            "roles.reference.world_size=2",
        )
    [problem] = e.value.problems
    assert problem.path == "optim.mini_batches"
    assert (
        "data-parallel ranks (roles.actor_train.world_size (6) / strategy.context_parallel = 3)"
        in problem.message
    )


def test_ranks_form_groups_of_consecutive_ranks_that_share_a_shard():
    assert group_ranks(4, 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match=r"world_size \(6\) must be a multiple of context_parallel \(4\)"):
        group_ranks(6, 4)
    assert data_shards(["a", "b"], 2) == ["a", "a", "b", "b"]  # rank r gets data-parallel rank r // 2's
    assert group_leaders([10, 11, 20, 21], 2) == [10, 20]


def test_megatron_groups_are_tensor_parallel_apart_and_share_their_rows(tmp_path):
    """Megatron's ranks run tensor-parallel ranks innermost, so a context-parallel group is ``cp`` ranks
    ``tensor_parallel`` apart; the role's batch is split in ``world_size / cp`` parts, a group's ranks get
    the same part and one of them answers for it."""
    from reroll.config.startable import context_parallel_size, context_parallel_stride

    assert group_ranks(8, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert data_shards(["a", "b", "c", "d"], 2, 2) == ["a", "b", "a", "b", "c", "d", "c", "d"]
    assert group_leaders(list(range(8)), 2, 2) == [0, 1, 4, 5]  # ranks holding a, b, c, d
    with pytest.raises(
        ValueError, match=r"world_size \(6\) must be a multiple of context_parallel \(2\) x 2"
    ):
        group_ranks(6, 2, 2)
    cfg = _cfg(
        tmp_path,
        "strategy.name=megatron",
        "strategy.megatron.context_parallel=2",
        "strategy.megatron.tensor_parallel=2",
        "roles.actor_train.world_size=8",
        "roles.reference.world_size=8",
        heads=4,
        kv_heads=4,
    )
    assert [context_parallel_size(cfg, r) for r in ("actor_train", "reference", "teacher")] == [2, 2, 1]
    assert context_parallel_stride(cfg, "actor_train") == 2
    assert data_parallel_size(cfg, "actor_train") == 4  # batch parts: 8 ranks / context_parallel 2
    assert start_problems(cfg) == []


def test_megatron_context_parallel_refusals_name_the_fix(tmp_path):
    """TP x CP must divide the heads; sequence parallelism and a world size that does not split are
    refused, each with its fix (a mixture of experts is not, on pipeline stages too)."""
    base = ["strategy.name=megatron", "roles.actor_train.world_size=4", "roles.reference.world_size=4"]

    def messages(*overrides: str, **model) -> dict[str, str]:
        return dict(start_problems(_cfg(tmp_path, *base, *overrides, **model)))

    split = ["strategy.megatron.context_parallel=2", "strategy.megatron.tensor_parallel=2"]
    heads = messages(*split, heads=8, kv_heads=2)["strategy.megatron.context_parallel"]
    assert (
        "context_parallel (2) x tensor_parallel (2) = 4 must divide the model's num_key_value_heads (2)"
        in heads
    )
    assert "use a context_parallel of [1]" in heads
    moe = {"model_type": "qwen3_moe", "num_experts": 4}  # a mixture of experts splits its rows too
    assert messages("strategy.megatron.context_parallel=2", **moe) == {}
    assert (
        messages("strategy.megatron.context_parallel=2", "strategy.megatron.pipeline_parallel=2", **moe) == {}
    )
    sp = [*split, "strategy.megatron.sequence_parallel=true"]  # CP x TP with SP, a MoE's too
    assert messages(*sp, heads=8, kv_heads=4) == {}
    assert messages(*sp, heads=8, kv_heads=4, **moe) == {}
    odd = messages("strategy.megatron.context_parallel=2", "strategy.megatron.tensor_parallel=4")
    assert "must be divisible by strategy.megatron tensor_parallel (4)" in odd["strategy.megatron"]


def test_each_rank_runs_its_columns_and_scores_the_tokens_on_them():
    """A row of 5 tokens over 2 ranks is padded to 6: rank 0 runs columns 0-2, rank 1 columns 3-5."""
    ranks = [ContextParallel(None, r, 2) for r in range(2)]  # type: ignore[arg-type]  # no group needed here
    assert [cp.columns(5) for cp in ranks] == [(0, 3), (3, 6)]
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]])
    assert ranks[0].local(ids, 0).tolist() == [[1, 2, 3], [6, 7, 8]]
    assert ranks[1].local(ids, 9).tolist() == [[4, 5, 9], [0, 0, 9]]
    # scored positions of the flattened (2, 5) input: (0, 1), (0, 3), (1, 2), (1, 4)
    picked = torch.tensor([1, 3, 7, 9])
    zero, one = (cp.picks(picked, 5) for cp in ranks)
    assert zero.keep.tolist() == [True, False, True, False] and zero.positions.tolist() == [1, 5]
    assert one.keep.tolist() == [False, True, False, True] and one.positions.tolist() == [0, 4]
    assert (zero.keep ^ one.keep).all()  # every scored token on exactly one rank


def _trainers(overrides: list[str], unsplit: list[str]) -> tuple[RunConfig, RunConfig, dict]:
    """The 32k example under ``overrides`` (context parallel 8) and ``unsplit`` (1), and their
    actor_train's plan by context-parallel size."""
    from reroll.config.memory import KNOWN
    from reroll.plan import estimate

    path = Path(__file__).resolve().parents[2] / "examples" / "qwen3-8b-32k-rlvr_fsdp2" / "config.yaml"
    split = load_config(path, RunConfig, overrides)
    whole = load_config(path, RunConfig, [*overrides, *unsplit])
    trainer = {
        cp: {p.role: p for p in estimate(cfg, KNOWN["qwen3-8b"], prompt_tokens=512)}["actor_train"]
        for cp, cfg in ((8, split), (1, whole))
    }
    return split, whole, trainer


def _activations(p) -> float:
    return float(re.search(r"activations ([\d.]+)", p.parts).group(1))


def test_plan_puts_one_nth_of_a_row_on_each_rank():
    """The 32k example: each of 8 ranks holds 1/8 of a micro-batch's activations and scored logits (its
    columns), so it fits on 8x80 GB; the same run without context parallelism does not."""
    from reroll.plan import plan

    split, whole, trainer = _trainers([], ["strategy.context_parallel=1"])
    assert _activations(trainer[1]) / _activations(trainer[8]) == pytest.approx(
        8, rel=0.02
    )  # 0.1 GiB rounding
    assert plan(split, gpus=8, gpu_memory_gib=80)[1]
    assert not plan(whole, gpus=8, gpu_memory_gib=80)[1]
    assert trainer[1].gib > 0.9 * 80 > trainer[8].gib  # the trainer is what does not fit


def test_plan_of_megatron_context_parallel_puts_one_nth_of_a_row_on_each_rank():
    """The same on Megatron (strategy.megatron.context_parallel 8, TP 1): a rank holds 1/8 of the
    activations; its weights and gradients are not sharded over the data-parallel (and context-parallel)
    ranks, so the fit is not the question here."""
    from reroll.plan import plan

    megatron = [
        "strategy.name=megatron",
        "strategy.context_parallel=1",
        "strategy.megatron.context_parallel=8",
    ]
    split, _, trainer = _trainers(megatron, ["strategy.megatron.context_parallel=1"])
    assert _activations(trainer[1]) / _activations(trainer[8]) == pytest.approx(8, rel=0.02)
    assert "megatron, context parallel 8 (each rank" in plan(split, gpus=8, gpu_memory_gib=80)[0]
