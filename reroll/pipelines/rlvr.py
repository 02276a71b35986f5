"""RLVR: reinforcement learning with verifiable rewards (GRPO and the rest of the algorithm zoo).

One controller drives four roles, five with PPO's critic. Each step: actor_infer samples ``group_size``
responses per prompt, reward scores them, reference and actor_train score the tokens, the critic (if
any) gives its values, the algorithm turns rewards into advantages (and the critic's returns),
actor_train and the critic take their optimizer steps, and the new weights go to actor_infer. Every
phase is timed. An optional SFT warm start runs first on the same actor_train role.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from reroll.algorithms.objective import AdvantageState, compute_advantages
from reroll.config.schema import RunConfig
from reroll.data.datasets import DomainSampler, PromptSampler
from reroll.data.types import Rollout, Sample, SamplingParams, build_train_batch
from reroll.errors import RoleError
from reroll.models.loading import load_tokenizer, mismatch_metrics
from reroll.pipelines.common import (
    Roles,
    RunResult,
    evaluate,
    is_correct,
    load_data,
    open_metrics,
    open_run_dir,
    prepare_inputs,
    prompt_sampler,
    run_sft_steps,
    save_checkpoint,
    sync_weights,
    train_mini_batches,
)
from reroll.rewards import routing
from reroll.runtime import checkpoint
from reroll.runtime.console import sample_line, step_line
from reroll.runtime.timing import PhaseTimer

log = logging.getLogger(__name__)


def run_rlvr(cfg: RunConfig, *, resume: bool = False) -> RunResult:
    prepare_inputs(cfg)
    train, held_out = load_data(cfg)
    resume_from, run_dir = open_run_dir(cfg, resume=resume)
    pad_id = load_tokenizer(cfg.model.path).pad_token_id
    sampler = prompt_sampler(cfg, train)
    # with LoRA the reference is actor_train's own base model (adapters disabled): no second copy
    reference = cfg.needs_reference and cfg.strategy.lora is None
    roles = Roles.start(cfg, reference=reference, critic=cfg.critic is not None)
    step = 0
    try:
        start, state = _restore_or_warm_start(cfg, roles, sampler, train, resume_from)
        metrics_log = open_metrics(cfg, resume_step=start if resume_from else None)
        if start == 0:
            before = evaluate(cfg, roles, held_out)
            metrics_log.log(0, before)
            tqdm.write(step_line(0, cfg.total_steps, before))

        timer = PhaseTimer()
        last: dict[str, float] = {}
        ckpt = resume_from
        for step in tqdm(
            range(start + 1, cfg.total_steps + 1),
            desc="rlvr",
            initial=start,
            total=cfg.total_steps,
            disable=None,
        ):
            roles.use("actor_infer")
            with timer("generate"):
                params = _sampling(cfg, seed=cfg.seed * 1_000_003 + step)
                prompts = sampler.next_batch()
                groups = roles.rollout.generate([s.prompt for s in prompts], params)
                rollouts = [
                    Rollout(s, g, c) for g, (s, comps) in enumerate(zip(prompts, groups)) for c in comps
                ]
            with timer("reward"):
                results = roles.reward.score(
                    [(r.sample.prompt, r.completion.text, r.sample.row, r.sample.domain) for r in rollouts]
                )
                domains = [routing.route(cfg.reward, r.sample.domain) for r in rollouts]
                batch = build_train_batch(rollouts, pad_id)
                raw = torch.tensor([r.score for r in results], dtype=torch.float32)
                batch.rewards = routing.normalize_by_domain(raw, domains, cfg.reward)
            if cfg.needs_reference:
                ref = roles.reference or roles.actor
                roles.use(ref.role)
                with timer("reference"):
                    batch.ref_logprobs = ref.compute_logprobs(batch, base_model=roles.reference is None)
            if _needs_old_logprobs(cfg):
                roles.use("actor_train")
                with timer("old_logprobs"):
                    batch.old_logprobs = roles.actor.compute_logprobs(batch)
            if roles.critic is not None:
                roles.use("critic")
                with timer("values"):
                    batch.extras["values"] = roles.critic.compute_values(batch)
            if cfg.algorithm.adv_estimator == "remax":
                with timer("baseline"):
                    batch.extras["baseline_rewards"] = _greedy_rewards(cfg, roles, prompts)
            with timer("advantages"):
                adv = compute_advantages(
                    cfg.algorithm,
                    rewards=batch.rewards,
                    group_ids=batch.group_ids,
                    response_mask=batch.response_mask,
                    logprobs=batch.old_logprobs,
                    ref_logprobs=batch.ref_logprobs,
                    values=batch.extras.get("values"),
                    baseline_rewards=batch.extras.get("baseline_rewards"),
                    response_lengths=batch.response_mask.sum(-1),
                    truncated=torch.tensor([r.completion.finish_reason == "length" for r in rollouts]),
                    max_response_len=cfg.rollout.max_new_tokens,
                    state=state,
                )
                batch.advantages, state = adv.advantages, adv.state
                if roles.critic is not None:
                    batch.extras["returns"] = adv.returns
                kept = batch.select(adv.keep)
            roles.use("actor_train")
            with timer("train"):
                train_metrics = train_mini_batches(cfg, kept, step, roles.actor.train_rl)
            if roles.critic is not None:
                roles.use("critic")
                with timer("critic"):
                    train_metrics |= train_mini_batches(cfg, kept, step, roles.critic.train)
            sync_bytes = sync_weights(cfg, roles, timer)
            metrics = {
                "sync/bytes": sync_bytes,
                **_rollout_metrics(rollouts, results, batch),
                **routing.domain_metrics(domains, results, per_domain=bool(cfg.reward.domains)),
                **{k: float(v) for k, v in adv.metrics.items()},
                **train_metrics,
                **roles.rollout.metrics(),
            }
            if (cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.total_steps:
                with timer("evaluate"):
                    metrics |= evaluate(cfg, roles, held_out)
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == cfg.total_steps:
                roles.use("actor_train", "critic")
                with timer("checkpoint"):
                    ckpt = _checkpoint(cfg, roles, step, sampler, state)
            if roles.colocation is not None:
                timer.add(roles.colocation.pop_seconds())
            metrics |= timer.pop()
            metrics_log.log(step, metrics)
            last = metrics
            tqdm.write(step_line(step, cfg.total_steps, metrics))
            if cfg.logging.sample_every and step % cfg.logging.sample_every == 0:
                tqdm.write(sample_line(rollouts[0], results[0]))
        metrics_log.close()
    except RoleError as e:
        raise (e.at_step(step) if step else e) from e
    finally:
        roles.shutdown()
    return RunResult(run_dir, ckpt, run_dir / "metrics.jsonl", run_dir / "config.yaml", last)


def _restore_or_warm_start(
    cfg: RunConfig,
    roles: Roles,
    sampler: PromptSampler | DomainSampler,
    train: list[Sample],
    resume_from: Path | None,
) -> tuple[int, AdvantageState]:
    """Resume from a checkpoint, or run the SFT warm start; then set the reference and sync the engine.

    Returns the step to continue after and the algorithm's carried state.
    """
    start, state = 0, AdvantageState.initial(cfg.algorithm)
    roles.actor.configure_optimizer(cfg.optim.lr, cfg.optim.warmup_steps)
    if resume_from is not None:
        roles.actor.load(resume_from)
        if roles.critic is not None:
            roles.critic.load(resume_from)
        saved = checkpoint.read_state(resume_from)
        sampler.restore(saved["sampler"])
        state = AdvantageState.from_state_dict(torch.load(resume_from / "algorithm_state.pt"))
        start = saved["step"]
        log.info("resumed from %s (step %d)", resume_from, start)
    elif cfg.sft is not None and cfg.sft.steps > 0:
        log.info("SFT warm start: %d steps", cfg.sft.steps)
        bar = tqdm(total=cfg.sft.steps, desc="sft", leave=False, disable=None)
        on_step = lambda i, m: (bar.update(), bar.set_postfix(loss=f"{m['sft/loss']:.3f}"))  # noqa: E731
        run_sft_steps(cfg, roles.actor, train, on_step=on_step)
        bar.close()
        roles.actor.configure_optimizer(cfg.optim.lr, cfg.optim.warmup_steps)  # a fresh optimizer for RL
    if roles.reference is not None:  # the reference is the policy RL starts from (after any warm start)
        ref_dir = cfg.run_dir / "reference"
        if resume_from is None:
            roles.actor.save(ref_dir, with_optimizer=False)
        roles.reference.load(ref_dir)
    sync_weights(cfg, roles, PhaseTimer())
    return start, state


def _needs_old_logprobs(cfg: RunConfig) -> bool:
    """One optimizer step per batch is on-policy: the trainer's log-probs before the step are the old
    ones, so the separate pass is skipped unless the KL-in-reward needs them up front."""
    alg = cfg.algorithm
    on_policy = cfg.optim.ppo_epochs == 1 and cfg.optim.mini_batches == 1
    return not on_policy or (alg.kl_in == "reward" and alg.kl_coef > 0)


def _greedy_rewards(cfg: RunConfig, roles: Roles, prompts: list[Sample]) -> torch.Tensor:
    """ReMax's baseline: the reward of each prompt's greedy response, repeated over its group ``(B,)``."""
    params = replace(_sampling(cfg, seed=None), n=1, temperature=0.0)
    roles.use("actor_infer")
    greedy = [g[0] for g in roles.rollout.generate([s.prompt for s in prompts], params, phase="baseline")]
    results = roles.reward.score(
        [(s.prompt, c.text, s.row, s.domain) for s, c in zip(prompts, greedy)], phase="baseline"
    )
    return torch.tensor([r.score for r in results], dtype=torch.float32).repeat_interleave(
        cfg.rollout.group_size
    )


def _checkpoint(
    cfg: RunConfig, roles: Roles, step: int, sampler: PromptSampler | DomainSampler, state: AdvantageState
) -> Path:
    objects = {"algorithm_state.pt": state.state_dict()}
    return save_checkpoint(cfg, roles.actor, step, {"sampler": sampler.state()}, objects, critic=roles.critic)


def _sampling(cfg: RunConfig, seed: int | None) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        n=r.group_size,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop=tuple(r.stop),
        seed=seed,
    )


def _rollout_metrics(rollouts: list[Rollout], results: list, batch) -> dict[str, float]:
    n = len(rollouts)
    lengths = batch.response_mask.sum(-1).float()
    out = {
        "rollout/reward_mean": sum(r.score for r in results) / n,  # before any per-domain normalisation
        "rollout/accuracy": sum(is_correct(r) for r in results) / n,
        "rollout/response_length": float(lengths.mean()),
        "rollout/truncated": sum(r.completion.finish_reason == "length" for r in rollouts) / n,
    }
    if batch.old_logprobs is not None:  # else the trainer measures it in its first forward pass
        out |= mismatch_metrics(batch.old_logprobs, batch.rollout_logprobs, batch.response_mask)
    return out
