"""Token-exact trajectories: the incremental sequence equals apply_chat_template over the whole conversation."""

from __future__ import annotations

import pytest

from reroll.envs.trajectory import TrajectoryBuilder
from reroll.models.tiny import GAME_ALPHABET, char_tokenizer

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tiny():
    return char_tokenizer(GAME_ALPHABET)


@pytest.fixture(scope="module")
def chatml():
    tok = char_tokenizer(GAME_ALPHABET + "\n")
    tok.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = CHATML
    return tok


def _episode(builder, tok, first, turns):
    """Play ``turns`` of (response text, stopped on eos, observation); return the trajectory."""
    traj = builder.start(first)
    for text, stopped, obs in turns:
        ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if stopped else [])
        builder.add_response(traj, ids, [-0.5] * len(ids), text)
        if obs is not None:
            builder.add_observation(traj, obs)
    return traj


@pytest.mark.parametrize("which", ["tiny", "chatml"])
def test_incremental_equals_whole_conversation(which, request):
    tok = request.getfixturevalue(which)
    builder = TrajectoryBuilder(tok)
    first = [{"role": "system", "content": "play nim"}, {"role": "user", "content": "pile 13"}]
    # the second response hit the token limit (no eos): the template's end of turn is added, not trained
    turns = [("1", True, "pile 9"), ("take 2", False, "pile 5"), ("1", True, None)]
    traj = _episode(builder, tok, first, turns)
    whole = tok.apply_chat_template(traj.messages, tokenize=True)["input_ids"]
    assert traj.ids == whole
    assert [m["content"] for m in traj.messages] == [
        "play nim",
        "pile 13",
        "1",
        "pile 9",
        "take 2",
        "pile 5",
        "1",
    ]
    # the loss covers exactly the generated tokens: "1"+eos, "take 2", "1"+eos
    generated = [tok.decode([i]) for i, p in zip(traj.ids, traj.policy) if p]
    eos = tok.eos_token
    assert generated == ["1", eos, "t", "a", "k", "e", " ", "2", "1", eos]
    assert [t for t in traj.turn if t >= 0] == [0, 0, 1, 1, 1, 1, 1, 1, 2, 2]
    assert traj.logprobs.count(-0.5) == 10 and traj.turns == 3


def test_generated_ids_are_kept_even_when_text_would_retokenise_differently(tiny):
    builder = TrajectoryBuilder(tiny)
    traj = builder.start([{"role": "user", "content": "pile 7"}])
    odd = [
        *tiny.encode("3", add_special_tokens=False),
        tiny.convert_tokens_to_ids("<|user|>"),
        tiny.eos_token_id,
    ]
    text = tiny.decode(odd, skip_special_tokens=True)  # "3": the role token vanishes from the text
    builder.add_response(traj, odd, [-1.0, -2.0, -3.0], text)
    start = traj.policy.index(True)
    assert traj.ids[start : start + 3] == odd and traj.logprobs[start : start + 3] == [-1.0, -2.0, -3.0]
    assert (
        tiny.apply_chat_template(traj.messages, tokenize=True)["input_ids"] != traj.ids
    )  # what drift would be


def test_template_that_rewrites_history_is_refused(tiny):
    tok = char_tokenizer(GAME_ALPHABET)
    tok.chat_template = "{% for m in messages|reverse %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="append-only"):
        TrajectoryBuilder(tok)
