"""Agentic RL: multi-turn episodes against an environment, trained on the policy's own tokens.

Each step plays ``rollout.batch_size`` episodes, ``rollout.group_size`` per seed (a group), through
the env workers: every turn, one engine call for all live episodes, then one step of each
environment. An episode is one token sequence built with the chat template (``reroll.envs
.trajectory``); the loss covers only the tokens the policy generated. Advantages are the algorithm's:
per episode (``grpo``, ``rloo``, ``reinforce_pp``: the episode's total reward) or per turn
(``step_return``, ``gigpo``: per-turn rewards with ``algorithm.gamma``). An optional SFT warm start
imitates the environment's scripted (or random) policy. Episodes that end in an environment error
are recorded (``env/errors``, ``env/timeouts``, a log line) and, by ``agentic.error_policy``, left
out of the update or trained with reward 0.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from reroll.algorithms.objective import AdvantageResult, AdvantageState, compute_advantages
from reroll.config.schema import RunConfig
from reroll.data.types import SamplingParams, TrainBatch
from reroll.envs.check import policy_action
from reroll.envs.registry import make_env
from reroll.envs.trajectory import TrajectoryBuilder
from reroll.errors import RoleError
from reroll.models.loading import load_tokenizer
from reroll.pipelines.common import (
    Roles,
    RunResult,
    open_metrics,
    open_run_dir,
    save_checkpoint,
    sync_weights,
    train_mini_batches,
)
from reroll.roles.env import EnvGroup, Episode, episode_batch, run_episodes
from reroll.runtime import checkpoint
from reroll.runtime.console import step_line
from reroll.runtime.timing import PhaseTimer

log = logging.getLogger(__name__)


def run_agentic(cfg: RunConfig, *, resume: bool = False) -> RunResult:
    assert cfg.agentic is not None
    _build_tiny(cfg)
    resume_from, run_dir = open_run_dir(cfg, resume=resume)
    tokenizer = load_tokenizer(cfg.model.path)
    builder = TrajectoryBuilder(tokenizer)
    roles = Roles.start(cfg, reference=cfg.needs_reference, reward=False)
    envs = EnvGroup(cfg)
    step = 0
    try:
        start, state = _restore_or_warm_start(cfg, roles, builder, resume_from)
        metrics_log = open_metrics(cfg, resume_step=start if resume_from else None)
        a = cfg.agentic

        def play(starts: list[tuple[int, int]], params: SamplingParams) -> list[Episode]:
            limits = {"max_turns": a.max_turns, "max_tokens": a.max_episode_tokens}
            return run_episodes(
                roles.rollout.generate, envs, builder, starts, params, **limits, system_prompt=a.system_prompt
            )

        if start == 0:
            before = _evaluate(cfg, play)
            metrics_log.log(0, before)
            tqdm.write(step_line(0, cfg.total_steps, before))
        timer, last, ckpt = PhaseTimer(), {}, resume_from
        steps = range(start + 1, cfg.total_steps + 1)
        for step in tqdm(steps, desc="agentic", initial=start, total=cfg.total_steps, disable=None):
            with timer("episodes"):
                episodes = play(_train_starts(cfg, step), _sampling(cfg, seed=cfg.seed * 1_000_003 + step))
            with timer("advantages"):
                batch, adv = _advantages(cfg, roles, _trainable(cfg, episodes), tokenizer.pad_token_id, state)
            metrics = _episode_metrics(episodes, "rollout")
            if batch is not None and adv is not None:
                state = adv.state
                metrics |= {k: float(v) for k, v in adv.metrics.items()}
                with timer("train"):
                    metrics |= train_mini_batches(cfg, batch.select(adv.keep), step, roles.actor.train_rl)
            else:
                metrics["train/skipped"] = 1.0
            sync_weights(cfg, roles, timer)
            metrics |= roles.rollout.metrics()
            if (cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.total_steps:
                with timer("evaluate"):
                    metrics |= _evaluate(cfg, play)
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == cfg.total_steps:
                with timer("checkpoint"):
                    ckpt = save_checkpoint(
                        cfg, roles.actor, step, {}, {"algorithm_state.pt": state.state_dict()}
                    )
            metrics |= timer.pop()
            metrics_log.log(step, metrics)
            last = metrics
            tqdm.write(step_line(step, cfg.total_steps, metrics))
            _log_errors(episodes, step)
            if cfg.logging.sample_every and step % cfg.logging.sample_every == 0:
                tqdm.write(f"sample: {episodes[0].traj.messages}")
        metrics_log.close()
    except RoleError as e:
        raise (e.at_step(step) if step else e) from e
    finally:
        envs.shutdown()
        roles.shutdown()
    return RunResult(run_dir, ckpt, run_dir / "metrics.jsonl", run_dir / "config.yaml", last)


def _build_tiny(cfg: RunConfig) -> None:
    t = cfg.model.build_tiny
    if t is None or Path(cfg.model.path).exists():
        return
    from reroll.data.arithmetic import ARITHMETIC_ALPHABET
    from reroll.models.tiny import GAME_ALPHABET, build_tiny_model

    alphabet = {"arithmetic": ARITHMETIC_ALPHABET, "game": GAME_ALPHABET}[t.alphabet]
    log.info("building a tiny model in %s", cfg.model.path)
    sizes = {"hidden_size": t.hidden_size, "num_layers": t.num_layers, "num_heads": t.num_heads}
    build_tiny_model(cfg.model.path, alphabet=alphabet, **sizes, seed=t.seed)


def _train_starts(cfg: RunConfig, step: int) -> list[tuple[int, int]]:
    """(seed, group) of each episode: ``group_size`` episodes per seed; seeds stay below eval_seed."""
    assert cfg.agentic is not None
    n = cfg.prompts_per_step
    seeds = [((cfg.seed * 7_919 + step) * n + j) % cfg.agentic.eval_seed for j in range(n)]
    return [(s, g) for g, s in enumerate(seeds) for _ in range(cfg.rollout.group_size)]


def _sampling(cfg: RunConfig, seed: int | None, greedy: bool = False) -> SamplingParams:
    r = cfg.rollout
    temperature = 0.0 if greedy else r.temperature
    return SamplingParams(
        n=1,
        temperature=temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop=tuple(r.stop),
        seed=seed,
    )


def _trainable(cfg: RunConfig, episodes: list[Episode]) -> list[Episode]:
    """The episodes the update uses: errored ones dropped or zeroed (``agentic.error_policy``)."""
    assert cfg.agentic is not None
    keep = []
    for e in episodes:
        if e.traj.policy_tokens == 0 or (e.error is not None and cfg.agentic.error_policy == "drop"):
            continue
        keep.append(replace(e, rewards=[0.0] * len(e.rewards)) if e.error is not None else e)
    return keep


def _advantages(
    cfg: RunConfig, roles: Roles, episodes: list[Episode], pad_id: int, state: AdvantageState
) -> tuple[TrainBatch | None, AdvantageResult | None]:
    """The episodes' batch with its advantages (per episode or per turn, as the algorithm says)."""
    if not episodes:
        return None, None
    batch = episode_batch(episodes, pad_id)
    if roles.reference is not None:
        batch.ref_logprobs = roles.reference.compute_logprobs(batch)
    adv = compute_advantages(
        cfg.algorithm,
        rewards=batch.rewards,
        group_ids=batch.group_ids,
        response_mask=batch.response_mask,
        logprobs=batch.rollout_logprobs,
        ref_logprobs=batch.ref_logprobs,
        step_ids=batch.extras["step_ids"],
        step_rewards=batch.extras["step_rewards"],
        step_states=batch.extras["step_states"],
        state=state,
    )
    batch.advantages = adv.advantages
    return batch, adv


def _evaluate(cfg: RunConfig, play) -> dict[str, float]:
    """Greedy episodes on the held-out seeds: ``eval/success`` (also as ``eval/accuracy``) and friends."""
    assert cfg.agentic is not None
    n = cfg.agentic.eval_episodes
    if n == 0:
        return {}
    episodes = play([(cfg.agentic.eval_seed + i, i) for i in range(n)], _sampling(cfg, None, greedy=True))
    out = _episode_metrics(episodes, "eval")
    return out | {"eval/accuracy": out["eval/success"]}


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


def _log_errors(episodes: list[Episode], step: int) -> None:
    for e in episodes:
        if e.error is not None:
            log.warning("step %d: episode (seed %d) ended by an environment error: %s", step, e.seed, e.error)


def _restore_or_warm_start(
    cfg: RunConfig, roles: Roles, builder: TrajectoryBuilder, resume_from: Path | None
) -> tuple[int, AdvantageState]:
    """Resume from a checkpoint, or run the SFT warm start on the environment's own policy; sync the engine."""
    start, state = 0, AdvantageState.initial(cfg.algorithm)
    roles.actor.configure_optimizer(cfg.optim.lr, cfg.optim.warmup_steps)
    if resume_from is not None:
        roles.actor.load(resume_from)
        state = AdvantageState.from_state_dict(torch.load(resume_from / "algorithm_state.pt"))
        start = checkpoint.read_state(resume_from)["step"]
        log.info("resumed from %s (step %d)", resume_from, start)
    elif cfg.sft is not None and cfg.sft.steps > 0:
        log.info("SFT warm start: %d steps on %s-policy episodes", cfg.sft.steps, cfg.agentic.sft_policy)
        roles.actor.configure_optimizer(cfg.sft.lr, cfg.sft.warmup_steps)
        for i in tqdm(range(cfg.sft.steps), desc="sft", leave=False, disable=None):
            seeds = range(i * cfg.sft.batch_size, (i + 1) * cfg.sft.batch_size)
            episodes = [_scripted_episode(cfg, builder, s) for s in seeds]
            roles.actor.train_sft(episode_batch(episodes, builder.tokenizer.pad_token_id))
        roles.actor.configure_optimizer(cfg.optim.lr, cfg.optim.warmup_steps)  # a fresh optimizer for RL
    if roles.reference is not None:
        ref_dir = cfg.run_dir / "reference"
        if resume_from is None:
            roles.actor.save(ref_dir, with_optimizer=False)
        roles.reference.load(ref_dir)
    sync_weights(cfg, roles, PhaseTimer())
    return start, state


def _scripted_episode(cfg: RunConfig, builder: TrajectoryBuilder, seed: int) -> Episode:
    """One episode played in this process by the environment's scripted policy (random with ``sft_noise``)."""
    a = cfg.agentic
    assert a is not None
    env, rng = make_env(a.env, a.env_config), random.Random(seed)
    obs, _ = env.reset(seed=seed % a.eval_seed)
    head = [{"role": "system", "content": a.system_prompt}] if a.system_prompt else []
    ep = Episode(seed, seed, builder.start([*head, {"role": builder.observation_role, "content": obs}]))
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
