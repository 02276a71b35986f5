"""What several pipelines share inside their steps: data, the SFT warm start, sampling, evaluation, mini-batches."""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from tqdm import tqdm

from reroll.algorithms.aggregation import count_tokens_and_seqs
from reroll.config.schema import RunConfig
from reroll.config.startable import model_type
from reroll.config.vision import image_problems
from reroll.data.chat import ChatTemplateError, PromptFormat
from reroll.data.datasets import DomainSampler, PromptSampler, load_samples
from reroll.data.lengths import LengthFit, answer_template, length_fit, reference_text
from reroll.data.types import (
    Completion,
    ImageInputs,
    RewardItem,
    Sample,
    SamplingParams,
    TrainBatch,
    padded_images,
    prompt_response_batch,
)
from reroll.errors import UserError
from reroll.models.loading import DTYPES, load_tokenizer
from reroll.models.vision import VisionProcessor
from reroll.pipelines.roles import Roles
from reroll.rewards import routing
from reroll.roles.objectives import NextToken
from reroll.roles.strategy_worker import mean_metrics
from reroll.runtime import checkpoint as checkpoints
from reroll.runtime import console

log = logging.getLogger(__name__)


def write_synthetic_data(cfg: RunConfig) -> None:
    """Write the synthetic task ``data.synthetic`` asks for, where its files do not exist yet."""
    syn = cfg.data.synthetic
    if syn is None:
        return
    # RunConfig.check guarantees these entries are paths when data.synthetic is set
    targets = [Path(str(cfg.data.train_files[0])), *(Path(str(f)) for f in cfg.data.eval_files[:1])]
    from reroll.data.arithmetic import write_arithmetic_dataset
    from reroll.data.shapes import write_shapes_dataset

    writer = write_shapes_dataset if syn.task == "shapes" else write_arithmetic_dataset
    write_synthetic_files(writer, syn, targets, "data")


def write_synthetic_files(
    writer: Callable[..., dict[str, Path]], syn: Any, targets: list[Path], what: str
) -> None:
    """``writer``'s train/test files for the synthetic section ``syn`` (n_train, n_test, max_operand,
    ops, seed) of config section ``what``, copied to ``targets`` (train, then test if any) where they
    do not all exist yet. Settings the task cannot meet (more rows than distinct problems) are a
    ``UserError`` naming the section."""
    if all(p.exists() for p in targets):
        return
    with tempfile.TemporaryDirectory() as tmp:
        try:
            made = writer(
                tmp,
                n_train=syn.n_train,
                n_test=syn.n_test,
                max_operand=syn.max_operand,
                ops=syn.ops,
                seed=syn.seed,
            )
        except ValueError as e:
            raise UserError(
                f"{what}.synthetic: {e} (set in {what}.synthetic.n_train / n_test / max_operand / ops)"
            ) from e
        for src, dst in zip([made["train"], made["test"]], targets):
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    log.info("wrote synthetic %s %s to %s", syn.task, what, ", ".join(map(str, targets)))


class Rows:
    """A pipeline's rows, set up one way for every pipeline that reads a ``data`` section: the synthetic
    task written where asked, the tokenizer, the prompt format (``data.chat_template``,
    ``data.system_prompt``), the training and held-out samples in it, and the rows whose targets are
    learned (``sft.files`` where set, else the training rows) with their template; ``warm_start`` runs
    the SFT warm start on them."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        data = cfg.data  # type: ignore[attr-defined]  # the pipelines that build Rows read a data section
        sft = cfg.sft  # type: ignore[attr-defined]  # and an sft section (the warm start)
        write_synthetic_data(cfg)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.format = prompt_format(cfg, self.tokenizer)
        self.train, self.held_out = load_data(cfg, self.format)
        self.target = sft.target_template if sft is not None else "{answer}"
        self.targets = self.train
        if sft is not None and sft.files and cfg.reads_targets:
            self.targets = load_samples(
                sft.files,
                template=data.prompt_template,
                render=self.format.prompt,
                required=[data.answer_field],
                image_field=data.image_field,
            )
        targets = self.targets if self.targets is not self.train else []
        self.vision = image_reader(cfg, self.tokenizer, [*self.train, *self.held_out, *targets])

    def target_batch(self, samples: Sequence[Sample]) -> TrainBatch:
        """Prompt + target rows of ``samples`` (``sft_batch``) in the run's prompt format, with their
        images."""
        return sft_batch(samples, self.format, self.target, self.vision)

    def with_images(self, batch: TrainBatch, samples: Sequence[Sample]) -> TrainBatch:
        """``batch`` (row i answering ``samples[i]``) with its rows' images (``with_images``)."""
        return with_images(batch, samples, self.vision, self.cfg.model.dtype)

    def target_sampler(self, batch_size: int, seed: int) -> PromptSampler:
        """Batches of the rows whose targets are learned, in ``data.shuffle``'s order."""
        return PromptSampler(self.targets, batch_size, seed=seed, shuffle=self.cfg.data.shuffle)  # type: ignore[attr-defined]

    def texts(self) -> Iterable[str]:
        """The text the model reads and writes, as written (not through the chat template, whose special
        tokens are not characters): prompts, the system prompt, and the targets it learns."""
        yield from (s.text for s in [*self.train, *self.held_out, *self.targets])
        system = self.cfg.data.system_prompt  # type: ignore[attr-defined]
        yield from [system] if system else []
        if self.cfg.reads_targets:
            yield from (self.target.format(**s.row) for s in self.targets)

    def answer_fit(self, samples: Sequence[Sample]) -> LengthFit | None:
        """How the right responses to ``samples`` (their targets, or answers) fit rollout.max_new_tokens;
        None when the rows have neither."""
        template = answer_template(self.cfg)
        texts = [t for s in samples if (t := reference_text(s.row, template)) is not None]
        if not texts:
            return None
        end = len(self.format.end_of_response) if self.cfg.reads_targets else 0
        return length_fit(self.tokenizer, texts, cap=self.cfg.rollout.max_new_tokens, end=end)

    def warm_start(self, roles: Roles) -> None:
        """The SFT warm start (``sft.steps``) on the target rows, if the run has one."""
        if not self.cfg.warm_start_steps:
            return
        rows = self.target_sampler(self.cfg.sft.batch_size, self.cfg.seed + 1)  # type: ignore[attr-defined]
        sft_warm_start(self.cfg, roles, lambda i: self.target_batch(rows.next_batch()), "the rows' targets")


class ImageRow(Protocol):
    """What ``image_reader`` reads of a row: a ``Sample``, or a ``PreferencePair`` (its prompt's images)."""

    @property
    def uid(self) -> str: ...

    @property
    def prompt(self) -> str: ...

    @property
    def images(self) -> tuple[bytes, ...]: ...


def image_reader(cfg: RunConfig, tokenizer: Any, samples: Sequence[ImageRow]) -> VisionProcessor | None:
    """The model's image processor where ``samples`` have images (None where none has), after the checks
    of a run with images (``image_problems``: the first is raised), each sample's image count against
    ``rollout.images.max_per_prompt`` and its prompt's placeholders (one per image)."""
    with_images = [s for s in samples if s.images]
    if not with_images:
        return None
    problems = image_problems(cfg, model_type(cfg.model.path))
    if problems:
        key, message = problems[0]
        raise UserError(f"{key}: {message}")
    most = cfg.rollout.images.max_per_prompt
    over = next((s for s in with_images if len(s.images) > most), None)
    if over is not None:
        raise UserError(
            f"row {over.uid!r} has {len(over.images)} images, more than rollout.images.max_per_prompt "
            f"({most}): raise it, or drop images from the row"
        )
    vision = VisionProcessor.for_rollout(cfg.model.path, tokenizer, cfg.rollout.images)
    bad = next((s for s in with_images if s.prompt.count(vision.placeholder) != len(s.images)), None)
    if bad is not None:
        raise UserError(
            f"row {bad.uid!r}: its prompt holds {bad.prompt.count(vision.placeholder)} image placeholders "
            f"({vision.placeholder!r}) for {len(bad.images)} images: the chat template must write one per "
            "image part of a message (a vision-language model's template does), and the prompt template "
            "must not write the placeholder itself"
        )
    log.info("%d of %d rows have images", len(with_images), len(samples))
    return vision


def with_images(
    batch: TrainBatch, samples: Sequence[Sample], vision: VisionProcessor | None, dtype: str
) -> TrainBatch:
    """``batch`` with ``pixel_values`` / ``image_grid_thw`` of each row's sample's images (row i answers
    ``samples[i]``), processed once per sample (a group's rows share them), in the model's ``dtype`` (the
    vision tower casts to it first): the same pixels the engine's processor made for its prompt. The
    batch itself where no sample has images."""
    if vision is None or not any(s.images for s in samples):
        return batch
    done: dict[int, ImageInputs | None] = {}
    rows = [done.setdefault(id(s), vision.images(s.images)) for s in samples]
    batch.pixel_values, batch.image_grid_thw = padded_images(rows, DTYPES[dtype])
    return batch


def prompt_format(cfg: RunConfig, tokenizer: Any) -> PromptFormat:
    """The run's ``PromptFormat``: ``data.chat_template`` and ``data.system_prompt`` over ``tokenizer``;
    one that cannot be built is a ``UserError`` naming the keys."""
    assert cfg.data is not None
    try:
        fmt = PromptFormat(
            tokenizer, chat_template=cfg.data.chat_template, system_prompt=cfg.data.system_prompt
        )
    except ChatTemplateError as e:
        raise UserError(f"{cfg.model.path}: {e}") from e
    log.info("prompts: %s", fmt.describe())
    return fmt


def load_data(cfg: RunConfig, fmt: PromptFormat | None = None) -> tuple[list[Sample], list[Sample]]:
    """Training and held-out samples in the run's prompt format (``None``: the template's text as it
    is), checked for the fields the template and reward need."""
    kw = {
        "template": cfg.data.prompt_template,
        "render": fmt.prompt if fmt is not None else None,
        "required": [] if cfg.reward_domains else [cfg.data.answer_field],
        "id_field": cfg.data.id_field,
        "image_field": cfg.data.image_field,
    }
    train = load_samples(cfg.data.train_files, **kw)
    held_out = (
        load_samples(cfg.data.eval_files, **kw, limit=cfg.data.eval_limit) if cfg.data.eval_files else []
    )
    if cfg.reward_domains:
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
    shares = {name: d.share for name, d in cfg.reward_domains.items()}
    if not shares or any(v is None for v in shares.values()):
        return PromptSampler(train, cfg.prompts_per_step, seed=cfg.seed, shuffle=cfg.data.shuffle)
    by_domain: dict[str, list[Sample]] = {name: [] for name in shares}
    for s in train:
        by_domain[routing.route(cfg.reward, s.domain)].append(s)
    return DomainSampler(by_domain, shares, cfg.prompts_per_step, seed=cfg.seed, shuffle=cfg.data.shuffle)


def _with_answer(sample: Sample, field_name: str) -> Sample:
    if field_name not in sample.row:  # a domain whose rewards read no answer (code tests, rules)
        return sample
    return replace(sample, row={**sample.row, "answer": sample.row[field_name]})


def sft_batch(
    samples: Sequence[Sample],
    fmt: PromptFormat | Any,
    target_template: str,
    vision: VisionProcessor | None = None,
) -> TrainBatch:
    """Prompt + target + end-of-response rows; the loss covers the target and its end only.

    The prompt is the sample's, as rollouts see it (chat template and system prompt included; with
    ``vision``, its image placeholders expanded and its images on the batch, as an engine reads it); the
    response ends with ``fmt.end_of_response`` (the template's end-of-turn token, or eos). A tokenizer
    in place of ``fmt`` means raw prompts (ending with eos)."""
    if not isinstance(fmt, PromptFormat):
        fmt = PromptFormat(fmt, chat_template=False)
    tokenizer = fmt.tokenizer
    rows, images = [], []
    for s in samples:
        if s.images and vision is not None:
            prompt, inputs = vision.encode(s.prompt, s.images)
        else:
            prompt, inputs = tokenizer.encode(s.prompt, add_special_tokens=False), None
        target = tokenizer.encode(target_template.format(**s.row), add_special_tokens=False)
        rows.append((prompt, [*target, *fmt.end_of_response]))
        images.append(inputs)
    batch = prompt_response_batch(rows, tokenizer.pad_token_id)
    if any(i is not None for i in images):
        batch.pixel_values, batch.image_grid_thw = padded_images(images)
    return batch


def sft_warm_start(cfg: RunConfig, roles: Roles, next_batch: Callable[[int], TrainBatch], what: str) -> None:
    """``cfg.sft.steps`` supervised steps through actor_train on ``next_batch(i)`` (``what`` says what
    the rows are), then a fresh optimizer for the loop. Nothing without a warm start."""
    steps = cfg.warm_start_steps
    if not steps:
        return
    sft = cfg.sft  # type: ignore[attr-defined]  # a pipeline with a warm start reads an sft section
    log.info("SFT warm start: %d steps on %s", steps, what)
    with roles.phase("warm_start", "actor_train"):
        roles.actor_train.configure_optimizer(sft.lr, sft.warmup_steps)
        bar = tqdm(range(steps), desc="sft", leave=False, disable=None)
        for i in bar:
            bar.set_postfix(
                loss=f"{roles.actor_train.train(next_batch(i), NextToken(), 'sft')['sft/loss']:.3f}"
            )
        roles.actor_train.configure_optimizer(cfg.optim.lr, cfg.optim.warmup_steps)


def policy_logprobs(roles: Roles, batch: TrainBatch, of: Literal["reference", "old"]) -> torch.Tensor:
    """``(B, T)`` log-probs of the batch's response tokens under a policy, in that pass's own phase: the
    reference (``reference``; a LoRA run's is actor_train's base model, adapters disabled) or actor_train
    before its update (``old``). The one forward-only pass of the trainers over a rollout batch."""
    actor = roles.actor_train
    assert actor is not None
    if of == "old":
        with roles.phase("old_logprobs", "actor_train"):
            return actor.compute_logprobs(batch)
    ref = roles.reference or actor
    with roles.phase("reference", ref.role):
        return ref.compute_logprobs(batch, base_model=roles.reference is None)


def sampling(cfg: RunConfig, *, n: int, seed: int | None = None, greedy: bool = False) -> SamplingParams:
    """The rollout section's sampling settings, ``n`` responses per prompt (greedy: temperature 0, for
    evaluation and baselines, which read no log-probs)."""
    r = cfg.rollout
    return SamplingParams(
        n=n,
        temperature=0.0 if greedy else r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop=tuple(r.stop),
        seed=seed,
        logprobs=cfg.engine_logprobs and not greedy,
    )


def step_seed(cfg: RunConfig, step: int) -> int:
    """The sampling seed of ``step``: runs with the same seed sample the same (and so does a resume)."""
    return cfg.seed * 1_000_003 + step


def evaluate(cfg: RunConfig, roles: Roles, samples: list[Sample]) -> dict[str, float]:
    """Greedy responses to the held-out prompts, scored by the reward: ``eval/accuracy`` and friends.

    Runs inside the skeleton's ``evaluate`` phase (actor_infer resident)."""
    if not samples:
        return {}
    assert roles.reward is not None
    groups = roles.actor_infer.generate(
        [s.engine_prompt for s in samples], sampling(cfg, n=1, greedy=True), "evaluate"
    )
    completions = [g[0] for g in groups]
    items = [RewardItem.answering(s, c) for s, c in zip(samples, completions)]
    results = roles.reward.score(items, phase="evaluate")
    n = len(samples)
    domains = [routing.route(cfg.reward, s.domain) for s in samples]
    per_domain = routing.domain_metrics(domains, results, prefix="eval", per_domain=bool(cfg.reward.domains))
    return {
        "eval/accuracy": sum(routing.is_correct(r) for r in results) / n,
        "eval/reward_mean": sum(r.score for r in results) / n,
        "eval/response_length": sum(len(c.response_ids) for c in completions) / n,
        "eval/truncated": sum(c.finish_reason == "length" for c in completions) / n,
        **per_domain,
    }


def sample_line(tokenizer: Any, completion: Completion, score: float) -> str:
    """A sample as the model saw it: prompt and response decoded from their token ids."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    return console.sample_line(decode(completion.prompt_ids), decode(completion.response_ids), score)


def train_mini_batches(
    cfg: RunConfig, batch: TrainBatch, step: int, update: Callable[[TrainBatch], dict[str, float]]
) -> dict[str, float]:
    """``ppo_epochs`` passes of ``mini_batches`` calls of ``update`` (one optimizer step each), metrics
    averaged, except the ``*/nonfinite_skipped`` counts, which are summed (and logged with the step and
    the batch's statistics when not zero).

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
    skipped = {k: sum(p.get(k, 0.0) for p in parts) for k in parts[0] if k.endswith("/nonfinite_skipped")}
    for key, count in skipped.items():
        if count:
            log.warning(
                "step %d: %d of %d optimizer steps skipped for a non-finite loss or gradient (%s); %s",
                step, count, len(parts), key, batch_stats(batch),
            )  # fmt: skip
    return mean_metrics(parts) | skipped


def batch_stats(batch: TrainBatch) -> str:
    """A line of what a training batch carries: rows, response tokens, rewards and advantages."""
    parts = [f"{len(batch)} rows", f"{int(batch.response_mask.sum())} response tokens"]
    for name in ("rewards", "advantages", "returns"):
        t = getattr(batch, name, None)
        if t is not None and t.numel():
            t = t[batch.response_mask].float() if t.dim() == 2 else t.float()  # per token: the response's
            finite = t[torch.isfinite(t)]
            top = f"{float(finite.abs().max()):.4g}" if finite.numel() else "none finite"
            bad = int((~torch.isfinite(t)).sum())
            parts.append(f"{name} mean {float(t.mean()):.4g}, max abs {top}, non-finite {bad}")
    return "; ".join(parts)


def with_checkpoint(cfg: RunConfig, checkpoint: Path | None) -> RunConfig:
    """``cfg`` with ``model.path`` at ``checkpoint``'s model (a checkpoint, or a run directory: its newest),
    as ``reroll generate`` and ``reroll serve`` take ``--checkpoint``; ``cfg`` itself without one."""
    if checkpoint is None:
        return cfg
    model = cfg.model.model_copy(update={"path": str(checkpoints.model_dir(checkpoint)), "build_tiny": None})
    return cfg.model_copy(update={"model": model})
