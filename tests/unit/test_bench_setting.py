"""benchmarks/grpo_step.py's one setting per size (``bench_setting``, a ``PeerSpec``): reroll's row config
and each peer's own settings say the same LoRA, lengths and offload, from that one object."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.grpo_step import (
    ALPHABET,
    LONG_TAIL_CAP,
    bench_setting,
    parser,
    reroll_config,
    resolved,
    setting_problems,
)
from benchmarks.peers.spec import PeerSpec
from benchmarks.peers.trl_grpo import peft_fields, trl_config_fields
from benchmarks.peers.verl_grpo import overrides, verl_model
from reroll.config.training import LoRAConfig


def setting_for(tmp_path: Path, size: str, *argv: str):
    args = resolved(parser().parse_args(["--device", "cuda", *argv]))
    model = tmp_path / f"model-{size}"
    return args, bench_setting(tmp_path, model, args, size), model


def verl_settings(setting, tmp_path: Path) -> dict[str, str]:
    pairs = (o.lstrip("+").split("=", 1) for o in overrides(setting, tmp_path, tmp_path / "d.parquet"))
    return dict(pairs)


def test_lora_is_the_same_in_every_row(tmp_path):
    args, setting, model = setting_for(tmp_path, "7b", "--tune", "lora")
    default = LoRAConfig()
    reroll = reroll_config(tmp_path, model, args, "ray", setting)["strategy"]["lora"]
    assert (reroll["rank"], reroll["alpha"], reroll["target_modules"]) == (
        default.rank,
        default.alpha,
        default.target_modules,
    )
    trl = peft_fields(setting)
    assert (trl["r"], trl["lora_alpha"], trl["target_modules"]) == (
        default.rank,
        default.alpha,
        default.target_modules,
    )
    verl = verl_settings(setting, tmp_path)
    m = "actor_rollout_ref.model"
    assert verl[f"{m}.lora_rank"] == str(default.rank)
    assert float(verl[f"{m}.lora_alpha"]) == default.alpha
    assert verl[f"{m}.target_modules"] == "[" + ",".join(default.target_modules) + "]"
    # 7B: activation checkpointing everywhere, and LoRA needs no offload
    assert setting.gradient_checkpointing and not setting.offload


def test_full_fine_tuning_has_no_adapters_and_offloads_at_7b(tmp_path):
    args, setting, model = setting_for(tmp_path, "7b")
    assert setting.lora is None and peft_fields(setting) is None
    assert reroll_config(tmp_path, model, args, "ray", setting)["strategy"]["lora"] is None
    assert setting.offload
    assert trl_config_fields(replace(setting, row="trl-vllm"))["vllm_enable_sleep_mode"]
    verl = verl_settings(setting, tmp_path)
    assert verl["actor_rollout_ref.actor.fsdp_config.optimizer_offload"] == "true"
    _, small, _ = setting_for(tmp_path, "0.5b")
    assert not small.offload


@pytest.mark.parametrize("argv", [["--new-tokens", "2048"], ["--lengths", "long-tail"]])
def test_every_row_is_sized_for_the_longest_response(tmp_path, argv):
    args, setting, model = setting_for(tmp_path, "0.5b", *argv)
    new = args.new_tokens
    assert new == (LONG_TAIL_CAP if args.lengths == "long-tail" else 2048)
    longest = args.prompt_len + new + 8  # the prompt, its chat template's two tokens, the response
    cfg = reroll_config(tmp_path, model, args, "ray", setting)
    assert cfg["rollout"]["max_new_tokens"] == new and cfg["rollout"]["vllm"]["max_model_len"] == longest
    trl = trl_config_fields(replace(setting, row="trl-vllm"))
    assert trl["max_completion_length"] == new and trl["vllm_max_model_length"] == longest
    verl = verl_settings(setting, tmp_path)
    assert verl["data.max_response_length"] == str(new)
    assert verl["actor_rollout_ref.rollout.max_model_len"] == str(longest)


def test_settings_refused_up_front():
    args = parser().parse_args(["--lengths", "long-tail", "--rows", "ray-tail", "--new-tokens", "1024"])
    problems = setting_problems(args, ["moe", "13b"])
    assert any("13b" in p for p in problems)
    assert any("moe" in p for p in problems)
    assert any("--tail-threshold (2048)" in p for p in problems)
    assert setting_problems(parser().parse_args(["--lengths", "long-tail"]), ["0.5b", "7b"]) == []


def test_each_switch_row_changes_only_its_own_setting(tmp_path):
    """The rows that measure a setting against the default in the same call: ``ray-fusedhead``
    (``model.fused_head: true``), ``ray-ownnorm`` (``model.fused_norm: false``), ``ray-ckpt`` (every
    layer checkpointed); ``ray`` keeps the defaults (the logits head, fused norms) and the bench's count."""
    args, setting, model = setting_for(tmp_path, "0.5b")
    rows = {
        m: reroll_config(tmp_path, model, args, m, setting)["model"]
        for m in ("ray", "ray-fusedhead", "ray-ownnorm", "ray-ckpt")
    }
    assert rows["ray-ckpt"].pop("gradient_checkpointing") is True
    assert rows["ray-ckpt"] == {k: v for k, v in rows["ray"].items() if k != "gradient_checkpointing"}
    assert (rows["ray"]["fused_head"], rows["ray"]["fused_norm"]) == (False, True)
    assert (rows["ray-fusedhead"]["fused_head"], rows["ray-fusedhead"]["fused_norm"]) == (True, True)
    assert (rows["ray-ownnorm"]["fused_head"], rows["ray-ownnorm"]["fused_norm"]) == (False, False)


def test_the_async_row_runs_one_step_off_policy_where_nothing_moves(tmp_path):
    """``ray-async``: the ``ray`` row with ``rollout.async_steps: 1`` and ``placement.offload: never``, a
    setting the rollout source takes on the one GPU (the engine generates beside the trainers)."""
    from reroll.config.placement import rollout_source_problems
    from reroll.config.schema import RunConfig

    args, setting, model = setting_for(tmp_path, "0.5b")
    ray, run = (reroll_config(tmp_path, model, args, m, setting) for m in ("ray", "ray-async"))
    assert (run["rollout"].pop("async_steps"), run["placement"].pop("offload")) == (1, "never")
    ray["placement"].pop("offload")
    assert run | {"name": ray["name"]} == ray  # its own name (the run's directory)
    cfg = RunConfig.model_validate(reroll_config(tmp_path, model, args, "ray-async", setting))
    assert rollout_source_problems(cfg) == []


def test_a_compile_suffix_is_the_row_before_it_with_model_compile(tmp_path):
    """``ray-compile`` is ``ray`` with ``model.compile``, ``ray-async-compile`` is ``ray-async`` with it:
    nothing else differs but the run's name."""
    args, setting, model = setting_for(tmp_path, "0.5b")
    for row in ("ray", "ray-async", "ray-ckpt"):
        plain = reroll_config(tmp_path, model, args, row, setting)
        compiled = reroll_config(tmp_path, model, args, f"{row}-compile", setting)
        assert (plain["model"].pop("compile"), compiled["model"].pop("compile")) == (False, True)
        assert compiled["name"] == plain["name"].replace(row, f"{row}-compile")
        assert compiled | {"name": plain["name"], "output_dir": plain["output_dir"]} == plain


def test_a_rows_features_compose_each_as_it_does_alone(tmp_path):
    """``ray-async-dp2-compile`` is ``ray`` with what ``ray-async``, ``ray-dp2`` and ``ray-compile`` each
    change on their own, and nothing else but its name; a word the bench does not know, or two words that
    each set what moves between phases, are refused before anything is built, naming the row."""
    from benchmarks.grpo_step import row_features
    from reroll.config.placement import rollout_source_problems
    from reroll.config.schema import RunConfig

    args, setting, model = setting_for(tmp_path, "0.5b")

    def flat(tree: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in tree.items():
            out |= flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value}
        return out

    def changes(row: str) -> dict:
        base, cfg = (flat(reroll_config(tmp_path, model, args, r, setting)) for r in ("ray", row))
        keys = (base.keys() | cfg.keys()) - {"name", "output_dir"}
        return {k: cfg.get(k) for k in keys if base.get(k) != cfg.get(k)}

    alone = changes("ray-async") | changes("ray-dp2") | changes("ray-compile")
    assert changes("ray-async-dp2-compile") == alone
    assert alone["rollout.async_steps"] == 1 and alone["roles.actor_infer.world_size"] == 2
    composed = RunConfig.model_validate(
        reroll_config(tmp_path, model, args, "ray-async-dp2-compile", setting)
    )
    assert rollout_source_problems(composed) == []
    assert row_features("ray-dp4-ckpt") == (True, {"dp": 4, "ckpt": 1})
    assert changes("ray-mb16") == {"optim.micro_batch_size": 16}
    with pytest.raises(ValueError, match="'mb0'"):
        row_features("ray-mb0")
    assert row_features("local") == (False, {})
    bad = parser().parse_args(["--rows", "ray-asyc,ray-async-offload,ray"])
    problems = setting_problems(bad, ["0.5b"])
    assert len(problems) == 2
    assert "'ray-asyc'" in problems[0] and "unknown feature 'asyc'" in problems[0]
    assert "async and offload" in problems[1]


def test_an_overlapped_rows_engine_rate_is_the_engines_own():
    """An async row's generate phase is the wait for a generation that ran beside the previous step: its
    engine rate is the engine's own (seconds inside generate), not new tokens over that wait."""
    from benchmarks.grpo_step import add_rates

    def rate(async_steps: int) -> float:
        m = {"timing/generate": 0.01, "tokens/generated": 1000, "engine/tokens_per_s": 5000.0}
        rows = [{"metrics": m, "new_tokens": 1000, "async_steps": async_steps}]
        add_rates(rows, 10, None)
        return rows[0]["engine_tok_s"]

    assert (rate(0), rate(1)) == (100_000, 5000.0)


def test_verl_samples_from_the_whole_vocabulary_and_tokenizes_as_the_others(tmp_path):
    """verl's rollout masks every logit at or past ``len(tokenizer)``: its model directory's tokenizer
    is as long as the model's vocabulary (not the ~40 characters, which cut its responses to a mean of
    43 tokens where the other rows ran to the cap), knows verl's newline and ``<|im_end|>``, and
    tokenizes the prompts as the bench's tokenizer does."""
    from transformers import AutoTokenizer

    from reroll.models.tiny import build_tiny_model

    vocab = 4096
    model = build_tiny_model(tmp_path / "m", alphabet=ALPHABET, hidden_size=64, num_heads=2, vocab_size=vocab)
    spec = PeerSpec("verl", str(model), "", str(tmp_path / "o.json"), 1, 1, 8, 8, 1, 1)
    ours, theirs = (
        AutoTokenizer.from_pretrained(model),
        AutoTokenizer.from_pretrained(verl_model(spec, tmp_path)),
    )
    assert len(theirs) == vocab
    assert len(theirs.encode("\n", add_special_tokens=False)) == 1
    assert theirs.convert_tokens_to_ids("<|im_end|>") < vocab
    prompt = ALPHABET * 2
    assert theirs.encode(prompt, add_special_tokens=False) == ours.encode(prompt, add_special_tokens=False)
    chat = [{"role": "user", "content": prompt}]
    assert theirs.apply_chat_template(chat, tokenize=False) == ours.apply_chat_template(chat, tokenize=False)
    assert isinstance(theirs.decode([vocab - 3, 5]), str)  # a filler and a character decode
