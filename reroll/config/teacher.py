"""The distill section: teachers served as the ``teacher`` role, and how rows are routed to them.

Distillation (``pipeline: distill``) from one teacher, or several routed by the row's ``domain`` the
way reward domains are (``reroll.rewards.routing``)::

    distill:
      mode: on_policy            # the student samples, the teacher scores its tokens (reverse KL)
      teachers:
        math: {model_path: runs/teacher-math/checkpoints/step_000400/model, tags: [math, gsm8k]}
        code: {model_path: runs/teacher-code/checkpoints/step_000400/model}
      default_teacher: math      # rows whose tag no teacher lists
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from reroll.config.base import StrictModel
from reroll.config.tags import route_tag, tag_owners, tag_problems


class TeacherConfig(StrictModel):
    """One teacher model and the row tags it teaches."""

    model_path: str = Field(
        description="Hub id or local directory of the teacher (a causal LM with the student's tokenizer)."
    )
    tags: list[str] = Field(
        default_factory=list,
        description="Row `domain` values this teacher teaches (default: the teacher's own name). With a "
        "single teacher every row goes to it.",
    )


class DistillConfig(StrictModel):
    """Distillation (pipeline 'distill'): teachers served as the ``teacher`` role, placed by roles.teacher."""

    mode: Literal["on_policy", "offline"] = Field(
        "on_policy",
        description="'on_policy': the student samples rollout.batch_size responses per step (actor_infer) and "
        "the teacher scores every response token; the loss is the per-token reverse KL. 'offline': the "
        "teacher's top-k next-token log-probs over the SFT rows (sft.files or data.train_files, target "
        "sft.target_template) are computed once and cached in the run directory; the loss is the forward "
        "KL, mixed with the cross-entropy by ce_weight.",
    )
    teachers: dict[str, TeacherConfig] = Field(
        min_length=1, description="Teachers by name; rows are routed to them by their `domain` tag."
    )
    default_teacher: str | None = Field(
        None, description="Teacher of rows whose tag no teacher lists (None: such a row is an error)."
    )
    on_policy_loss: Literal["sampled", "topk"] = Field(
        "sampled",
        description="on_policy: 'sampled', the reverse KL estimated on the sampled token alone (a per-token "
        "policy gradient; the teacher sends one log-prob per token); 'topk', the exact reverse KL over the "
        "student's whole next-token distribution at each sampled prefix, the teacher known on its top_k "
        "tokens (GKD; lower variance, learns faster; the student's (tokens x vocabulary) log-softmax in fp32).",
    )
    top_k: int = Field(
        32,
        ge=1,
        description="Teacher log-probs kept per position (offline, and on_policy_loss 'topk'); the rest of "
        "its mass is dropped (offline) or spread evenly over the other tokens (topk).",
    )
    ce_weight: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="offline: loss = (1 - ce_weight) * forward KL + ce_weight * cross-entropy on the row's "
        "own target tokens.",
    )
    batch_size: int = Field(64, ge=1, description="offline: SFT rows per optimizer step.")


def teacher_for(cfg: DistillConfig, tag: str) -> str:
    """The teacher a row tagged ``tag`` is routed to (one teacher takes every row)."""
    if len(cfg.teachers) == 1:
        return next(iter(cfg.teachers))
    tags = {name: t.tags for name, t in cfg.teachers.items()}
    owner = route_tag(tags, tag, cfg.default_teacher)
    if owner is not None:
        return owner
    known = tag_owners(tags)
    raise ValueError(
        f"a row is tagged domain {tag!r}, which no teacher lists (tags: {known}): add it to a teacher's "
        f"tags, or set distill.default_teacher"
    )


def check_distill(cfg: DistillConfig) -> list[tuple[str, str]]:
    """``(dotted path, reason)`` for each problem of the distill section."""
    problems = []
    if cfg.mode == "on_policy":
        offline_only = {"ce_weight", "batch_size"} | ({"top_k"} if cfg.on_policy_loss == "sampled" else set())
        offline_only = sorted(cfg.changed_fields() & offline_only)  # a resolved config writes them all
        problems += [
            (f"distill.{key}", "is not used by mode 'on_policy' with this on_policy_loss: remove it")
            for key in offline_only
        ]
    if cfg.mode == "offline" and "on_policy_loss" in cfg.changed_fields():
        problems.append(("distill.on_policy_loss", "is used by mode 'on_policy' only: remove it"))
    tags = {name: t.tags for name, t in cfg.teachers.items()}
    return problems + tag_problems(tags, cfg.default_teacher, "distill.teachers", "distill.default_teacher")
