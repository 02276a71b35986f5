"""The sections of the preference pipelines: ``preference`` (the pairs), ``reward_model`` (pipeline
reward_model) and ``dpo`` (pipeline dpo)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from reroll.config.base import StrictModel


class SyntheticPreferenceConfig(StrictModel):
    """Write synthetic arithmetic preferences (the correct answer preferred to a near miss) into
    preference.train_files[0] / eval_files[0] if they do not exist; the same seed and sizes as
    data.synthetic give the same train/held-out split of questions."""

    task: Literal["arithmetic"] = Field("arithmetic", description="Which synthetic task.")
    n_train: int = Field(5000, ge=1, description="Training pairs (one per question).")
    n_test: int = Field(500, ge=1, description="Held-out pairs (questions disjoint from training).")
    max_operand: int = Field(99, ge=1, description="Largest operand.")
    ops: str = Field("+", min_length=1, description="Operators to draw from, e.g. '+-'.")
    seed: int = Field(0, description="Seed of the generator.")
    negatives: int = Field(
        1,
        ge=1,
        description="Pairs per training question, each with a different near miss (held-out questions keep "
        "one: the same pairs for any value).",
    )


class PreferenceConfig(StrictModel):
    """Preference pairs: rows with 'prompt', 'chosen' and 'rejected' (strings or chat message lists)."""

    train_files: list[str] = Field(min_length=1, description="JSONL / JSON / Parquet files or datasets dirs.")
    eval_files: list[str] = Field(
        default_factory=list, description="Held-out pairs: pairwise accuracy and margins."
    )
    eval_limit: int | None = Field(None, ge=1, description="Evaluate on at most this many held-out pairs.")
    id_field: str = Field("id", description="The row field that identifies a pair (optional in rows).")
    batch_size: int = Field(
        64, ge=1, description="Pairs per optimizer step (optim.micro_batch_size counts pairs here too)."
    )
    shuffle: bool = Field(True, description="Reshuffle the pairs every epoch.")
    synthetic: SyntheticPreferenceConfig | None = Field(
        None,
        description="If set, generate arithmetic pairs into train_files[0] / eval_files[0] when missing.",
    )


class RewardModelConfig(StrictModel):
    """Reward-model training (pipeline reward_model): a scalar head on the last token, Bradley-Terry loss."""

    margin: float = Field(
        0.0,
        ge=0,
        description="The chosen reward must beat the rejected by this: -log sigmoid(r_c - r_r - m).",
    )
    center_coef: float = Field(
        0.0, ge=0, description="Centring regulariser: adds center_coef * (r_c + r_r)^2 per pair."
    )


class DPOConfig(StrictModel):
    """Direct preference optimisation and its family (pipeline dpo)."""

    loss: Literal["sigmoid", "ipo", "hinge", "robust", "simpo"] = Field(
        "sigmoid",
        description="'sigmoid' (DPO; with label_smoothing, conservative DPO), 'ipo', 'hinge' (SLiC), 'robust' "
        "(robust DPO), 'simpo' (reference-free, length-normalised). Formulas: docs/algorithms.md.",
    )
    beta: float = Field(
        0.1, gt=0, description="Inverse temperature of the implicit reward beta * log(pi/ref)."
    )
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="Share of pairs assumed flipped ('sigmoid' and 'robust' only)."
    )
    simpo_gamma: float = Field(0.5, ge=0, description="SimPO's target reward margin gamma ('simpo' only).")
    reference: Literal["cached", "on_the_fly"] = Field(
        "cached",
        description="'cached': the reference role scores every training pair once, before step 1 (saved in "
        "checkpoints); 'on_the_fly': each step's pairs, every step. Unused by 'simpo'.",
    )
    sft_weight: float = Field(
        0.0, ge=0, description="Adds sft_weight * the chosen responses' token-mean NLL (RPO-style anchor)."
    )


def check_dpo(dpo: DPOConfig) -> list[tuple[str, str]]:
    """``(dotted path, message)`` for every problem of the dpo section."""
    if dpo.label_smoothing and dpo.loss not in ("sigmoid", "robust"):
        return [
            (
                "dpo.label_smoothing",
                f"label_smoothing applies to 'sigmoid' and 'robust', not {dpo.loss!r}: set it to 0",
            )
        ]
    return []
