"""Token-exact multi-turn trajectories built with the model's chat template.

A trajectory is one token sequence: the first prompt, then for each turn the tokens the policy
generated (kept exactly as the engine returned them, never re-tokenised from text) and the tokens
the chat template and the environment add after them (the end of the assistant turn, the next
observation as a message, the next generation prompt). Only the policy's tokens are in the loss
(``policy``); ``turn`` numbers them by turn for per-turn credit.

The conversation is rendered by ``reroll.data.chat`` (the same functions that render RLVR, SFT and
evaluation prompts): the first prompt is ``PromptFormat.prompt`` of the first observation. The
template's pieces are found by rendering: the text after an assistant message's content is the
end-of-turn suffix (``<eos>`` for the tiny models, ``<|im_end|>\\n`` for ChatML), of which the
policy generated the first token when it stopped on it; an observation's tokens are the text that
rendering the conversation with that message adds. So when the policy's text re-tokenises to the
ids it generated, the sequence equals ``apply_chat_template`` over the whole conversation
(``tests/unit/test_trajectory.py``); when it does not, the ids the policy generated are kept, and the
text in ``messages`` is only for reading.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from reroll.data.chat import chat_messages, end_of_turn_ids, render_chat


@dataclass
class Trajectory:
    """One episode's tokens: ``ids`` with per-token ``policy`` flags, engine ``logprobs`` and ``turn``."""

    ids: list[int] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: int = 0

    def _extend(self, ids: Sequence[int], *, policy: bool, logprobs: Sequence[float] | None = None) -> None:
        self.ids.extend(ids)
        self.policy.extend([policy] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.turn.extend([self.turns if policy else -1] * len(ids))

    @property
    def policy_tokens(self) -> int:
        return sum(self.policy)


class TrajectoryBuilder:
    """Builds ``Trajectory`` objects for one tokenizer and chat template."""

    def __init__(self, tokenizer: Any, *, observation_role: str = "user") -> None:
        self.tokenizer, self.observation_role = tokenizer, observation_role
        self.end_of_turn = end_of_turn_ids(tokenizer)

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        return render_chat(self.tokenizer, messages, generation_prompt=generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def start_episode(self, observation: str, system_prompt: str | None = None) -> Trajectory:
        """The first prompt: the system prompt and the first observation, as ``chat_messages`` puts
        them (so for the user role, ``PromptFormat(...).prompt(observation)`` tokenised)."""
        return self.start(chat_messages(observation, system_prompt, role=self.observation_role))

    def start(self, messages: list[dict[str, str]]) -> Trajectory:
        """The first prompt (system and first observation, say) with the generation prompt."""
        traj = Trajectory(messages=[dict(m) for m in messages])
        traj._extend(self._encode(self._render(traj.messages, generation_prompt=True)), policy=False)
        return traj

    def add_response(
        self, traj: Trajectory, response_ids: Sequence[int], logprobs: Sequence[float], text: str
    ) -> None:
        """The policy's tokens as generated, then the rest of the template's end of turn. ``logprobs``:
        one per response token, or none where the engine was not asked for them (zeros are kept)."""
        if logprobs and len(logprobs) != len(response_ids):
            raise ValueError(f"{len(response_ids)} response ids but {len(logprobs)} log-probs")
        traj._extend(response_ids, policy=True, logprobs=logprobs or None)
        end = self.end_of_turn
        generated = bool(end) and bool(response_ids) and response_ids[-1] == end[0]
        traj._extend(end[1:] if generated else end, policy=False)
        traj.messages.append({"role": "assistant", "content": text})
        traj.turns += 1

    def add_observation(self, traj: Trajectory, text: str) -> None:
        """The environment's observation as a message, and the next generation prompt."""
        self.add_messages(traj, [{"role": self.observation_role, "content": text}])

    def add_messages(self, traj: Trajectory, messages: Sequence[dict[str, str]]) -> None:
        """Messages after the last assistant turn (an observation, tool results, a new user turn), and
        the next generation prompt."""
        before = self._render(traj.messages, generation_prompt=False)
        traj.messages.extend(dict(m) for m in messages)
        after = self._render(traj.messages, generation_prompt=True)
        if not after.startswith(before):
            raise ValueError(
                "the chat template re-renders earlier turns differently once a message is added (e.g. it "
                "drops past reasoning), so the trajectory cannot be extended token-exactly"
            )
        traj._extend(self._encode(after[len(before) :]), policy=False)
