"""Routing rows to domains, weighted rewards, shares, per-domain metrics, and timeouts in the worker."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch

from reroll.config.reward import RewardConfig, check_reward
from reroll.data.datasets import DomainSampler
from reroll.data.types import RewardItem, Sample
from reroll.errors import UserError
from reroll.rewards.base import RewardResult
from reroll.rewards.routing import RewardRouter, domain_metrics, normalize_by_domain, route
from reroll.roles.reward import RewardWorker


def slow(prompt, response, sample):
    time.sleep(5)
    return RewardResult(1.0)


def crash(prompt, response, sample):
    raise RuntimeError("reward bug")


def half(prompt, response, sample):
    return RewardResult(0.5, {"thing": 2})


def domains_cfg(**extra) -> RewardConfig:
    return RewardConfig(
        domains={
            "math": {
                "share": 0.5,
                "rewards": [{"fn": "exact_match"}, {"fn": f"{__name__}:half", "weight": 0.2}],
            },
            "chat": {"share": 0.5, "tags": ["ifeval", "if"], "rewards": [{"fn": "ifeval"}]},
        },
        **extra,
    )


def test_single_reward_config_is_unchanged():
    cfg = RewardConfig(fn="exact_match")
    assert route(cfg, "anything") == "default" and check_reward(cfg) == []
    assert RewardRouter(cfg).score("p", "4", {"answer": "4"}, "x") == RewardResult(1.0, {"correct": 1})


def test_weighted_sum_and_correct_of_a_domain():
    r = RewardRouter(domains_cfg()).score("p", "4", {"answer": "4"}, "math")
    assert r.score == pytest.approx(1.0 + 0.2 * 0.5)  # exact_match 1 x 1.0 + half 0.5 x 0.2
    assert r.details["correct"] == 1 and r.details[f"{__name__}:half/thing"] == 2


def test_routing_by_tags_and_unknown_tags():
    cfg = domains_cfg()
    assert route(cfg, "if") == "chat" and route(cfg, "math") == "math"
    with pytest.raises(UserError, match="tagged domain 'poetry'"):
        route(cfg, "poetry")
    assert route(domains_cfg(default_domain="chat"), "poetry") == "chat"


def test_config_problems_are_reported():
    bad = RewardConfig(
        fn="numeric_match",  # not the default: a value equal to it is indistinguishable from unset
        default_domain="nope",
        domains={
            "a": {"share": 0.7, "rewards": [{"fn": "exact_match"}]},
            "b": {"share": 0.7, "tags": ["a"], "rewards": [{"fn": "ifeval"}]},
        },
    )
    text = "\n".join(f"{p}: {m}" for p, m in check_reward(bad))
    assert "reward.fn: set either reward.fn/args" in text
    assert "add up to 1.4, not 1" in text
    assert "tag 'a' is also routed to 'a'" in text
    assert "'nope' is not one of the domains" in text


def test_domain_sampler_keeps_shares_and_resumes():
    by = {d: [Sample(f"{d}{i}", "p", {}, d) for i in range(7)] for d in ("a", "b", "c")}
    shares = {"a": 0.5, "b": 0.3, "c": 0.2}
    sampler = DomainSampler(by, shares, 4, seed=1)
    for _ in range(3):
        sampler.next_batch()
    saved = sampler.state()
    rest = [[s.uid for s in sampler.next_batch()] for _ in range(7)]
    counts = Counter(uid[0] for batch in rest for uid in batch)
    resumed = DomainSampler(by, shares, 4, seed=1)
    resumed.restore(saved)
    assert [[s.uid for s in resumed.next_batch()] for _ in range(7)] == rest
    assert all(len(b) == 4 for b in rest)
    # 10 batches of 4 = 40 prompts: exactly 20 / 12 / 8, although no single batch splits 4 that way.
    first3 = DomainSampler(by, shares, 4, seed=1)
    total = Counter(s.domain for _ in range(10) for s in first3.next_batch())
    assert total == {"a": 20, "b": 12, "c": 8} and sum(counts.values()) == 28


def test_domain_without_rows_is_an_error():
    with pytest.raises(UserError, match=r"domains \['b'\] have a share but no training rows"):
        DomainSampler({"a": [Sample("1", "p", {}, "a")], "b": []}, {"a": 0.5, "b": 0.5}, 2)


def test_per_domain_metrics_and_normalisation():
    results = [RewardResult(1.0, {"correct": 1}), RewardResult(0.0, {"correct": 0}), RewardResult(0.5)]
    m = domain_metrics(["math", "math", "chat"], results)
    assert m["reward/math/mean"] == 0.5 and m["reward/math/accuracy"] == 0.5
    assert m["reward/math/share"] == pytest.approx(2 / 3) and m["reward/chat/accuracy"] == 0.0
    cfg = RewardConfig(
        domains={
            "math": {"rewards": [{"fn": "exact_match"}], "normalize": "batch"},
            "chat": {"rewards": [{"fn": "ifeval"}]},
        }
    )
    out = normalize_by_domain(torch.tensor([1.0, 0.0, 0.5]), ["math", "math", "chat"], cfg)
    # math: mean 0.5, unbiased std 0.7071 -> +-0.7071; chat untouched.
    assert torch.allclose(out, torch.tensor([0.7071, -0.7071, 0.5]), atol=1e-3)


def test_worker_bounds_each_call_and_counts_failures():
    cfg = RewardConfig(
        threads=2,
        sample_timeout_s=0.5,
        error_score=-1.0,
        domains={
            name: {"rewards": [{"fn": fn, "isolation": "thread"}]}  # processes: test_reward_isolation
            for name, fn in {
                "ok": f"{__name__}:half",
                "slow": f"{__name__}:slow",
                "bug": f"{__name__}:crash",
            }.items()
        },
    )
    worker = RewardWorker(0, cfg)
    items = [RewardItem("p", "r", {}, tag) for tag in ("slow", "ok", "bug", "slow", "ok")]
    start = time.monotonic()
    results = worker.score(items)
    assert time.monotonic() - start < 2.5  # two slow calls in parallel, each cut at 0.5 s
    assert [r.score for r in results] == [-1.0, 0.5, -1.0, -1.0, 0.5]
    m = domain_metrics([it.domain for it in items], results)
    assert (m["reward/timeouts"], m["reward/errors"]) == (2.0, 1.0)


def _run_config(tmp_path, rows, **reward):
    import json

    from reroll.config.schema import RunConfig

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return RunConfig.model_validate(
        {
            "pipeline": "rlvr",
            "model": {"path": str(tmp_path / "m")},
            "data": {"train_files": [str(path)], "prompt_template": "{question}", "answer_field": "solution"},
            "rollout": {"batch_size": 4, "group_size": 2},
            "reward": reward,
        }
    )


def test_rows_are_checked_for_their_domains_fields(tmp_path):
    from reroll.pipelines.common import load_data, prompt_sampler

    domains = {
        "math": {"share": 0.5, "rewards": [{"fn": "math_verify"}]},
        "code": {"share": 0.5, "rewards": [{"fn": "code_tests"}]},
    }
    good = [
        {"domain": "math", "question": "1+1", "solution": "2"},  # answer_field renames the answer
        {"domain": "code", "question": "print 1", "tests": [{"stdin": "", "stdout": "1"}]},
    ]
    train, _ = load_data(_run_config(tmp_path, good, domains=domains))
    assert train[0].row["answer"] == "2" and "answer" not in train[1].row
    cfg = _run_config(tmp_path, good, domains=domains)
    assert {s.domain for s in prompt_sampler(cfg, train).next_batch()} == {"math", "code"}
    with pytest.raises(UserError, match="domain 'code'\\) has no field 'tests'"):
        load_data(_run_config(tmp_path, [*good, {"domain": "code", "question": "q"}], domains=domains))
    with pytest.raises(UserError, match="tagged domain 'chat'"):
        load_data(_run_config(tmp_path, [*good, {"domain": "chat", "question": "q"}], domains=domains))
