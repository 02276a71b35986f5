"""Chat templates: one rendering for rlvr, sft, evaluation and agentic; auto follows the tokenizer."""

from __future__ import annotations

import json

import pytest

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.data.arithmetic import ARITHMETIC_ALPHABET
from reroll.data.chat import ChatTemplateError, PromptFormat
from reroll.data.coverage import lost_characters_warning
from reroll.data.datasets import load_samples
from reroll.data.types import Completion, RewardItem
from reroll.envs.trajectory import TrajectoryBuilder
from reroll.models.loading import load_tokenizer
from reroll.models.tiny import build_tiny_model, char_tokenizer
from reroll.pipelines.common import evaluate, sft_batch
from reroll.pipelines.preflight import check_inputs
from reroll.pipelines.rlvr import RLVR
from reroll.pipelines.sft import SFT
from tests.conftest import write_config

ALPHABET = ARITHMETIC_ALPHABET + "abcdefghijklmnopqrstuvwxyz."
SYSTEM = "add."


def test_auto_uses_the_template_only_when_the_tokenizer_has_one():
    chat, raw = char_tokenizer(ALPHABET), char_tokenizer(ALPHABET, chat_template=False)
    assert PromptFormat(chat).chat and not PromptFormat(raw).chat
    assert PromptFormat(chat).prompt("12+34=") == "<|user|>12+34=<|assistant|>"
    assert PromptFormat(raw).prompt("12+34=") == "12+34="  # a base tokenizer: the template's text
    assert PromptFormat(chat, chat_template=False).prompt("12+34=") == "12+34="
    with_system = PromptFormat(chat, chat_template=True, system_prompt=SYSTEM)
    assert with_system.prompt("1+2=") == "<|system|>add.<|user|>1+2=<|assistant|>"
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        PromptFormat(raw, chat_template=True)
    with pytest.raises(ChatTemplateError, match=r"data\.system_prompt is set"):
        PromptFormat(raw, system_prompt=SYSTEM)  # auto found no template: nowhere to put it
    # a response ends where the engine stops: the template's end of turn (<eos> here), else eos
    assert PromptFormat(chat).end_of_response == [chat.eos_token_id]
    assert PromptFormat(raw).end_of_response == [raw.eos_token_id]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("chat") / "model", alphabet=ALPHABET, hidden_size=64, num_heads=2
    )


def _config(tmp_path, assets, model, pipeline: str, preference=None, distill=None, **data) -> RunConfig:
    sections = {"preference": preference} if preference else {}
    sections |= {"distill": distill} if distill else {}
    path = write_config(
        tmp_path / f"{pipeline}.yaml",
        assets,
        pipeline=pipeline,
        model={"path": str(model)},
        data={"system_prompt": SYSTEM, "eval_limit": 4, **data},
        sft={"steps": 2, "batch_size": 4},
        **sections,
    )
    return load_config(path, RunConfig)


class _Recorder:
    """actor_infer and reward for ``evaluate``: records the prompts and answers each with '0'."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.items: list[RewardItem] = []
        self.actor_infer, self.reward = self, self

    def generate(self, prompts, params, phase="generate"):
        self.prompts += prompts
        return [[Completion([], [], "0", [], "stop")] for _ in prompts]

    def score(self, items, phase="reward"):
        from reroll.rewards.base import RewardResult

        self.items += items
        return [RewardResult(0.0) for _ in items]


def test_a_row_renders_identically_in_rlvr_sft_evaluation_and_agentic(tmp_path, assets, chat_model):
    rlvr = RLVR(_config(tmp_path, assets, chat_model, "rlvr"))
    tok = load_tokenizer(str(chat_model))
    expected = tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "2+3="}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert expected == "<|system|>add.<|user|>2+3=<|assistant|>"
    sft = SFT(_config(tmp_path, assets, chat_model, "sft"))
    row = rlvr.rows.train[0]
    assert row.prompt == tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row.row["question"] + "="}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert [s.prompt for s in rlvr.rows.train] == [
        s.prompt for s in sft.rows.targets
    ]  # rollouts and SFT rows
    # evaluation sends the held-out prompts as they are; the reward sees the user message
    for pipeline in (rlvr, sft):
        roles = _Recorder()
        evaluate(pipeline.cfg, roles, pipeline.held_out)  # type: ignore[arg-type]
        assert roles.prompts == [s.prompt for s in rlvr.held_out]
        assert all(
            p.startswith("<|system|>add.<|user|>") and p.endswith("<|assistant|>") for p in roles.prompts
        )
        assert [i.prompt for i in roles.items] == [s.row["question"] + "=" for s in rlvr.held_out]
    # the SFT warm start of rlvr and the sft pipeline train on the same tokens
    a = rlvr.rows.target_batch(rlvr.rows.train[:4])
    b = sft.rows.target_batch(sft.rows.targets[:4])
    assert a.input_ids.tolist() == b.input_ids.tolist()
    # the start-of-run character check reads the texts as written, not the template's special tokens
    assert lost_characters_warning(tok, rlvr.texts()) is None
    assert lost_characters_warning(tok, [s.prompt for s in rlvr.rows.train[:1]]) is not None  # '<|user|>'
    # agentic: an episode's first prompt is the same rendering of its first observation
    traj = TrajectoryBuilder(tok).start_episode("2+3=", SYSTEM)
    assert traj.ids == tok.encode(rlvr.rows.format.prompt("2+3="), add_special_tokens=False)


def test_false_gives_the_prompt_template_text(tmp_path, assets, chat_model):
    rlvr = RLVR(_config(tmp_path, assets, chat_model, "rlvr", chat_template=False, system_prompt=None))
    assert all(s.prompt == s.row["question"] + "=" for s in rlvr.rows.train)


def test_sft_with_a_chat_template_has_loss_only_on_the_response(tmp_path, chat_model):
    tok = load_tokenizer(str(chat_model))
    fmt = PromptFormat(tok, system_prompt=SYSTEM)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        json.dumps({"question": "12+34", "answer": "46"})
        + "\n"
        + json.dumps({"question": "1+2", "answer": "3"})
    )
    samples = load_samples([str(rows)], template="{question}=", render=fmt.prompt)
    batch = sft_batch(samples, fmt, "{answer}")
    for i, (s, answer) in enumerate(zip(samples, ["46", "3"])):
        ids = batch.input_ids[i][batch.attention_mask[i]].tolist()
        assert tok.decode(ids) == f"<|system|>add.<|user|>{s.row['question']}=<|assistant|>{answer}<eos>"
        in_loss = batch.input_ids[i][batch.response_mask[i]].tolist()
        assert tok.decode(in_loss) == f"{answer}<eos>"  # no system, user or role tokens in the loss


def test_validate_refuses_a_template_the_tokenizer_lacks(tmp_path, assets):
    base = build_tiny_model(
        tmp_path / "base", alphabet=ALPHABET, hidden_size=64, num_heads=2, chat_template=False
    )
    cfg = _config(tmp_path, assets, base, "rlvr", chat_template=True, system_prompt=None)
    [problem] = check_inputs(cfg)
    assert problem.path == "data.chat_template" and "has no chat template" in problem.message
    cfg = _config(tmp_path, assets, base, "rlvr")  # auto, with a system prompt
    [problem] = check_inputs(cfg)
    assert problem.path == "data.system_prompt" and "nowhere to put it" in problem.message
    assert check_inputs(_config(tmp_path, assets, base, "rlvr", system_prompt=None)) == []


class _Trainer:
    """actor_train and the phases of a warm start, recording the batches it is given."""

    def __init__(self) -> None:
        self.batches: list = []
        self.actor_train = self

    def phase(self, *uses):
        import contextlib

        return contextlib.nullcontext()

    def configure_optimizer(self, lr, warmup):
        pass

    def train(self, batch, objective, phase="train"):
        self.batches.append(batch)
        return {"sft/loss": 0.0}


def _pairs(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3"}) + "\n")
    return {"train_files": [str(pairs)]}


def test_every_pipeline_with_rows_renders_them_one_way(tmp_path, assets, chat_model):
    """distill read its rows without the prompt format (data.chat_template and system_prompt ignored
    without a word) and dpo's warm start without it: the same rows now give the same tokens in rlvr,
    sft, dpo and distill, prompts and warm-start batches alike."""
    from reroll.pipelines.distill import Distill
    from reroll.pipelines.dpo import DPO

    teachers = {"distill": {"teachers": {"t": {"model_path": str(chat_model)}}}}
    rlvr = RLVR(_config(tmp_path, assets, chat_model, "rlvr"))
    others = {
        "sft": SFT(_config(tmp_path, assets, chat_model, "sft")),
        "dpo": DPO(_config(tmp_path, assets, chat_model, "dpo", preference=_pairs(tmp_path))),
        "distill": Distill(_config(tmp_path, assets, chat_model, "distill", **teachers)),
    }
    expected = [s.prompt for s in rlvr.rows.train]
    assert expected[0].startswith("<|system|>add.<|user|>")
    warm = _Trainer()
    rlvr.warm_start(warm)
    for name, pipeline in others.items():
        assert [s.prompt for s in pipeline.rows.train] == expected, name
        trainer = _Trainer()
        if name == "sft":  # its steps are the warm start's: the same rows, order and batch size
            for step in (1, 2):
                pipeline.step(trainer, step)
        else:
            pipeline.warm_start(trainer)
        got, want = ([b.input_ids.tolist() for b in t.batches] for t in (trainer, warm))
        assert got == want, name


def test_every_warm_start_follows_data_shuffle(tmp_path, assets, chat_model):
    """dpo's warm start shuffled its rows whatever data.shuffle said; now every warm start reads them in
    file order when it is false."""
    from reroll.pipelines.dpo import DPO

    for pipeline in (
        RLVR(_config(tmp_path, assets, chat_model, "rlvr", shuffle=False)),
        DPO(_config(tmp_path, assets, chat_model, "dpo", shuffle=False, preference=_pairs(tmp_path))),
    ):
        trainer = _Trainer()
        pipeline.warm_start(trainer)
        first = trainer.batches[0]
        in_order = pipeline.rows.target_batch(pipeline.rows.targets[: len(first)])
        assert first.input_ids.tolist() == in_order.input_ids.tolist(), pipeline.name


def test_preference_pairs_are_checked_for_coverage_as_written(tmp_path):
    """DPO and the reward model render a pair's prompt through the chat template; the start-of-run
    character check reads the rows as written (strings and messages' contents), so a character
    tokenizer is not warned about the template's '<', '|' of its special tokens."""
    from reroll.data.preferences import load_pairs
    from reroll.pipelines.pairs import pair_texts

    tok = char_tokenizer(ALPHABET)
    rows = tmp_path / "pairs.jsonl"
    row = {"prompt": [{"role": "user", "content": "2+3="}], "chosen": "5.", "rejected": "6."}
    rows.write_text(
        json.dumps(row) + "\n" + json.dumps({"prompt": "4+4=", "chosen": "8.", "rejected": "9."}) + "\n"
    )
    pairs = load_pairs([str(rows)], tok)
    assert pairs[0].prompt.startswith("<|user|>")  # rendered
    assert list(pair_texts(pairs)) == ["2+3=", "5.", "6.", "4+4=", "8.", "9."]
    assert lost_characters_warning(tok, pair_texts(pairs)) is None
    assert lost_characters_warning(tok, [pairs[0].prompt]) is not None  # what it read before
