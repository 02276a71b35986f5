"""Agentic RL: multi-turn episodes against an environment, trained on the policy's own tokens.

Each step plays ``rollout.batch_size`` episodes, ``rollout.group_size`` per seed (a group), through
the env workers: every turn, one engine call for all live episodes, then one step of each
environment; with ``agentic.streaming`` each episode advances on its own (``stream_episodes``):
its next turn goes to the engine as soon as its environment answered, sharing an engine call with
the turns that wait at the same time. An episode is one token sequence built with the chat
template (``reroll.envs.trajectory``); the loss covers only the tokens the policy generated.
Advantages are the algorithm's: per episode (``grpo``, ``rloo``, ``reinforce_pp``: the episode's
total reward) or per turn (``step_return``, ``gigpo``: per-turn rewards with ``algorithm.gamma``). An optional SFT warm start
imitates the environment's scripted (or random) policy. Episodes that end in an environment error
are recorded (``env/errors``, ``env/timeouts``, a log line) and, by ``agentic.error_policy``, left
out of the update or trained with reward 0. With ``agentic.env: "agent:module:function"`` the
episodes are played by external agent code against an OpenAI-compatible endpoint that serves
actor_infer (``reroll.roles.agent_proxy``), and assembled into the same token sequences.
"""

from __future__ import annotations

import functools
import logging
import math
import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from reroll.algorithms.objective import AdvantageState, batch_advantages
from reroll.config.agentic import AgenticConfig
from reroll.config.schema import RunConfig
from reroll.data.chat import ChatTemplateError
from reroll.data.datasets import read_rows
from reroll.data.types import Completion, SamplingParams
from reroll.envs.agent import is_agent
from reroll.envs.check import policy_action
from reroll.envs.registry import make_env
from reroll.envs.trajectory import TrajectoryBuilder
from reroll.errors import UserError
from reroll.models.loading import load_tokenizer
from reroll.pipelines.common import policy_logprobs, sampling, sft_warm_start, step_seed, train_mini_batches
from reroll.pipelines.pipeline import Checkpointed, Pipeline, register_pipeline
from reroll.pipelines.roles import Roles
from reroll.roles.agent_proxy import agent_task, run_agent_episodes
from reroll.roles.chat_server import ChatServer
from reroll.roles.env import Episode, episode_batch, run_episodes, stream_episodes
from reroll.roles.objectives import PolicyGradient

log = logging.getLogger(__name__)


@register_pipeline
class Agentic(Pipeline):
    name = "agentic"

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        assert cfg.agentic is not None
        self.a: AgenticConfig = cfg.agentic
        try:  # episodes are chats: the same rendering as rlvr/sft prompts (reroll.data.chat)
            self.builder = TrajectoryBuilder(load_tokenizer(cfg.model.path))
        except ChatTemplateError as e:
            raise UserError(f"{cfg.model.path}: {e}") from e
        self.state = AdvantageState.initial(cfg.algorithm)
        self.objective = PolicyGradient(
            cfg.algorithm, cfg.rollout.temperature or 1.0, cfg.rollout.max_new_tokens
        )
        self.last: list[Episode] = []
        self.agent = is_agent(self.a.env)  # external agent code through the proxy endpoint
        self.tasks = read_rows(self.a.tasks) if self.a.tasks else []
        self.eval_tasks = read_rows(self.a.eval_tasks) if self.a.eval_tasks else []

    def texts(self) -> Iterable[str]:
        """The system prompt and a few first observations (the environment writes the rest)."""
        if self.a.system_prompt:
            yield self.a.system_prompt
        if self.agent:  # the agent writes the messages; its tasks' text is what can be checked
            yield from (str(v) for row in self.tasks[:100] for v in row.values() if isinstance(v, str))
            return
        for seed in range(4):
            yield make_env(self.a.env, self.a.env_config).reset(seed=seed)[0]

    def warm_start(self, roles: Roles) -> None:
        n = self.cfg.sft.batch_size if self.cfg.sft is not None else 0
        pad = self.builder.tokenizer.pad_token_id
        episodes = lambda i: [_scripted_episode(self.cfg, self.builder, s) for s in range(i * n, (i + 1) * n)]  # noqa: E731
        sft_warm_start(
            self.cfg, roles, lambda i: episode_batch(episodes(i), pad), f"{self.a.sft_policy}-policy episodes"
        )

    def restore(self, saved: dict[str, Any], directory: Path) -> None:
        self.state = AdvantageState.from_state_dict(torch.load(directory / "algorithm_state.pt"))

    def checkpointed(self) -> Checkpointed:
        return Checkpointed(objects={"algorithm_state.pt": self.state.state_dict()})

    def _play(
        self, roles: Roles, starts: list[tuple[int, int]], params: SamplingParams, *, held_out: bool = False
    ) -> tuple[list[Episode], list[int]]:
        """The episodes, and the number of prompts of each engine call that played them."""
        assert roles.env is not None
        limits = {"max_turns": self.a.max_turns, "max_tokens": self.a.max_episode_tokens}
        sizes: list[int] = []

        def generate(prompts: list[list[int]], p: SamplingParams) -> list[list[Completion]]:
            sizes.append(len(prompts))
            return roles.actor_infer.generate(prompts, p, phase="agent_call" if self.agent else "generate")

        if self.agent:
            if held_out and self.eval_tasks:
                tasks = [agent_task(self.eval_tasks, i, seed) for i, (seed, _) in enumerate(starts)]
            else:
                tasks = [agent_task(self.tasks, seed, seed) for seed, _ in starts]
            with ChatServer(
                generate,
                self.builder.tokenizer,
                model_name=self.cfg.name,
                defaults=params,
                host=_proxy_host(self.cfg),
            ) as server:
                return run_agent_episodes(server, roles.env, starts, tasks, params, **limits), sizes
        play = (
            functools.partial(stream_episodes, wait_s=self.a.batch_wait_s)
            if self.a.streaming
            else run_episodes
        )
        episodes = play(
            generate, roles.env, self.builder, starts, params, **limits, system_prompt=self.a.system_prompt
        )
        return episodes, sizes

    def step(self, roles: Roles, step: int) -> dict[str, float]:
        cfg = self.cfg
        with roles.phase("episodes", "actor_infer"):
            episodes, sizes = self._play(
                roles, _train_starts(cfg, step), sampling(cfg, n=1, seed=step_seed(cfg, step))
            )
            engine_metrics = roles.actor_infer.metrics()
        _log_errors(episodes, step)
        self.last = episodes
        metrics = _episode_metrics(episodes, "rollout") | _turn_metrics(episodes, sizes) | engine_metrics
        trainable = _trainable(cfg, episodes)
        if not trainable:
            return metrics | {"train/skipped": 1.0}
        batch = episode_batch(trainable, self.builder.tokenizer.pad_token_id)
        if not cfg.engine_logprobs:  # rollout.logprobs false: the trajectories hold zeros, not log-probs
            batch.rollout_logprobs = None
        if cfg.needs_reference:
            batch.ref_logprobs = policy_logprobs(roles, batch, "reference")
        with roles.phase("advantages"):
            adv = batch_advantages(cfg.algorithm, batch, self.state)
            batch.advantages, self.state = adv.advantages, adv.state
        with roles.phase("train", "actor_train"):
            train = lambda mb: roles.actor_train.train(mb, self.objective)  # noqa: E731
            metrics |= train_mini_batches(cfg, batch.select(adv.keep), step, train)
        return metrics | {k: float(v) for k, v in adv.metrics.items()}

    def evaluate(self, roles: Roles) -> dict[str, float]:
        """Greedy episodes on the held-out seeds: ``eval/success`` (also as ``eval/accuracy``) and friends."""
        n = self.a.eval_episodes
        if n == 0:
            return {}
        starts = [(self.a.eval_seed + i, i) for i in range(n)]
        params = sampling(self.cfg, n=1, greedy=True)
        out = _episode_metrics(self._play(roles, starts, params, held_out=True)[0], "eval")
        return out | {"eval/accuracy": out["eval/success"]}

    def sample_line(self) -> str | None:
        if not self.last:
            return None
        return f"  sample: {self.builder.tokenizer.decode(self.last[0].traj.ids)!r} (reward {self.last[0].total_reward:g})"


def _proxy_host(cfg: RunConfig) -> str:
    """Where the agent endpoint listens: this node's address on a Ray cluster (env workers may run on
    other nodes of it), else the loopback address."""
    if cfg.runtime.backend == "local":
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()


def _train_starts(cfg: RunConfig, step: int) -> list[tuple[int, int]]:
    """(seed, group) of each episode: ``group_size`` episodes per seed; seeds stay below eval_seed."""
    assert cfg.agentic is not None
    n = cfg.prompts_per_step
    seeds = [((cfg.seed * 7_919 + step) * n + j) % cfg.agentic.eval_seed for j in range(n)]
    return [(s, g) for g, s in enumerate(seeds) for _ in range(cfg.rollout.group_size)]


def _trainable(cfg: RunConfig, episodes: list[Episode]) -> list[Episode]:
    """The episodes the update uses: errored ones dropped or zeroed (``agentic.error_policy``)."""
    assert cfg.agentic is not None
    keep = []
    for e in episodes:
        if e.traj.policy_tokens == 0 or (e.error is not None and cfg.agentic.error_policy == "drop"):
            continue
        keep.append(replace(e, rewards=[0.0] * len(e.rewards)) if e.error is not None else e)
    return keep


def _episode_metrics(episodes: list[Episode], prefix: str) -> dict[str, float]:
    n = len(episodes)
    finish = Counter(e.finish for e in episodes)
    out = {
        f"{prefix}/success": sum(e.success for e in episodes) / n,
        f"{prefix}/reward_mean": sum(e.total_reward for e in episodes) / n,
        f"{prefix}/turns": sum(e.traj.turns for e in episodes) / n,
        f"{prefix}/episode_tokens": sum(len(e.traj.ids) for e in episodes) / n,
        "env/errors" if prefix == "rollout" else f"{prefix}/env_errors": finish["error"] / n,
    }
    if prefix == "rollout":
        out["rollout/accuracy"] = out["rollout/success"]
        out["env/timeouts"] = sum(e.error is not None and "no answer within" in e.error for e in episodes) / n
        out |= {f"env/finish_{k}": v / n for k, v in finish.items()}
    return out


def _turn_metrics(episodes: list[Episode], sizes: list[int]) -> dict[str, float]:
    """How the episodes' turns went through the engine: seconds per turn (engine wait and call, env
    step) and prompts per engine call. Lockstep turns wait for the slowest episode of the turn;
    streamed ones only for their own environment and a batch window."""
    seconds = sorted(s for e in episodes for s in e.turn_seconds)
    out = {"agentic/engine_calls": float(len(sizes))}
    if sizes:
        out |= {
            "agentic/engine_batch_mean": sum(sizes) / len(sizes),
            "agentic/engine_batch_max": float(max(sizes)),
        }
    if seconds:
        out |= {f"agentic/turn_latency_p{q}": _quantile(seconds, q / 100) for q in (50, 95)}
    return out


def _quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values (nearest rank)."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _log_errors(episodes: list[Episode], step: int) -> None:
    for e in episodes:
        if e.error is not None:
            log.warning("step %d: episode (seed %d) ended by an environment error: %s", step, e.seed, e.error)


def _scripted_episode(cfg: RunConfig, builder: TrajectoryBuilder, seed: int) -> Episode:
    """One episode played in this process by the environment's scripted policy (random with ``sft_noise``)."""
    a = cfg.agentic
    assert a is not None
    env, rng = make_env(a.env, a.env_config), random.Random(seed)
    obs, _ = env.reset(seed=seed % a.eval_seed)
    ep = Episode(seed, seed, builder.start_episode(obs, a.system_prompt))
    ep.states.append(obs)
    tok = builder.tokenizer
    for _ in range(a.max_turns):
        random_turn = a.sft_policy == "random" or rng.random() < a.sft_noise
        action = policy_action(env, "random" if random_turn else "scripted")
        ids = [*tok.encode(action, add_special_tokens=False), tok.eos_token_id]
        builder.add_response(ep.traj, ids, [0.0] * len(ids), action)
        obs, reward, terminated, truncated, _ = env.step(action)
        ep.rewards.append(reward)
        if terminated or truncated:
            break
        builder.add_observation(ep.traj, obs)
        ep.states.append(obs)
    return ep
