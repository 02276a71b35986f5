"""Agent episodes: external agent code plays, reroll serves the policy and records the tokens.

For ``agentic.env: "agent:module:function"`` (``reroll.envs.agent``) each episode gets its own
endpoint on a ``ChatServer`` over actor_infer; the env workers run the agent function on
``(base_url, task)``, each in a thread under ``agentic.agent_timeout_s``, while the server answers the
agent's calls (all live episodes' calls batched into engine calls) and keeps each episode's token
sequence. When the agents have returned, each episode is that sequence, the agent's reward on its last
turn, and how it ended: the same ``Episode`` the environment runner (``run_episodes``) produces, so
the agentic pipeline trains on it unchanged. An agent that raises after the server refused a call past
``agentic.max_turns`` or ``max_episode_tokens`` ends its episode as the environment runner's would
(``turn_limit`` / ``token_budget``, reward 0), not as an error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from reroll.data.types import SamplingParams
from reroll.errors import RoleError
from reroll.roles.chat_server import ChatServer
from reroll.roles.env import EnvGroup, Episode


def agent_task(rows: Sequence[Mapping[str, Any]], index: int, seed: int) -> dict[str, Any]:
    """The task of an episode: row ``index % len(rows)`` with its ``seed``, or only the seed."""
    row = dict(rows[index % len(rows)]) if rows else {}
    return row | {"seed": seed}


def run_agent_episodes(
    server: ChatServer,
    envs: EnvGroup,
    starts: Sequence[tuple[int, int]],
    tasks: Sequence[dict[str, Any]],
    params: SamplingParams,
    *,
    max_turns: int,
    max_tokens: int,
) -> list[Episode]:
    """One episode per ``(seed, group)`` with its ``task``, played by the agent function in the env workers."""
    keys = [server.open_episode(params, max_turns=max_turns, max_tokens=max_tokens) for _ in starts]
    try:
        results = envs.play_agents(
            [(i, server.episode_url(key), task) for i, (key, task) in enumerate(zip(keys, tasks))]
        )
    finally:
        records = [server.close_episode(key) for key in keys]
    if server.failure is not None:  # the engine failed under the agents: the step fails, not the episodes
        failure = server.failure
        if isinstance(failure, RoleError):
            raise failure
        raise RuntimeError(f"actor_infer failed while serving the agents: {failure}") from failure
    episodes = []
    for (seed, group), record, result in zip(starts, records, results):
        ep = Episode(seed, group)
        if record.traj is not None:
            ep.traj, ep.states = record.traj, record.states
        turns = ep.traj.turns
        ep.rewards = [0.0] * max(turns - 1, 0) + [result.reward]
        if result.error is not None and record.finish:  # refused past a limit, and the agent gave up
            ep.finish, ep.rewards[-1] = record.finish, 0.0
        elif result.error is not None:
            ep.finish, ep.error = "error", result.error
        else:
            ep.finish = record.finish or "terminated"
            ep.success = bool(result.info.get("success", result.reward > 0))
        episodes.append(ep)
    return episodes
