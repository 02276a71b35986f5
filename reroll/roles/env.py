"""Environment workers (each hosts many episodes) and the episode runner that plays them against actor_infer.

``EnvWorker`` holds one environment object per live episode and runs ``reset``/``step`` for a batch of
episodes at once, each call in its own thread under ``agentic.step_timeout_s``: an environment that
raises, or that hangs, ends its own episode with a recorded error and never blocks the others.
``EnvGroup`` deals episodes to workers (Ray actors through ``WorkerGroup``: a dead worker is a
``RoleError``). ``run_episodes`` plays a batch of episodes turn by turn: all live episodes' prompts go
to the engine in one call per turn, as token ids (``reroll.envs.trajectory``), then their actions to
the environments. ``episode_batch`` turns episodes into a ``TrainBatch`` with per-turn tensors. For an
``agent:`` environment the workers run the agent function instead (``play_agents``; see
``reroll.roles.agent_proxy``).
"""

from __future__ import annotations

import contextlib
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from reroll.config.schema import RunConfig
from reroll.data.types import Completion, SamplingParams, TrainBatch
from reroll.envs.agent import AgentOutcome, is_agent, load_agent, play
from reroll.envs.base import Env, StepResult, is_success
from reroll.envs.registry import make_env
from reroll.envs.trajectory import Trajectory, TrajectoryBuilder
from reroll.runtime.actors import WorkerGroup


class EnvWorker:
    """One rank of the env role: the environments of the episodes dealt to it."""

    def __init__(self, rank: int, name: str, config: dict[str, Any], step_timeout_s: float) -> None:
        self.rank, self.name, self.config, self.timeout_s = rank, name, config, step_timeout_s
        self.envs: dict[int, Env] = {}
        # a bad name or option fails here, at start, not mid-step
        self.agent = load_agent(name, config) if is_agent(name) else None
        if self.agent is None:
            make_env(name, config)

    def reset(self, starts: list[tuple[int, int]]) -> list[StepResult]:
        """A fresh environment per ``(episode, seed)``, reset with that seed."""
        return self._run([(ep, lambda ep=ep, s=seed: self._reset_one(ep, s)) for ep, seed in starts])

    def _reset_one(self, episode: int, seed: int) -> StepResult:
        env = self.envs[episode] = make_env(self.name, self.config)
        return _as_reset(env.reset(seed=seed))

    def step(self, actions: list[tuple[int, str]]) -> list[StepResult]:
        calls = [(ep, lambda env=self.envs[ep], a=action: _as_step(env.step(a))) for ep, action in actions]
        return self._run(calls)

    def play_agents(self, jobs: list[tuple[int, str, dict[str, Any]]]) -> list[StepResult]:
        """``agent:`` environments: the agent function on each ``(episode, base_url, task)``, each in its
        own thread under the timeout (the whole episode); its reward comes back as a last step."""
        agent = self.agent
        assert agent is not None
        calls = [
            (ep, lambda url=url, task=task: _as_outcome(play(agent, url, task, self.config)))
            for ep, url, task in jobs
        ]
        return self._run(calls)

    def close(self, episodes: list[int]) -> None:
        for ep in episodes:
            env = self.envs.pop(ep, None)
            close = getattr(env, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):  # a failing close must not fail the step
                    close()

    def _run(self, calls: list[tuple[int, Callable[[], StepResult]]]) -> list[StepResult]:
        """Every call in its own thread, all under one deadline; late or raising calls become errors."""
        out: dict[int, StepResult] = {}
        threads = []
        for ep, fn in calls:
            t = threading.Thread(target=_into, args=(out, ep, fn), daemon=True, name=f"env-{ep}")
            t.start()
            threads.append((ep, t))
        deadline = time.monotonic() + self.timeout_s
        results, key = [], "step_timeout_s" if self.agent is None else "agent_timeout_s"
        for ep, t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if ep not in out:  # still running: abandon it (a thread cannot be killed) and its env
                self.envs.pop(ep, None)
                out[ep] = StepResult(ep, error=f"no answer within {self.timeout_s:g} s (agentic.{key})")
            results.append(out[ep])
            results[-1].episode = ep
        return results


def _into(out: dict[int, StepResult], ep: int, fn: Callable[[], StepResult]) -> None:
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as e:
        result = StepResult(ep, error=f"{type(e).__name__}: {e}")
    result.seconds = time.perf_counter() - start
    out[ep] = result


def _as_reset(out: Any) -> StepResult:
    obs, info = out
    return StepResult(-1, observation=str(obs), info=_plain(info))


def _as_step(out: Any) -> StepResult:
    obs, reward, terminated, truncated, info = out
    return StepResult(-1, str(obs), float(reward), bool(terminated), bool(truncated), _plain(info))


def _as_outcome(o: AgentOutcome) -> StepResult:
    if o.error is not None:
        return StepResult(-1, error=o.error)
    return StepResult(-1, reward=o.reward, terminated=True, info=o.info | {"success": o.success})


def _plain(info: Any) -> dict[str, Any]:
    """The info's scalar entries (what travels back to the driver and into the logs)."""
    if not isinstance(info, dict):
        return {}
    return {str(k): v for k, v in info.items() if isinstance(v, (bool, int, float, str))}


class EnvGroup(WorkerGroup):
    """All env workers; episode ``i`` lives on worker ``i % world_size``."""

    def __init__(self, cfg: RunConfig) -> None:
        a = cfg.agentic
        assert a is not None
        timeout_s = a.agent_timeout_s if is_agent(a.env) else a.step_timeout_s
        super().__init__("env", EnvWorker, lambda rank: (rank, a.env, dict(a.env_config), timeout_s), cfg)

    def _by_rank(self, items: Sequence[tuple[int, Any]], method: str, phase: str) -> list[StepResult]:
        parts: list[list[tuple[int, Any]]] = [[] for _ in self.handles]
        for item in items:
            parts[item[0] % self.world_size].append(item)
        refs = [getattr(h, method).remote(p) for h, p in zip(self.handles, parts) if p]
        found = {r.episode: r for part in self._wait(refs, phase) for r in part}
        return [found[item[0]] for item in items]

    def reset(self, starts: Sequence[tuple[int, int]]) -> list[StepResult]:
        return self._by_rank(starts, "reset", "env_reset")

    def step(self, actions: Sequence[tuple[int, str]]) -> list[StepResult]:
        return self._by_rank(actions, "step", "env_step")

    def play_agents(self, jobs: Sequence[tuple[int, str, dict[str, Any]]]) -> list[StepResult]:
        """Each ``(episode, base_url, task)`` played by the agent function (``agent:`` environments)."""
        return self._by_rank(jobs, "play_agents", "agent_episodes")

    def close(self, episodes: Sequence[int]) -> None:
        parts: list[list[int]] = [[] for _ in self.handles]
        for ep in episodes:
            parts[ep % self.world_size].append(ep)
        self._wait([h.close.remote(p) for h, p in zip(self.handles, parts)], "env_close")


@dataclass
class Episode:
    """One played episode: its tokens, per-turn rewards and states, and how it ended."""

    seed: int
    group: int
    traj: Trajectory = field(default_factory=Trajectory)
    rewards: list[float] = field(default_factory=list)  # one per policy turn
    states: list[str] = field(default_factory=list)  # the observation each turn acted on
    finish: str = ""  # terminated | truncated | turn_limit | token_budget | error
    success: bool = False
    error: str | None = None

    @property
    def total_reward(self) -> float:
        return sum(self.rewards)


def run_episodes(
    generate: Callable[[list[list[int]], SamplingParams], list[list[Completion]]],
    envs: EnvGroup,
    builder: TrajectoryBuilder,
    starts: Sequence[tuple[int, int]],
    params: SamplingParams,
    *,
    max_turns: int,
    max_tokens: int,
    system_prompt: str | None = None,
) -> list[Episode]:
    """Play one episode per ``(seed, group)`` until each ends; one engine call per turn for all live ones."""
    episodes = [Episode(seed, group) for seed, group in starts]
    head = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for ep, r in zip(episodes, envs.reset([(i, seed) for i, (seed, _) in enumerate(starts)])):
        if _ended(ep, r):
            continue
        ep.traj = builder.start([*head, {"role": builder.observation_role, "content": r.observation}])
        ep.states.append(r.observation)
    live = [i for i, ep in enumerate(episodes) if not ep.finish]
    for _ in range(max_turns):
        for i in live:
            if len(episodes[i].traj.ids) + params.max_new_tokens > max_tokens:
                episodes[i].finish = "token_budget"
        live = [i for i in live if not episodes[i].finish]
        if not live:
            break
        completions = [g[0] for g in generate([episodes[i].traj.ids for i in live], params)]
        for i, c in zip(live, completions):
            builder.add_response(episodes[i].traj, c.response_ids, c.logprobs, c.text)
        for i, r in zip(live, envs.step([(i, c.text) for i, c in zip(live, completions)])):
            ep = episodes[i]
            ep.rewards.append(r.reward)
            if not _ended(ep, r):
                builder.add_observation(ep.traj, r.observation)
                ep.states.append(r.observation)
        live = [i for i in live if not episodes[i].finish]
    for i in live:
        episodes[i].finish = "turn_limit"
    envs.close(list(range(len(episodes))))
    return episodes


def _ended(ep: Episode, r: StepResult) -> bool:
    """Record how ``r`` ended the episode, if it did."""
    if r.error is not None:
        ep.finish, ep.error = "error", r.error
    elif r.terminated or r.truncated:
        ep.finish = "terminated" if r.terminated else "truncated"
        ep.success = is_success(r.reward, r.info)
    return bool(ep.finish)


def state_id(observation: str) -> int:
    """A stable id of an observation (equal text, equal id), for GiGPO's step groups."""
    return zlib.crc32(observation.encode()) & 0x7FFFFFFF


def episode_batch(episodes: Sequence[Episode], pad_token_id: int) -> TrainBatch:
    """Right-padded tensors of the episodes; the loss covers the policy's tokens only.

    ``step_ids`` (B, T) is the turn of each policy token (-1 elsewhere), ``step_rewards`` (B, S) and
    ``step_states`` (B, S) observation ids (-1 for absent turns). ``rewards`` (B,) is each episode's total.
    """
    b = len(episodes)
    width = max(len(e.traj.ids) for e in episodes)
    turns = max(max(e.traj.turns for e in episodes), 1)
    ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.bool)
    policy = torch.zeros((b, width), dtype=torch.bool)
    logprobs = torch.zeros((b, width))
    step_ids = torch.full((b, width), -1, dtype=torch.long)
    step_rewards = torch.zeros((b, turns))
    step_states = torch.full((b, turns), -1, dtype=torch.long)
    for i, e in enumerate(episodes):
        n, t = len(e.traj.ids), e.traj
        ids[i, :n] = torch.tensor(t.ids, dtype=torch.long)
        attn[i, :n] = True
        policy[i, :n] = torch.tensor(t.policy)
        logprobs[i, :n] = torch.tensor(t.logprobs)
        step_ids[i, :n] = torch.tensor(t.turn, dtype=torch.long)
        k = t.turns
        step_rewards[i, : min(k, len(e.rewards))] = torch.tensor(e.rewards[:k])
        step_states[i, :k] = torch.tensor([state_id(s) for s in e.states[:k]], dtype=torch.long)
    return TrainBatch(
        input_ids=ids,
        attention_mask=attn,
        response_mask=policy,
        group_ids=torch.tensor([e.group for e in episodes], dtype=torch.long),
        rewards=torch.tensor([e.total_reward for e in episodes]),
        rollout_logprobs=logprobs,
        num_tokens=float(policy.sum()),
        num_seqs=float(policy.any(-1).sum()),
        step_ids=step_ids,
        step_rewards=step_rewards,
        step_states=step_states,
    )
