"""What every pipeline does around its loop: the run directory, data, roles, evaluation, checkpoints, logs."""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from reroll.algorithms.aggregation import count_tokens_and_seqs
from reroll.config.loader import dump_config
from reroll.config.schema import RunConfig
from reroll.data.datasets import DomainSampler, PromptSampler, load_samples
from reroll.data.types import Sample, SamplingParams, TrainBatch
from reroll.errors import UserError
from reroll.models.loading import load_tokenizer
from reroll.rewards import routing
from reroll.rewards.base import RewardResult
from reroll.roles.critic import CriticGroup
from reroll.roles.reward import RewardGroup
from reroll.roles.rollout import RolloutGroup, weight_buckets
from reroll.roles.strategy_worker import mean_metrics
from reroll.roles.trainer import TrainerGroup
from reroll.runtime import checkpoint
from reroll.runtime.actors import start_ray
from reroll.runtime.metrics import MetricsLogger
from reroll.runtime.placement import Colocation, ResourceManager, offload_between_phases
from reroll.runtime.timing import PhaseTimer

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """Where a finished run put things, and its last metrics."""

    run_dir: Path
    checkpoint: Path | None
    metrics_path: Path
    config_path: Path
    final_metrics: dict[str, float] = field(default_factory=dict)


def is_correct(result: RewardResult) -> bool:
    """A reward's own ``correct`` detail where it reports one, else a full score."""
    return routing.is_correct(result)


def prepare_inputs(cfg: RunConfig) -> None:
    """Build the tiny model and the synthetic data the config asks for, where they do not exist yet."""
    if cfg.model.build_tiny is not None and not Path(cfg.model.path).exists():
        from reroll.data.arithmetic import ARITHMETIC_ALPHABET
        from reroll.models.tiny import build_tiny_model

        t = cfg.model.build_tiny
        log.info("building a tiny model in %s", cfg.model.path)
        build_tiny_model(
            cfg.model.path,
            alphabet=ARITHMETIC_ALPHABET,
            hidden_size=t.hidden_size,
            num_layers=t.num_layers,
            num_heads=t.num_heads,
            seed=t.seed,
        )
    syn = cfg.data.synthetic
    targets = [Path(cfg.data.train_files[0]), *(Path(f) for f in cfg.data.eval_files[:1])]
    if syn is not None and not all(p.exists() for p in targets):
        from reroll.data.arithmetic import write_arithmetic_dataset

        with tempfile.TemporaryDirectory() as tmp:
            made = write_arithmetic_dataset(
                tmp,
                n_train=syn.n_train,
                n_test=syn.n_test,
                max_operand=syn.max_operand,
                ops=syn.ops,
                seed=syn.seed,
            )
            for src, dst in zip([made["train"], made["test"]], targets):
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
        log.info("wrote synthetic %s data to %s", syn.task, ", ".join(map(str, targets)))


def load_data(cfg: RunConfig) -> tuple[list[Sample], list[Sample]]:
    """Training and held-out samples, checked for the fields the template and reward need."""
    kw = {
        "template": cfg.data.prompt_template,
        "required": [] if cfg.reward.domains else [cfg.data.answer_field],
        "id_field": cfg.data.id_field,
    }
    train = load_samples(cfg.data.train_files, **kw)
    held_out = (
        load_samples(cfg.data.eval_files, **kw, limit=cfg.data.eval_limit) if cfg.data.eval_files else []
    )
    if cfg.reward.domains:
        _check_domain_rows(cfg, [*train, *held_out])
    if cfg.data.answer_field != "answer":  # reward functions read row["answer"]
        alias = cfg.data.answer_field
        train, held_out = ([_with_answer(s, alias) for s in part] for part in (train, held_out))
    return train, held_out


def _check_domain_rows(cfg: RunConfig, samples: list[Sample]) -> None:
    """Every row routes to a domain and has the fields that domain's rewards read."""
    needs = routing.domain_required_fields(cfg.reward)
    for s in samples:
        domain = routing.route(cfg.reward, s.domain)
        missing = [
            f
            for f in needs[domain]
            if f not in s.row and not (f == "answer" and cfg.data.answer_field in s.row)
        ]
        if missing:
            raise UserError(
                f"row {s.uid!r} (domain {domain!r}) has no field {missing[0]!r}, which the domain's rewards "
                f"read; the row has {sorted(s.row)}"
            )


def prompt_sampler(cfg: RunConfig, train: list[Sample]) -> PromptSampler | DomainSampler:
    """Each step's prompts: by the domains' shares where reward.domains sets them, else from all rows."""
    shares = {name: d.share for name, d in cfg.reward.domains.items()}
    if not shares or any(v is None for v in shares.values()):
        return PromptSampler(train, cfg.prompts_per_step, seed=cfg.seed, shuffle=cfg.data.shuffle)
    by_domain: dict[str, list[Sample]] = {name: [] for name in shares}
    for s in train:
        by_domain[routing.route(cfg.reward, s.domain)].append(s)
    return DomainSampler(by_domain, shares, cfg.prompts_per_step, seed=cfg.seed, shuffle=cfg.data.shuffle)


def _with_answer(sample: Sample, field_name: str) -> Sample:
    if field_name not in sample.row:  # a domain whose rewards read no answer (code tests, rules)
        return sample
    return Sample(sample.uid, sample.prompt, {**sample.row, "answer": sample.row[field_name]}, sample.domain)


@dataclass
class Roles:
    """The role groups of a run, where ``placement`` put them."""

    actor: TrainerGroup
    rollout: RolloutGroup
    reward: RewardGroup | None
    reference: TrainerGroup | None = None
    critic: CriticGroup | None = None
    placement: ResourceManager | None = None
    colocation: Colocation | None = None

    @classmethod
    def start(cls, cfg: RunConfig, *, reference: bool, critic: bool = False, reward: bool = True) -> Roles:
        if cfg.runtime.backend == "ray":
            start_ray(cfg.runtime.ray_address)
        placement = ResourceManager(cfg)
        cfg = placement.cfg  # device type resolved, for the workers
        roles = cls(
            actor=TrainerGroup("actor_train", cfg, trainable=True),
            rollout=RolloutGroup(cfg),
            reward=RewardGroup(cfg) if reward else None,
            reference=TrainerGroup("reference", cfg, trainable=False) if reference else None,
            critic=CriticGroup(cfg) if critic else None,
            placement=placement,
        )
        groups = {
            "actor_train": roles.actor,
            "actor_infer": roles.rollout,
            "reference": roles.reference,
            "critic": roles.critic,
        }
        enabled = offload_between_phases(cfg, placement.device_type)
        roles.colocation = Colocation(groups, placement.map, enabled)
        return roles

    def use(self, *names: str) -> None:
        """Before a phase: the roles it runs on hold their devices; colocated others are offloaded."""
        if self.colocation is not None:
            self.colocation.use(*names)

    def shutdown(self) -> None:
        for group in (self.actor, self.rollout, self.reward, self.reference, self.critic):
            if group is not None:
                group.shutdown()
        if self.placement is not None:
            self.placement.shutdown()


def open_run_dir(cfg: RunConfig, *, resume: bool) -> tuple[Path | None, Path]:
    """The run directory with the resolved config written; on resume, the checkpoint to start from."""
    run_dir = cfg.run_dir
    found = checkpoint.latest(run_dir) if resume else None
    if resume and found is None:
        raise UserError(
            f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}; run without --resume"
        )
    if not resume and checkpoint.latest(run_dir) is not None:
        raise UserError(
            f"{run_dir} already holds checkpoints: add --resume to continue that run, or set name / "
            f"output_dir to start a new one (nothing was overwritten)"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run_dir / "config.yaml")
    return found, run_dir


def open_metrics(cfg: RunConfig, resume_step: int | None) -> MetricsLogger:
    lg = cfg.logging
    return MetricsLogger(
        cfg.run_dir,
        tensorboard=lg.tensorboard,
        wandb=lg.wandb,
        wandb_project=lg.wandb_project,
        run_name=cfg.name,
        config=cfg.model_dump(mode="json"),
        resume_step=resume_step,
    )


def sft_batch(samples: Sequence[Sample], tokenizer: Any, target_template: str) -> TrainBatch:
    """Prompt + target + eos rows; the loss covers the target and eos."""
    rows = []
    for s in samples:
        prompt = tokenizer.encode(s.prompt, add_special_tokens=False)
        target = tokenizer.encode(target_template.format(**s.row), add_special_tokens=False)
        rows.append((prompt, [*target, tokenizer.eos_token_id]))
    width = max(len(p) + len(t) for p, t in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.bool)
    resp = torch.zeros_like(attn)
    for i, (p, t) in enumerate(rows):
        ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        attn[i, : len(p) + len(t)] = True
        resp[i, len(p) : len(p) + len(t)] = True
    return TrainBatch(
        input_ids=ids,
        attention_mask=attn,
        response_mask=resp,
        group_ids=torch.arange(len(rows)),
        num_tokens=float(resp.sum()),
        num_seqs=float(len(rows)),
    )


def run_sft_steps(
    cfg: RunConfig, actor: TrainerGroup, samples: list[Sample], *, on_step: Any = None
) -> dict[str, float]:
    """``cfg.sft.steps`` supervised steps on ``samples`` through actor_train; returns the last step's metrics."""
    assert cfg.sft is not None
    tokenizer = load_tokenizer(cfg.model.path)
    actor.configure_optimizer(cfg.sft.lr, cfg.sft.warmup_steps)
    sampler = PromptSampler(samples, cfg.sft.batch_size, seed=cfg.seed + 1, shuffle=cfg.data.shuffle)
    metrics: dict[str, float] = {}
    for i in range(1, cfg.sft.steps + 1):
        metrics = actor.train_sft(sft_batch(sampler.next_batch(), tokenizer, cfg.sft.target_template))
        if on_step is not None:
            on_step(i, metrics)
    return metrics


def evaluate(cfg: RunConfig, roles: Roles, samples: list[Sample]) -> dict[str, float]:
    """Greedy responses to the held-out prompts, scored by the reward: ``eval/accuracy`` and friends."""
    if not samples:
        return {}
    params = SamplingParams(
        n=1, temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens, stop=tuple(cfg.rollout.stop)
    )
    roles.use("actor_infer")
    groups = roles.rollout.generate([s.prompt for s in samples], params, phase="evaluate")
    completions = [g[0] for g in groups]
    results = roles.reward.score(
        [(s.prompt, c.text, s.row, s.domain) for s, c in zip(samples, completions)], phase="evaluate"
    )
    n = len(samples)
    domains = [routing.route(cfg.reward, s.domain) for s in samples]
    per_domain = routing.domain_metrics(domains, results, prefix="eval", per_domain=bool(cfg.reward.domains))
    return {
        "eval/accuracy": sum(is_correct(r) for r in results) / n,
        "eval/reward_mean": sum(r.score for r in results) / n,
        "eval/response_length": sum(len(c.response_ids) for c in completions) / n,
        **per_domain,
    }


def save_checkpoint(
    cfg: RunConfig,
    actor: TrainerGroup,
    step: int,
    state: dict[str, Any],
    objects: dict[str, Any] | None = None,
    critic: CriticGroup | None = None,
) -> Path:
    """A complete checkpoint of ``step`` (see ``reroll.runtime.checkpoint``), older ones pruned.

    ``state`` goes into ``trainer_state.json``; ``objects`` are ``torch.save``d under their file names;
    a ``critic`` saves into ``critic/``.
    """
    partial = checkpoint.begin(cfg.run_dir, step)
    actor.save(partial, with_optimizer=True)
    if critic is not None:
        critic.save(partial)
    for name, obj in (objects or {}).items():
        torch.save(obj, partial / name)
    tokenizer = load_tokenizer(cfg.model.path)
    tokenizer.save_pretrained(partial / "model")
    final = checkpoint.commit(partial, {"step": step, **state})
    checkpoint.prune(cfg.run_dir, cfg.checkpoint.keep_last)
    return final


def sync_weights(cfg: RunConfig, roles: Roles, timer: PhaseTimer) -> float:
    """actor_train's weights into actor_infer (gathered while the trainer holds its device), or only the
    LoRA adapters where ``strategy.lora.sync`` is 'adapters'. Returns the bytes sent (``sync/bytes``)."""
    roles.use("actor_train")
    with timer("weight_sync"):
        if cfg.strategy.lora is not None and cfg.strategy.lora.sync == "adapters":
            update = roles.actor.adapter_update()
            roles.use("actor_infer")
            roles.rollout.update_lora(update.tensors, update.config)
        else:
            buckets = weight_buckets(roles.actor, cfg.rollout.weight_sync_bucket_mb)
            roles.use("actor_infer")
            roles.rollout.load_weight_buckets(buckets)
    return float(roles.actor.sent_bytes())


def train_mini_batches(
    cfg: RunConfig, batch: TrainBatch, step: int, update: Callable[[TrainBatch], dict[str, float]]
) -> dict[str, float]:
    """``ppo_epochs`` passes of ``mini_batches`` calls of ``update`` (one optimizer step each), metrics averaged.

    Each mini-batch is normalised by its own counts. The order depends on the step only, so the actor
    and the critic see the same mini-batches.
    """
    if len(batch) == 0:
        return {"train/skipped": 1.0}
    g = torch.Generator().manual_seed(cfg.seed * 7_919 + step)
    parts = []
    for _ in range(cfg.optim.ppo_epochs):
        order = (
            torch.randperm(len(batch), generator=g)
            if cfg.optim.mini_batches > 1
            else torch.arange(len(batch))
        )
        for idx in order.chunk(cfg.optim.mini_batches):
            mini = batch.select(idx)
            tokens, seqs = count_tokens_and_seqs(mini.response_mask)
            mini = replace(mini, num_tokens=float(tokens), num_seqs=float(seqs))
            parts.append(update(mini))
    return mean_metrics(parts)
