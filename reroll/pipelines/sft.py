"""SFT: supervised fine-tuning on prompt/target rows through the actor_train role.

The held-out evaluation generates greedily through actor_infer (weights synced first) and scores with
the reward, so SFT and RL runs report the same ``eval/accuracy``.
"""

from __future__ import annotations

import logging

from tqdm import tqdm

from reroll.config.schema import RunConfig
from reroll.data.datasets import PromptSampler, load_samples
from reroll.models.loading import load_tokenizer
from reroll.pipelines.common import (
    Roles,
    RunResult,
    evaluate,
    load_data,
    open_metrics,
    open_run_dir,
    prepare_inputs,
    save_checkpoint,
    sft_batch,
)
from reroll.runtime import checkpoint
from reroll.runtime.console import step_line
from reroll.runtime.timing import PhaseTimer

log = logging.getLogger(__name__)


def run_sft(cfg: RunConfig, *, resume: bool = False) -> RunResult:
    assert cfg.sft is not None  # RunConfig.check guarantees it
    prepare_inputs(cfg)
    train, held_out = load_data(cfg)
    if cfg.sft.files:
        train = load_samples(
            cfg.sft.files, template=cfg.data.prompt_template, required=[cfg.data.answer_field]
        )
    resume_from, run_dir = open_run_dir(cfg, resume=resume)
    tokenizer = load_tokenizer(cfg.model.path)
    sampler = PromptSampler(train, cfg.sft.batch_size, seed=cfg.seed + 1, shuffle=cfg.data.shuffle)
    roles = Roles.start(cfg, reference=False)
    start, ckpt, last = 0, resume_from, {}
    try:
        roles.actor.configure_optimizer(cfg.sft.lr, cfg.sft.warmup_steps)
        if resume_from is not None:
            roles.actor.load(resume_from)
            saved = checkpoint.read_state(resume_from)
            sampler.restore(saved["sampler"])
            start = saved["step"]
        metrics_log = open_metrics(cfg, resume_step=start if resume_from else None)
        timer = PhaseTimer()
        total = cfg.sft.steps
        for step in tqdm(range(start + 1, total + 1), desc="sft", initial=start, total=total, disable=None):
            with timer("train"):
                metrics = roles.actor.train_sft(
                    sft_batch(sampler.next_batch(), tokenizer, cfg.sft.target_template)
                )
            if (cfg.eval.every and step % cfg.eval.every == 0) or step == total:
                with timer("evaluate"):
                    roles.rollout.sync_weights(roles.actor)
                    metrics |= evaluate(cfg, roles, held_out)
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == total:
                with timer("checkpoint"):
                    ckpt = save_checkpoint(cfg, roles.actor, step, {"sampler": sampler.state()})
            metrics |= timer.pop()
            metrics_log.log(step, metrics)
            last = metrics
            tqdm.write(step_line(step, total, metrics))
        metrics_log.close()
    finally:
        roles.shutdown()
    return RunResult(run_dir, ckpt, run_dir / "metrics.jsonl", run_dir / "config.yaml", last)
