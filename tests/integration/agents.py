"""Agent functions for the agent-proxy tests: plain OpenAI-client code, as a user would write it."""

from __future__ import annotations

import openai


def two_turns(base_url: str, task: dict, *, wanted: str = "aeiou") -> float:
    """Two calls on one growing conversation; the reward is the share of replied characters in ``wanted``."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [
        {"role": "system", "content": "play nim"},
        {"role": "user", "content": f"pile {task['pile']}"},
    ]
    first = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "your move again"}]
    second = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
    text = first + second
    return sum(c in wanted for c in text) / max(len(text), 1)
