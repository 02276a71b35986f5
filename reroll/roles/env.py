"""Environment workers (each hosts many episodes) and the episode runner that plays them against actor_infer.

``EnvWorker`` holds one environment object per live episode and runs ``reset``/``step`` for a batch of
episodes at once, each call in its own thread under ``agentic.step_timeout_s``: an environment that
raises, or that hangs, ends its own episode with a recorded error and never blocks the others.
``EnvGroup`` deals episodes to workers (Ray actors through ``WorkerGroup``: a dead worker is a
``RoleError``). ``run_episodes`` plays a batch of episodes turn by turn: all live episodes' prompts go
to the engine in one call per turn, as token ids (``reroll.envs.trajectory``), then their actions to
the environments. ``stream_episodes`` (``agentic.streaming``) plays the same episodes each in its own
thread: an episode's next prompt goes to the engine as soon as its environment answered, the prompts
that arrive together sharing an engine call (``reroll.roles.batcher``), and its environment steps run
while other episodes' do (env workers then run calls concurrently). ``episode_batch`` turns episodes
into a ``TrainBatch`` with per-turn tensors. For an ``agent:`` environment the workers run the agent
function instead (``play_agents``; see ``reroll.roles.agent_proxy``).
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

import torch

from reroll.config.schema import RunConfig
from reroll.data.types import Completion, SamplingParams, TrainBatch
from reroll.envs.agent import AgentOutcome, is_agent, load_agent, play
from reroll.envs.base import Env, StepResult, is_success
from reroll.envs.registry import make_env
from reroll.envs.trajectory import Trajectory, TrajectoryBuilder
from reroll.roles.batcher import Batcher
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
        return self._run(self._step_calls(actions))

    def step_each(self, actions: list[tuple[int, str]]) -> Iterator[list[StepResult]]:
        """``step``, each episode's result yielded as soon as its environment answered, with those
        finished at the same time (streamed episodes call it as a Ray streaming generator: a slow step
        does not hold back the others)."""
        yield from self._each(self._step_calls(actions))

    def _step_calls(self, actions: list[tuple[int, str]]) -> list[tuple[int, Callable[[], StepResult]]]:
        return [(ep, lambda env=self.envs[ep], a=action: _as_step(env.step(a))) for ep, action in actions]

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
        found = {r.episode: r for part in self._each(calls) for r in part}
        return [found[ep] for ep, _ in calls]

    def _each(self, calls: list[tuple[int, Callable[[], StepResult]]]) -> Iterator[list[StepResult]]:
        """``_run``'s results as they finish (those finished together in one list); the late ones,
        as errors, at the deadline."""
        out: dict[int, StepResult] = {}
        finished: queue.SimpleQueue[int] = queue.SimpleQueue()
        for ep, fn in calls:
            threading.Thread(
                target=_into, args=(out, ep, fn, finished), daemon=True, name=f"env-{ep}"
            ).start()
        deadline = time.monotonic() + self.timeout_s
        waiting = {ep for ep, _ in calls}
        while waiting:
            try:
                done = [finished.get(timeout=max(0.0, deadline - time.monotonic()))]
            except queue.Empty:
                break
            with contextlib.suppress(queue.Empty):
                while True:
                    done.append(finished.get_nowait())
            waiting -= set(done)
            for ep in done:
                out[ep].episode = ep
            yield [out[ep] for ep in done]
        key = "step_timeout_s" if self.agent is None else "agent_timeout_s"
        late = [ep for ep, _ in calls if ep in waiting]
        for ep in late:  # still running: abandon it (a thread cannot be killed) and its env
            self.envs.pop(ep, None)
        if late:
            yield [
                StepResult(ep, error=f"no answer within {self.timeout_s:g} s (agentic.{key})") for ep in late
            ]


def _into(
    out: dict[int, StepResult], ep: int, fn: Callable[[], StepResult], finished: queue.SimpleQueue[int]
) -> None:
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as e:
        result = StepResult(ep, error=f"{type(e).__name__}: {e}")
    result.seconds = time.perf_counter() - start
    out[ep] = result
    finished.put(ep)


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
    """All env workers; episode ``i`` lives on worker ``i % world_size``. With ``agentic.streaming``
    a worker runs up to one call per episode it hosts at once (``step_each`` calls overlap)."""

    def __init__(self, cfg: RunConfig) -> None:
        a = cfg.agentic
        assert a is not None
        timeout_s = a.agent_timeout_s if is_agent(a.env) else a.step_timeout_s
        world = cfg.roles.env.world_size
        concurrent = (
            math.ceil(max(cfg.rollout.batch_size, a.eval_episodes, 1) / world) + 1 if a.streaming else 1
        )
        super().__init__(
            "env",
            EnvWorker,
            lambda rank: (rank, a.env, dict(a.env_config), timeout_s),
            cfg,
            max_concurrency=concurrent,
        )

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

    def step_each(self, rank: int, actions: Sequence[tuple[int, str]]) -> Iterator[list[StepResult]]:
        """Steps of episodes on worker ``rank`` in one call, each result as soon as its environment answered."""
        call = self.handles[rank].step_each.options(num_returns="streaming").remote(list(actions))
        yield from self._stream(rank, call, "env_step")

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
    turn_seconds: list[float] = field(default_factory=list)  # each turn: engine wait and call, env step

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
    for ep, r in zip(episodes, envs.reset([(i, seed) for i, (seed, _) in enumerate(starts)])):
        if _ended(ep, r):
            continue
        ep.traj = builder.start_episode(r.observation, system_prompt)
        ep.states.append(r.observation)
    live = [i for i, ep in enumerate(episodes) if not ep.finish]
    for _ in range(max_turns):
        for i in live:
            if len(episodes[i].traj.ids) + params.max_new_tokens > max_tokens:
                episodes[i].finish = "token_budget"
        live = [i for i in live if not episodes[i].finish]
        if not live:
            break
        start = time.perf_counter()
        completions = [g[0] for g in generate([episodes[i].traj.ids for i in live], params)]
        for i, c in zip(live, completions):
            builder.add_response(episodes[i].traj, c.response_ids, c.logprobs, c.text)
        for i, r in zip(live, envs.step([(i, c.text) for i, c in zip(live, completions)])):
            ep = episodes[i]
            ep.turn_seconds.append(time.perf_counter() - start)
            ep.rewards.append(r.reward)
            if not _ended(ep, r):
                builder.add_observation(ep.traj, r.observation)
                ep.states.append(r.observation)
        live = [i for i in live if not episodes[i].finish]
    for i in live:
        episodes[i].finish = "turn_limit"
    envs.close(list(range(len(episodes))))
    return episodes


def stream_episodes(
    generate: Callable[[list[list[int]], SamplingParams], list[list[Completion]]],
    envs: EnvGroup,
    builder: TrajectoryBuilder,
    starts: Sequence[tuple[int, int]],
    params: SamplingParams,
    *,
    max_turns: int,
    max_tokens: int,
    system_prompt: str | None = None,
    wait_s: float = 0.05,
) -> list[Episode]:
    """``run_episodes`` without lockstep turns: each episode plays in its own thread, its prompts batched
    with those of the episodes that wait at the same time (up to ``wait_s``, ``reroll.roles.batcher``),
    its environment steps sent with those asked for at the same moment, one call per worker that
    returns each result as soon as it is there (``_EnvSteps``).

    An episode's tokens, rewards and ending are those ``run_episodes`` gives it, for an engine whose
    answer to a prompt does not depend on the other prompts of its call (greedy decoding). A failing
    engine or env worker (a ``RoleError``) stops every episode after its current turn and is raised.
    """
    episodes = [Episode(seed, group) for seed, group in starts]
    batcher = Batcher(generate, wait_s=wait_s, expect=len(episodes))
    steps = _EnvSteps(envs)
    turns = _Turns(envs, steps, builder, batcher, params, max_turns, max_tokens, system_prompt)

    def play(i: int) -> None:
        try:
            turns.play(i, episodes[i])
        except BaseException:
            turns.stop.set()
            raise
        finally:
            batcher.leave()

    failure: BaseException | None = None
    try:
        with ThreadPoolExecutor(max(len(episodes), 1), thread_name_prefix="episode") as pool:
            for done in as_completed([pool.submit(play, i) for i in range(len(episodes))]):
                failure = failure or done.exception()
    finally:
        batcher.close()
        steps.close()
    if failure is not None:
        raise failure
    envs.close(list(range(len(episodes))))
    return episodes


class _EnvSteps:
    """The environment steps of streamed episodes: the steps asked for at one moment (the episodes of
    one engine call) go to each worker in one call, whose results come back one at a time as each
    environment answers. A failed call (a dead worker) fails the steps it carried."""

    def __init__(self, envs: EnvGroup) -> None:
        self.envs = envs
        self._pending: list[tuple[int, str, Future]] = []
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="env-steps", daemon=True)
        self._thread.start()

    def step(self, episode: int, action: str) -> StepResult:
        done: Future = Future()
        with self._cond:
            self._pending.append((episode, action, done))
            self._cond.notify_all()
        return done.result()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                asked, self._pending = self._pending, []
            by_rank: dict[int, list[tuple[int, str, Future]]] = {}
            for item in asked:
                by_rank.setdefault(item[0] % self.envs.world_size, []).append(item)
            for rank, part in by_rank.items():
                threading.Thread(target=self._collect, args=(rank, part), daemon=True).start()

    def _collect(self, rank: int, part: list[tuple[int, str, Future]]) -> None:
        waiting = {ep: done for ep, _, done in part}
        try:
            for results in self.envs.step_each(rank, [(ep, action) for ep, action, _ in part]):
                for r in results:
                    waiting.pop(r.episode).set_result(r)
            if waiting:
                raise RuntimeError(f"env worker {rank} answered no step for episodes {sorted(waiting)}")
        except BaseException as e:
            for done in waiting.values():
                done.set_exception(e)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)


@dataclass
class _Turns:
    """What every episode thread of ``stream_episodes`` shares; ``stop`` ends them all after their turn."""

    envs: EnvGroup
    steps: _EnvSteps
    builder: TrajectoryBuilder
    batcher: Batcher
    params: SamplingParams
    max_turns: int
    max_tokens: int
    system_prompt: str | None
    stop: threading.Event = field(default_factory=threading.Event)

    def play(self, i: int, ep: Episode) -> None:
        """Episode ``i`` from its reset to its end, one turn after the other."""
        [r] = self.envs.reset([(i, ep.seed)])
        if _ended(ep, r):
            return
        ep.traj = self.builder.start_episode(r.observation, self.system_prompt)
        ep.states.append(r.observation)
        for _ in range(self.max_turns):
            if self.stop.is_set():  # another episode's engine or env worker failed: the step is over
                return
            if len(ep.traj.ids) + self.params.max_new_tokens > self.max_tokens:
                ep.finish = "token_budget"
                return
            start = time.perf_counter()
            c = self.batcher.submit(list(ep.traj.ids), self.params)[0]
            self.builder.add_response(ep.traj, c.response_ids, c.logprobs, c.text)
            r = self.steps.step(i, c.text)
            ep.turn_seconds.append(time.perf_counter() - start)
            ep.rewards.append(r.reward)
            if _ended(ep, r):
                return
            self.builder.add_observation(ep.traj, r.observation)
            ep.states.append(r.observation)
        ep.finish = "turn_limit"


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
