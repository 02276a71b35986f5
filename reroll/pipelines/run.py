"""The run skeleton every pipeline shares: ``run(pipeline_cls, cfg)``.

A pipeline (``reroll.pipelines.pipeline.Pipeline``) loads its data and supplies one step, its
evaluation and the state it checkpoints. ``run`` owns the rest, once for all of them: the run
directory and resolved config (``reroll.pipelines.run_dir``), the roles (``reroll.pipelines.roles``),
resume or warm start, the reference snapshot, weight freshness (actor_infer gets actor_train's weights
before every step that generates and every evaluation), the step loop with every-N evaluation and
checkpoints, the metrics and the one line per step, failures named with their step, recovery of dead
workers, and the ``RunResult``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from reroll.config.run import RunConfig
from reroll.errors import RewardFailure, RoleError, UserError
from reroll.models.tiny_build import ensure_tiny_model
from reroll.pipelines.pipeline import Checkpointed, Pipeline, every
from reroll.pipelines.preflight import preflight
from reroll.pipelines.roles import Roles
from reroll.pipelines.run_dir import (
    RunResult,
    copy_records,
    open_metrics,
    open_run_dir,
    save_checkpoint,
    warn_unrepresentable,
)
from reroll.runtime import checkpoint, node_copies
from reroll.runtime.console import step_line
from reroll.runtime.placement import driver_threads

log = logging.getLogger(__name__)


def run(pipeline_cls: type[Pipeline], cfg: RunConfig, *, resume: bool = False) -> RunResult:
    """Run the pipeline for its ``total_steps`` (or continue the run in its directory)."""
    for warning in preflight(cfg):  # what `reroll validate` checks, before anything is built or started
        log.warning("warning: %s", warning)
    ensure_tiny_model(cfg.model)
    cfg = cfg.absolute_paths()  # workers on other nodes (or started elsewhere) read the driver's paths
    pipeline = pipeline_cls(cfg)
    late = [s for s in cfg.logging.profile_steps if s > pipeline.total_steps]
    if late:
        raise UserError(
            f"logging.profile_steps: {late} past the run's last step ({pipeline.total_steps}); "
            f"name steps from 1 to {pipeline.total_steps} (a warm one, not the first)"
        )
    warn_unrepresentable(cfg, pipeline.texts())
    resume_from, run_dir = open_run_dir(cfg, resume=resume)
    roles = Roles.start(cfg)
    step, ckpt, last, total = 0, resume_from, {}, pipeline.total_steps
    threads = torch.get_num_threads()
    torch.set_num_threads(driver_threads(cfg) or threads)
    try:
        start = _begin(pipeline, roles, resume_from)
        # roles.cfg: the config with the device type and strategy.name resolved, as config.yaml records it
        metrics_log = open_metrics(roles.cfg, resume_step=start if resume_from else None)
        if start == 0:
            with roles.phase("evaluate", *pipeline.evaluate_uses):
                before = pipeline.evaluate(roles)
            roles.pop_timings()
            metrics_log.log(0, before)
            _keep_reward_errors(roles, run_dir)
            tqdm.write(step_line(0, total, before))
            note = pipeline.headroom(before)
            if note:
                log.warning("warning: %s", note)
        initial, step = pipeline.snapshot(), start + 1  # initial: where a trainer with no checkpoint restarts
        bar = tqdm(desc=pipeline.name, initial=start, total=total, disable=None)
        while step <= total:
            began, before, version = (
                time.perf_counter(),
                pipeline.snapshot(),
                roles.actor_train.weights_version,
            )
            try:
                with roles.profiled(step):
                    metrics, ckpt = _step(pipeline, roles, step, ckpt)
            except RoleError as e:  # a dead worker: restarted and the step retried, or raised
                trained = roles.actor_train.weights_version != version
                step = _recover(e, step, pipeline, roles, (before, initial), trained=trained) + 1
                metrics_log.rewind(step - 1)
                bar.n = step - 1
                bar.refresh()
                continue
            if roles.restarted:
                metrics["recovery/restarts"] = len(roles.restarted)
            metrics |= roles.pop_timings() | {"timing/step": time.perf_counter() - began}
            metrics_log.log(step, metrics)
            _keep_reward_errors(roles, run_dir)
            if ckpt is not None and ckpt.name == checkpoint.step_name(step):  # checkpointed: its records too
                copy_records(cfg, metrics_log)
            last = metrics
            tqdm.write(step_line(step, total, metrics))
            line = pipeline.sample_line()
            if line and cfg.logging.sample_every and step % cfg.logging.sample_every == 0:
                tqdm.write(line)
            bar.update(1)
            step += 1
        bar.close()
        metrics_log.close()
    except (RoleError, RewardFailure) as e:
        raise (e.at_step(step) if step else e) from e
    finally:
        roles.shutdown()
        torch.set_num_threads(threads)
    return RunResult(run_dir, ckpt, run_dir / "metrics.jsonl", run_dir / "config.yaml", last, cfg.storage_url)


def _keep_reward_errors(roles: Roles, run_dir: Path) -> None:
    """Reward failures' tracebacks go to the run directory once it is written to (its first metrics)."""
    if roles.reward is not None and roles.reward.errors.path is None:
        roles.reward.errors.write_to(run_dir / "reward_errors.txt")


def _step(
    pipeline: Pipeline, roles: Roles, step: int, ckpt: Path | None
) -> tuple[dict[str, float], Path | None]:
    """One step, with its every-N evaluation and checkpoint: its metrics and the newest checkpoint."""
    cfg, total = pipeline.cfg, pipeline.total_steps
    # the engine generates with the policy actor_train holds: pushed here, not by each pipeline
    metrics = roles.sync_if_stale() if pipeline.step_generates else {}
    metrics |= pipeline.step(roles, step)
    if every(cfg.eval.every, step, total):
        metrics |= roles.sync_if_stale()
        with roles.phase("evaluate", *pipeline.evaluate_uses):
            metrics |= pipeline.evaluate(roles)
    if every(cfg.checkpoint.every, step, total, at_end=cfg.checkpoint.at_end):
        with roles.phase("checkpoint", "actor_train", "critic"):
            ckpt = save_checkpoint(cfg, roles.actor_train, step, pipeline.checkpointed(), roles.critic)
    return metrics, ckpt


def _recover(
    e: RoleError,
    step: int,
    pipeline: Pipeline,
    roles: Roles,
    snapshots: tuple[Checkpointed, Checkpointed],
    *,
    trained: bool,
) -> int:
    """Restart the role whose worker died during ``step`` (``e.died``; any other error is raised) and
    return the step the loop continues after.

    ``snapshots``: the pipeline's state before ``step`` and at the start of the loop. Most roles hold
    nothing the run cannot give back (``Roles.restart``): the pipeline rewinds to the first and the step is retried with the same prompts. actor_train and critic lose their weights
    and optimizer (one rank's death takes its group's process group: every rank is new): both go back
    to the latest complete checkpoint, as ``--resume`` would (before the first, to the start of the
    run, warm start included), and the steps since are redone; of the two, only the dead one's group
    is rebuilt where a checkpoint exists, and no other role is (the engine gets the weights loaded).
    So does any death after actor_train ``trained`` on ``step`` (in the weight sync or the
    evaluation): retrying the step would train on its samples twice. A worker that dies during the
    recovery is recovered in turn; ``runtime.max_restarts`` bounds them all. A Ray node lost with the
    worker: the run goes on if the nodes left hold it (``ResourceManager.check_nodes``), else stops
    with an error naming what no longer fits and the fix."""
    cfg, limit = pipeline.cfg, pipeline.cfg.runtime.max_restarts
    (before, initial), back_to_checkpoint = snapshots, trained
    while True:
        if not e.died:
            raise e
        if len(roles.restarted) >= limit:
            used = f" ({', '.join(roles.restarted)})" if roles.restarted else ""
            raise e.with_phase(
                e.phase,
                f"{e.cause}; not restarted: runtime.max_restarts={limit} restarts were used{used}. Raise "
                f"runtime.max_restarts, or find why workers die in their logs (/tmp/ray/session_latest/logs)",
            )
        roles.restarted.append(f"{e.role} at step {step}")
        log.warning("step %d: %s; restarting %s (%d of %d)", step, e, e.role, len(roles.restarted), limit)
        roles.pop_timings()  # the failed attempt's
        found = checkpoint.latest(cfg.run_dir)
        # a lost node: the run goes on where the rest still holds it, with every role the node held
        dead = {e.role} | (roles.placement.check_nodes(step, found) if roles.placement is not None else set())
        if len(dead) > 1:
            log.warning("step %d: a lost node held %s: restarting them all", step, ", ".join(sorted(dead)))
        try:
            if dead & {"actor_train", "critic"}:
                back_to_checkpoint = True
                # the other of the two goes back with it: it loads the checkpoint (``_begin``) where
                # there is one; without, only a fresh group holds the run's starting weights
                if found is None:
                    dead |= {role for role in ("actor_train", "critic") if role in roles.groups}
            for role in _restart_order(roles, dead):
                roles.restart(role)
            if not back_to_checkpoint:
                pipeline.rewind(before)
                return step - 1
            if found is None:
                pipeline.rewind(initial)
            log.warning("step %d: the run continues from %s", step, found or "its start")
            return _begin(pipeline, roles, found, recovering=True)
        except RoleError as again:
            e = again


def _restart_order(roles: Roles, dead: set[str]) -> list[str]:
    """``dead`` in the run's role order with the engine last (its restart syncs actor_train's weights);
    judge, which restarts the reward workers that hold it, first."""
    own = [role for role in roles.groups if role in dead and role != "actor_infer"]
    return [r for r in dead if r not in roles.groups] + own + ["actor_infer"] * ("actor_infer" in dead)


def _begin(pipeline: Pipeline, roles: Roles, resume_from: Path | None, *, recovering: bool = False) -> int:
    """Resume from a checkpoint, or warm-start; then snapshot the reference and sync the engine.
    ``recovering``: after a dead trainer's restart (``_recover``), where the reference already holds its
    snapshot (a restarted one loads it itself) and is left as it is.

    Returns the step the loop continues after."""
    cfg, start = pipeline.cfg, 0
    with roles.phase("start", "actor_train", "critic"):
        lr = pipeline.learning_rate()
        roles.actor_train.configure_optimizer(lr.lr, lr.warmup_steps)
        if resume_from is not None:
            if node_copies.spread(cfg.storage_url):  # nodes whose disks are their own get it first
                node_copies.scatter(
                    cfg.storage_url, resume_from, f"checkpoints/{resume_from.name}", alone=True
                )
            roles.actor_train.load(resume_from)
            if roles.critic is not None:
                roles.critic.load(resume_from)
            saved = checkpoint.read_state(resume_from)
            pipeline.restore(saved, resume_from)
            start = saved["step"]
            log.info("resumed from %s (step %d)", resume_from, start)
    if resume_from is None:
        pipeline.warm_start(roles)
    # the reference is the policy the loop starts from (after any warm start)
    if roles.reference is not None and not recovering:
        ref_dir = cfg.run_dir / checkpoint.REFERENCE
        if resume_from is None:
            with roles.phase("start", "actor_train"):
                roles.actor_train.save(ref_dir, with_optimizer=False)
            if node_copies.spread(cfg.storage_url):
                node_copies.gather(cfg.storage_url, ref_dir, checkpoint.REFERENCE, drop=False)
        with roles.phase("start", "reference"):
            node_copies.share_reference(cfg.storage_url, cfg.run_dir)
            roles.reference.load(ref_dir)
    roles.sync_if_stale()
    roles.pop_timings()
    return start
