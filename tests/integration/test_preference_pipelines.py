"""The reward_model and dpo pipelines through the real CLI: they learn in the right direction, the reward
model loads as a Hugging Face sequence classifier and scores as it trained, strategies agree, a bad pair
fails `reroll validate`, and a resumed run repeats the uninterrupted one.

The full-size runs (the examples, with the acceptance bars) are the ``long`` tests at the end.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from reroll.data.preferences import write_arithmetic_preferences
from reroll.runtime.metrics import read_metrics
from reroll.strategies import strategy_available
from tests.conftest import ROOT, reroll_cli, reroll_here, step_metrics

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def prefs(assets, tmp_path_factory) -> dict[str, Path]:
    """Arithmetic pairs over the same questions as the session's data (same seed, sizes and operands)."""
    return write_arithmetic_preferences(
        tmp_path_factory.mktemp("prefs"), n_train=400, n_test=64, max_operand=30, seed=0
    )


def pref_config(tmp_path: Path, assets, prefs, pipeline: str, **sections) -> Path:
    cfg = {
        "pipeline": pipeline,
        "name": pipeline,
        "output_dir": str(tmp_path / "runs" / "{name}"),
        "total_steps": 3,
        "model": {"path": str(assets["model"])},
        "preference": {
            "train_files": [str(prefs["train"])],
            "eval_files": [str(prefs["test"])],
            "batch_size": 16,
        },
        "optim": {"lr": 1e-3, "micro_batch_size": 16},
        "eval": {"every": 0},
        "roles": {r: {"torch_threads": 1} for r in ("actor_train", "actor_infer", "reference", "reward")},
        "logging": {"tensorboard": False},
    }
    if pipeline == "dpo":
        cfg |= {
            "data": {
                "train_files": [str(assets["train"])],
                "eval_files": [str(assets["test"])],
                "prompt_template": "{question}=",
                "chat_template": False,  # from scratch, as the example: raw text
            },
            "rollout": {"max_new_tokens": 4},
        }
    for key, value in sections.items():
        cfg[key] = (
            {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
        )
    path = tmp_path / f"{pipeline}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_reward_model_learns_and_loads_as_a_sequence_classifier(tmp_path, assets, prefs):
    """The reward model fits 16 pairs, all of them in every step's batch, and the checkpoint scores them
    in Hugging Face as the run did.

    Fitting, not held-out accuracy: this model is untrained, and 40 steps on the 400 training pairs left
    the loss at ln 2 on one CPU and just under it on another (issue 39, item 10). On 16 pairs it falls
    steeply: a score head on 64 features separates 16 pairs (16 directions in 64 dimensions), and the
    body trains too. Measured at four CPU kernel settings alike: mean loss 0.63 over the first ten
    steps, 0.041 over the last ten, 0.013 at step 40; held-out accuracy is the long example test's."""
    few = few_pairs(tmp_path, prefs)
    cfg = pref_config(
        tmp_path, assets, prefs, "reward_model", total_steps=40, eval={"every": 20},
        preference={"train_files": [str(few)], "eval_files": [str(few)]},
    )  # fmt: skip
    out = reroll_here("train", cfg, "runtime.backend=local")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path / "runs" / "reward_model")
    assert rows[0]["eval/accuracy"] == 0.0  # the new head starts at zero: every pair a tie
    losses = [r["rm/loss"] for r in rows if "rm/loss" in r]
    assert len(losses) == 40 and losses[0] == pytest.approx(math.log(2), abs=1e-6), losses  # the tie
    assert sum(losses[-10:]) / 10 < math.log(2) / 4, losses  # it learns: far below the tie
    # a mean under ln 2 / 16 over the 16 pairs leaves each pair's own loss under ln 2: all ranked right
    assert losses[-1] < math.log(2) / 16, losses
    assert rows[-1]["eval/accuracy"] == 1.0, rows[-1]

    chosen, rejected = hf_pair_scores(
        tmp_path / "runs" / "reward_model" / "checkpoints" / "step_000040", {"test": few}
    )
    # what the run measured is what a user of the checkpoint measures
    assert float((chosen > rejected).float().mean()) == pytest.approx(rows[-1]["eval/accuracy"])
    assert float(torch.cat([chosen, rejected]).mean()) == pytest.approx(
        rows[-1]["eval/reward_mean"], abs=1e-4
    )


def few_pairs(tmp_path: Path, prefs, n: int = 16) -> Path:
    """The first ``n`` training pairs, for a run that fits them (``preference.batch_size`` 16: all of
    them in every step)."""
    path = tmp_path / "few.jsonl"
    path.write_text("".join(Path(prefs["train"]).read_text().splitlines(keepends=True)[:n]))
    return path


def hf_pair_scores(checkpoint: Path, prefs) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of ``prefs["test"]`` scored by ``checkpoint/model`` loaded as a user would, with Hugging
    Face alone."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(checkpoint / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint / "model")
    pairs = [json.loads(line) for line in Path(prefs["test"]).read_text().splitlines()]
    texts = [p["prompt"] + p[side] + tokenizer.eos_token for side in ("chosen", "rejected") for p in pairs]
    batch = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        scores = model(**batch).logits[:, 0]
    return scores[: len(pairs)], scores[len(pairs) :]


@pytest.mark.parametrize(
    "strategy",
    [
        "torch",
        pytest.param("fsdp2", marks=pytest.mark.long),
        pytest.param("deepspeed", marks=pytest.mark.long),
    ],
)
def test_reward_model_with_lora_trains_adapters_and_the_head(tmp_path, assets, prefs, strategy):
    """LoRA on the body, the new score head trained in full; the checkpoint's model/ has the adapters
    merged, so Hugging Face alone loads it and scores as the run did; adapter/ holds adapters and head.
    It fits 16 pairs as the test above does (measured: mean loss 0.68 over the first five steps, 0.29
    over the last five, 15 of 16 pairs ranked right; on the 400 pairs 0.69 and 0.66, 39 of 64 held-out
    pairs right: a margin of the size another CPU's sums took from the test above)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    lora = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"], "sync": "merged"}
    few = few_pairs(tmp_path, prefs)
    cfg = pref_config(
        tmp_path, assets, prefs, "reward_model", total_steps=20, eval={"every": 20},
        strategy={"name": strategy, "lora": lora}, optim={"lr": 3e-3, "micro_batch_size": 16},
        preference={"train_files": [str(few)], "eval_files": [str(few)]},
    )  # fmt: skip
    out = reroll_here("train", cfg, "runtime.backend=local")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path / "runs" / "reward_model")
    losses = [r["rm/loss"] for r in rows if "rm/loss" in r]
    assert len(losses) == 20 and losses[0] == pytest.approx(math.log(2), abs=1e-6), losses  # the tie
    assert sum(losses[-5:]) / 5 < 0.75 * math.log(2), losses  # it learns, by a margin
    assert rows[-1]["eval/accuracy"] >= 0.75, rows[-1]

    ckpt = tmp_path / "runs" / "reward_model" / "checkpoints" / "step_000020"
    chosen, rejected = hf_pair_scores(ckpt, {"test": few})
    assert float((chosen > rejected).float().mean()) == pytest.approx(rows[-1]["eval/accuracy"])
    adapter = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    assert any(".lora_A." in k for k in adapter) and "base_model.model.score.weight" in adapter
    assert adapter["base_model.model.score.weight"].abs().sum() > 0  # the head (zero at the start) learned
    # the merged model differs from the start in the adapted projections only
    start = AutoModelForCausalLM.from_pretrained(assets["model"]).model.state_dict()

    merged = AutoModelForSequenceClassification.from_pretrained(ckpt / "model").model.state_dict()
    changed = {k for k, v in start.items() if not torch.equal(v, merged[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed), changed


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param("fsdp2", marks=pytest.mark.long),  # 36 s on 2 cores
        pytest.param("deepspeed", marks=pytest.mark.long),
        "packed",  # torch, each micro-batch's rows packed into one sequence
    ],
)
def test_reward_model_strategies_take_the_torch_step(tmp_path, assets, prefs, strategy):
    if strategy != "packed" and not strategy_available(strategy):
        pytest.skip(f"{strategy} is not installed")
    cfg = pref_config(tmp_path, assets, prefs, "reward_model", total_steps=2)
    for name in ("torch", strategy):
        how = ["strategy.name=torch", "optim.packing=true"] if name == "packed" else [f"strategy.name={name}"]
        out = reroll_here("train", cfg, f"name={name}", *how, "runtime.backend=local")
        assert out.returncode == 0, out.stderr[-3000:]
    for step in (1, 2):
        want, got = (step_metrics(tmp_path / "runs" / n, step) for n in ("torch", strategy))
        for key in ("rm/loss", "rm/margin", "rm/reward_mean"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, key)


@pytest.mark.parametrize("strategy", ["fsdp2", pytest.param("deepspeed", marks=pytest.mark.long)])
def test_two_sharded_ranks_packing_a_reward_models_rows_take_the_one_rank_step(
    tmp_path, assets, prefs, strategy
):
    """fsdp2, and ZeRO-3, at two ranks with each micro-batch's rows packed into one sequence: the score head's
    per-token output is read inside the forward, and the sequence classifier's pooled output is kept in the
    graph, so that the sharded backward reaches the head (without it fsdp2 had resharded the head before its
    backward). Two SGD steps equal one torch rank's on padded rows (tests/same_step.py: the bound and why);
    the second step's gradient reaches the body too, the score head having started at zero."""
    if not strategy_available(strategy):
        pytest.skip(f"{strategy} is not installed")
    from reroll.config.loader import load_config
    from reroll.config.schema import RunConfig
    from reroll.pipelines.reward_model import RewardModel
    from reroll.roles.trainer import TrainerGroup
    from reroll.runtime.actors import start_ray
    from tests.same_step import assert_same_steps, use_sgd_steps

    path = pref_config(tmp_path, assets, prefs, "reward_model", optim={"micro_batch_size": 4})
    start_ray(None)
    pipeline = RewardModel(load_config(path, RunConfig))
    batch = pipeline.encode(pipeline.sampler.next_batch())

    def two_steps(*overrides: str) -> tuple[dict, dict, list[dict]]:
        group = TrainerGroup("actor_train", load_config(path, RunConfig, list(overrides)), trainable=True)
        try:
            use_sgd_steps(group, 0.1)
            before = group.weight_buckets(1.0).tensors()
            metrics = [group.train(batch, pipeline.objective) for _ in range(2)]
            return before, group.weight_buckets(1.0).tensors(), metrics
        finally:
            group.shutdown()

    w0, one, m1 = two_steps("strategy.name=torch", "optim.packing=false")
    sharded = ["strategy.deepspeed.zero_stage=3"] if strategy == "deepspeed" else []
    _, two, m2 = two_steps(
        f"strategy.name={strategy}", "optim.packing=true", "roles.actor_train.world_size=2", *sharded
    )
    assert_same_steps(one, two, w0, steps=2)
    assert m2[0]["rm/loss"] == pytest.approx(m1[0]["rm/loss"], rel=1e-6)  # log 2: the head starts at zero


def test_bad_pair_fails_validate_naming_file_and_row(tmp_path, assets, prefs):
    bad = tmp_path / "bad.jsonl"
    rows = [json.loads(line) for line in Path(prefs["train"]).read_text().splitlines()[:3]]
    rows[1]["rejected"] = rows[1]["chosen"]
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = pref_config(tmp_path, assets, prefs, "dpo", preference={"train_files": [str(bad)]})
    out = reroll_here("validate", cfg)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"{bad}: row 2: 'chosen' and 'rejected' are the same" in out.stderr
    assert "preference.train_files[0]" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "pipeline",
    [
        pytest.param("reward_model", marks=pytest.mark.long),
        pytest.param("reward_model-lora", marks=pytest.mark.long),
        "dpo",
    ],
)  # the reward model's resume is the same code path as dpo's, 22 s each on 2 cores
def test_resumed_preference_run_repeats_the_straight_one(tmp_path, assets, prefs, pipeline):
    """The sampler's position and DPO's cached reference log-probs come back from the checkpoint; with
    LoRA, the reward model's adapters and its head (adapter/)."""
    sections: dict = {"checkpoint": {"every": 1, "keep_last": 3}}
    if pipeline == "reward_model-lora":
        pipeline, sections["strategy"] = "reward_model", {"lora": {"rank": 8, "alpha": 16}}
    if pipeline == "dpo":
        sections |= {"sft": {"steps": 5, "batch_size": 16, "lr": 1e-3}, "data": {"eval_limit": 8}}
    cfg = pref_config(tmp_path, assets, prefs, pipeline, **sections)
    for args in (["name=straight"], ["name=stopped", "total_steps=2"], ["name=stopped", "--resume"]):
        out = reroll_here("train", cfg, *args, "runtime.backend=local")
        assert out.returncode == 0, out.stderr[-3000:]
    straight, resumed = (step_metrics(tmp_path / "runs" / n, 3) for n in ("straight", "stopped"))
    assert straight.keys() == resumed.keys()
    for key in straight:
        assert resumed[key] == pytest.approx(straight[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("variant", ["full", "lora", "on_the_fly", "packed"])
def test_dpo_starts_at_the_reference_and_moves_the_margin(tmp_path, assets, prefs, variant):
    """Step 1's policy is the reference (LoRA: the base model with adapters off), so its loss is log 2 and
    its margins 0; training then opens a positive margin on the held-out pairs."""
    extra = {"total_steps": 6, "dpo": {"beta": 0.5}, "optim": {"lr": 3e-3}}
    if variant == "lora":
        extra["strategy"] = {"lora": {"rank": 8, "alpha": 16, "sync": "merged"}}
    if variant == "on_the_fly":
        extra["dpo"] = {"beta": 0.5, "reference": "on_the_fly"}
    if variant == "packed":
        extra["optim"] = {"lr": 3e-3, "packing": True}
    cfg = pref_config(tmp_path, assets, prefs, "dpo", data={"eval_limit": 8}, **extra)
    out = reroll_here("train", cfg, "runtime.backend=local")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["step"]: r for r in read_metrics(tmp_path / "runs" / "dpo")}
    assert rows[1]["dpo/loss"] == pytest.approx(0.693147, abs=1e-5)  # -log sigmoid(0)
    assert rows[1]["dpo/margins"] == pytest.approx(0.0, abs=1e-6)
    assert rows[0]["eval/margins"] == pytest.approx(0.0, abs=1e-6)
    assert rows[6]["eval/margins"] > 0.0, rows[6]  # the mean held-out margin (its sign; six steps only)


@pytest.mark.slow
def test_dpo_short_raises_accuracy_and_margin(tmp_path, assets, prefs):
    """SFT warm start, then DPO with the chosen responses' NLL (``dpo.sft_weight``): held-out exact match
    and held-out margins go up. Plain DPO from this weaker start (64 held-out questions, a 60-200 step
    warm start) measured 0.047 -> 0.031 and 0.109 -> 0.078: its exact-match gain is the long test's (the
    example, from a 0.286 start). This one measured 0.109 -> 0.125 exact match (one question of 64, so
    the direction only) and held-out margins 0 -> 0.104 on the 2-core dev machine."""
    cfg = pref_config(
        tmp_path,
        assets,
        prefs,
        "dpo",
        total_steps=60,
        sft={"steps": 200, "batch_size": 32, "lr": 2e-3},
        optim={"lr": 3e-4},
        dpo={"beta": 0.1, "sft_weight": 1.0},
    )
    out = reroll_here("train", cfg, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path / "runs" / "dpo")
    before, after = rows[0], rows[-1]
    assert after["eval/accuracy"] > before["eval/accuracy"], (before, after)
    assert after["eval/margins"] > before["eval/margins"], (before, after)


def _example(name: str) -> Path:
    return ROOT / "examples" / name


@pytest.mark.long
def test_reward_model_example_reaches_090(tmp_path):
    """The example chain (SFT start, then the reward model) to held-out pairwise accuracy >= 0.90."""
    run = [f"output_dir={tmp_path}/{{name}}"]
    assets = [
        f"model.path={tmp_path}/assets/tiny-arithmetic",
        f"data.train_files=[{tmp_path}/assets/arithmetic/train.jsonl]",
        f"data.eval_files=[{tmp_path}/assets/arithmetic/test.jsonl]",
    ]
    out = reroll_cli("train", _example("reward_model/sft_start.yaml"), *run, *assets, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    sft = f"{tmp_path}/reward-model-sft/checkpoints/step_000800/model"
    pairs = [
        f"preference.train_files=[{tmp_path}/prefs/train.jsonl]",
        f"preference.eval_files=[{tmp_path}/prefs/test.jsonl]",
    ]
    out = reroll_cli(
        "train", _example("reward_model/arithmetic_rm.yaml"), *run, f"model.path={sft}", *pairs, timeout=3600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path / "reward-model")
    assert rows[-1]["eval/accuracy"] >= 0.90, rows[-1]


@pytest.mark.long
def test_dpo_example_raises_accuracy_by_5_points(tmp_path):
    """The example as shipped (seed 0). Its gain moves with the trajectory: 500 held-out questions near
    35 % exact match give each evaluation a standard error of about 2 points, and seeds 0-4 gained +12.4,
    +10.2, +6.0, +7.6 and +3.0 points (the last from a 0.486 start). Seed 0's run gains +12.4 (README)."""
    overrides = [
        f"output_dir={tmp_path}/{{name}}",
        f"model.path={tmp_path}/assets/tiny-arithmetic",
        f"data.train_files=[{tmp_path}/assets/arithmetic/train.jsonl]",
        f"data.eval_files=[{tmp_path}/assets/arithmetic/test.jsonl]",
        f"preference.train_files=[{tmp_path}/prefs/train.jsonl]",
        f"preference.eval_files=[{tmp_path}/prefs/test.jsonl]",
    ]
    out = reroll_cli("train", _example("dpo/arithmetic_dpo.yaml"), *overrides, timeout=3600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path / "dpo")
    before, after = rows[0], rows[-1]
    assert after["eval/accuracy"] - before["eval/accuracy"] >= 0.05, (before, after)
    assert after["eval/margins"] > before["eval/margins"]
