"""What a run with images asks of its model, engine and options: one list of problems, read by
``reroll validate`` (``preflight``, once it has seen image rows or pairs), the run (``image_reader``,
after loading its rows or pairs) and the start checks (``startable``: a vision-language model's own
limits, whatever the rows hold)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from reroll.config.data import DataConfig
from reroll.config.engines import engine_spec, engines_with

if TYPE_CHECKING:
    from reroll.config.schema import RunConfig

# Hugging Face model types whose processor makes image_grid_thw and whose forward takes it (the Qwen2-VL
# family: 3D rotary positions computed by the model from the image grids)
VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")

PACKING_REFUSED = (
    "a vision-language model's rows are not packed: each row's 3D rotary positions (Qwen2-VL's M-RoPE, "
    "computed by the model from its image grid) restart per row and are not carried into a packed "
    "sequence yet: set optim.packing=false (or leave it unset: auto is off for these models)"
)

CONTEXT_PARALLEL_REFUSED = (
    "a vision-language model's rows are not split by context parallelism yet (its 3D positions and image "
    "features would have to be split with them): set strategy.context_parallel=1"
)


def is_vision_model_type(model_type: str | None) -> bool | None:
    """Whether a model of ``model_type`` reads images; None where the type is not known."""
    return None if model_type is None else model_type in VISION_MODEL_TYPES


def vision_model_problems(cfg: RunConfig, model_type: str | None) -> list[tuple[str, str]]:
    """What a vision-language policy (``model_type``) cannot do that the config asks, rows aside."""
    if not is_vision_model_type(model_type):
        return []
    problems = [("optim.packing", PACKING_REFUSED)] if cfg.optim.packing else []
    if getattr(cfg.strategy, "context_parallel", 1) > 1:
        problems.append(("strategy.context_parallel", CONTEXT_PARALLEL_REFUSED))
    return problems


REWARD_HEAD_REFUSED = (
    "the rows have images, and pipeline reward_model trains a sequence-classification head, which "
    "transformers does not build on a vision-language model (no Qwen2-VL class for it): train the reward "
    "model on text pairs, or score image responses with a reward function"
)


def image_field(cfg: RunConfig) -> str | None:
    """The row field a run reads images from: ``data.image_field``, or where the run has no data section
    (pipeline reward_model, dpo without one) that field's default, so that pair rows holding images are
    never read as text alone."""
    data = cfg.section("data")
    return data.image_field if data is not None else DataConfig.model_fields["image_field"].default


def image_problems(cfg: RunConfig, model_type: str | None) -> list[tuple[str, str]]:
    """Why a run of ``cfg`` cannot take rows with images (the policy a ``model_type`` model, None where not
    known), as ``(dotted path, message)``. The engine is asked where the run starts one (actor_infer)."""
    problems = []
    if cfg.policy_head == "reward":
        problems.append(("pipeline", REWARD_HEAD_REFUSED))
    if is_vision_model_type(model_type) is False:
        problems.append(
            (
                "model.path",
                f"the rows have images (field {image_field(cfg)!r}) but model.path "
                f"{cfg.model.path!r} is a {model_type!r} model, which reads text only: use a vision-language "
                f"model ({', '.join(VISION_MODEL_TYPES)}), or set data.image_field=null to train on the text",
            )
        )
    spec = engine_spec(cfg.rollout.engine)
    if "actor_infer" in cfg.started_roles() and not spec.multimodal:
        problems.append(
            (
                "rollout.engine",
                f"the rows have images but the {spec.name} engine takes text prompts only: use one whose "
                f"spec is multimodal ({', '.join(engines_with('multimodal'))})",
            )
        )
    continued = {
        "rollout.partial_rollouts": cfg.rollout.partial_rollouts,
        "rollout.tail_threshold": cfg.rollout.tail_threshold,
    }
    for key, value in continued.items():
        if value:
            problems.append(
                (
                    key,
                    f"{value}, but responses to rows with images are not continued yet (a cut response resumes "
                    f"from its token ids, which do not carry the images): unset {key}",
                )
            )
    return problems
