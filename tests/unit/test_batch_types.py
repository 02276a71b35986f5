import torch

from reroll.data.types import Completion, Rollout, Sample, TrainBatch, build_train_batch


def _rollout(prompt, response, group, logprobs=None):
    s = Sample(uid="u", prompt="p", row={})
    c = Completion(prompt, response, "", logprobs or [-0.5] * len(response), "stop")
    return Rollout(s, group, c)


def test_build_train_batch_layout():
    # row 0: prompt [5, 6], response [7, 8, 9]  -> width 5, no padding
    # row 1: prompt [5],    response [7]        -> padded with 0 to width 5
    batch = build_train_batch([_rollout([5, 6], [7, 8, 9], 0), _rollout([5], [7], 1, [-1.0])], pad_token_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 7, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[True] * 5, [True, True, False, False, False]]
    assert batch.response_mask.tolist() == [
        [False, False, True, True, True],
        [False, True, False, False, False],
    ]
    assert batch.rollout_logprobs.tolist() == [[0, 0, -0.5, -0.5, -0.5], [0, -1.0, 0, 0, 0]]
    assert batch.group_ids.tolist() == [0, 1]
    assert batch.num_tokens == 4.0 and batch.num_seqs == 2.0


def test_split_chunks_and_trim_keep_rows_and_counts():
    batch = build_train_batch([_rollout([1] * (i + 1), [2] * (5 - i), i) for i in range(5)], pad_token_id=0)
    batch.advantages = torch.arange(5, dtype=torch.float32)[:, None].expand(5, 6).clone()
    parts = batch.split(2)
    assert [len(p) for p in parts] == [2, 3]  # near-equal, contiguous
    assert torch.equal(torch.cat([p.advantages for p in parts]), batch.advantages)
    assert all(p.num_tokens == batch.num_tokens for p in parts)  # counts describe the whole step
    short = build_train_batch([_rollout([1], [2], 0), _rollout([1] * 4, [2] * 3, 1)], pad_token_id=0)
    assert [c.input_ids.shape[1] for c in short.chunks(1)] == [
        2,
        7,
    ]  # each micro-batch trimmed to its longest row


def test_concat_pads_to_requested_width():
    out = TrainBatch.concat([torch.ones(1, 2), torch.ones(2, 3)], width=4)
    assert out.shape == (3, 4)
    assert out[0].tolist() == [1, 1, 0, 0]


def test_trim_cuts_per_token_fields_and_keeps_per_turn_ones():
    short = build_train_batch([_rollout([1], [2], 0), _rollout([1] * 4, [2] * 3, 1)], pad_token_id=0)
    short.values = torch.zeros(2, 7)
    short.step_rewards = torch.zeros(2, 5)  # (B, S): five turns, not tokens
    first = short.chunks(1)[0]
    assert first.values.shape == (1, 2)  # row 0 is 2 tokens long
    assert first.step_rewards.shape == (1, 5)
