"""The ``algorithm`` config section: advantage estimator, policy loss, KL, aggregation, shaping, filters.

A ``preset`` names a published recipe and expands, at load, into explicit values of the
other fields: the resolved config shows them, and any field the user set keeps the user's
value (``{preset: dapo, clip_high: 0.3}`` trains with clip_high 0.3). ``check_algorithm``
reports the combinations that cannot work together with the rest of the run config.

This module imports no torch: the names below are the registry's names (``reroll.algorithms
.registry``), and a unit test keeps the two lists equal.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from reroll.config.base import StrictModel

AdvEstimatorName = Literal[
    "gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "raft", "step_return", "gigpo"
]
PolicyLossName = Literal["ppo_clip", "gspo", "cispo", "topr", "pg"]
LossAggModeName = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
KLEstimatorName = Literal["k1", "k2", "k3", "abs"]
RewardNormName = Literal["none", "group", "batch", "running"]
PresetName = Literal["grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "lite_ppo", "raft_pp", "ppo"]

# Estimators that compare the samples of one prompt with each other, and so need group_size >= 2.
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline", "gigpo")

# Each preset spells out every field that defines the recipe, so that the table in
# docs/algorithms.md is the whole story; fields left out keep their defaults.
PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeekMath (arXiv 2402.03300): group-normalised outcome reward, k3 KL in the loss, sequence mean.
    "grpo": dict(
        adv_estimator="grpo", std_scale="group", policy_loss="ppo_clip", clip_low=0.2, clip_high=0.2,
        loss_agg_mode="seq-mean-token-mean", kl_coef=0.04, kl_estimator="k3", kl_in="loss",
    ),
    # Dr. GRPO (arXiv 2503.20783): no std division, no length normalisation per sequence, no KL.
    "dr_grpo": dict(
        adv_estimator="grpo", std_scale="none", policy_loss="ppo_clip", clip_low=0.2, clip_high=0.2,
        loss_agg_mode="seq-mean-token-sum-norm", kl_coef=0.0,
    ),
    # DAPO (arXiv 2503.14476): clip-higher, token-mean, dynamic sampling, soft overlong punishment, no KL.
    "dapo": dict(
        adv_estimator="grpo", std_scale="group", policy_loss="ppo_clip", clip_low=0.2, clip_high=0.28,
        loss_agg_mode="token-mean", kl_coef=0.0, dynamic_sampling=True, overlong_shaping=True,
        overlong_buffer_len=4096, overlong_penalty=1.0,
    ),
    # GSPO (arXiv 2507.18071): sequence-level ratio with its tiny clip range, sequence mean, no KL.
    "gspo": dict(
        adv_estimator="grpo", std_scale="group", policy_loss="gspo", clip_low=3e-4, clip_high=4e-4,
        loss_agg_mode="seq-mean-token-mean", kl_coef=0.0,
    ),
    # RLOO (arXiv 2402.14740; TRL RLOOTrainer): leave-one-out baseline, k1 KL penalty in the reward.
    "rloo": dict(
        adv_estimator="rloo", policy_loss="ppo_clip", clip_low=0.2, clip_high=0.2,
        loss_agg_mode="token-mean", kl_coef=0.05, kl_estimator="k1", kl_in="reward",
    ),
    # REINFORCE++ (arXiv 2501.03262): token KL in the reward, gamma 1, global advantage whitening.
    "reinforce_pp": dict(
        adv_estimator="reinforce_pp", gamma=1.0, policy_loss="ppo_clip", clip_low=0.2, clip_high=0.2,
        loss_agg_mode="token-mean", kl_coef=0.01, kl_estimator="k1", kl_in="reward",
    ),
    # Lite PPO (arXiv 2508.08221): group-mean / batch-std advantage, token-level loss, no critic, no KL.
    "lite_ppo": dict(
        adv_estimator="grpo", std_scale="batch", policy_loss="ppo_clip", clip_low=0.2, clip_high=0.2,
        loss_agg_mode="token-mean", kl_coef=0.0,
    ),
    # RAFT++ (arXiv 2504.11343): clipped importance-sampled SFT on the positive samples only.
    "raft_pp": dict(
        adv_estimator="raft", positive_only=True, policy_loss="ppo_clip", clip_low=0.2, clip_high=0.2,
        loss_agg_mode="token-mean", kl_coef=0.0,
    ),
    # PPO with a critic (arXiv 1707.06347; InstructGPT): GAE, whitened advantages, k1 KL in the reward.
    "ppo": dict(
        adv_estimator="gae", gamma=1.0, lam=0.95, whiten_advantages=True, policy_loss="ppo_clip",
        clip_low=0.2, clip_high=0.2, loss_agg_mode="token-mean", kl_coef=0.001, kl_estimator="k1",
        kl_in="reward",
    ),
}  # fmt: skip


class AlgorithmConfig(StrictModel):
    """How advantages are estimated and the actor's loss is formed. See docs/algorithms.md."""

    preset: PresetName | None = Field(
        None, description="A named recipe that fills in the fields below at load; fields you set keep yours."
    )

    # advantages
    adv_estimator: AdvEstimatorName = Field("grpo", description="Advantage estimator.")
    std_scale: Literal["group", "batch", "none"] = Field(
        "group",
        description="GRPO: divide the centred reward by the group's std, the batch's std, or nothing.",
    )
    adv_eps: float = Field(1e-6, gt=0, description="Added to the std before dividing by it.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount per token (GAE, REINFORCE++) or per turn.")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
    gigpo_step_weight: float = Field(
        1.0, ge=0, description="GiGPO: weight of the step (anchor-state) advantage added to the episode's."
    )
    whiten_advantages: bool = Field(
        False, description="Whiten advantages over the batch's response tokens (mean 0, std 1)."
    )
    adv_clip: float | None = Field(
        None, gt=0, description="Clamp advantages to [-adv_clip, adv_clip]; None: off."
    )

    # policy loss
    policy_loss: PolicyLossName = Field("ppo_clip", description="Per-token policy loss.")
    clip_low: float = Field(0.2, ge=0, lt=1, description="Ratio clip below: 1 - clip_low.")
    clip_high: float = Field(
        0.2, ge=0, description="Ratio clip above: 1 + clip_high (DAPO clip-higher: 0.28)."
    )
    dual_clip: float | None = Field(
        None, gt=1, description="Dual-clip PPO's c: negative-advantage loss bounded by -c*A; None: off."
    )
    topr_level: Literal["token", "sequence"] = Field(
        "token", description="TOPR: truncate the per-token ratio or the whole sequence's ratio."
    )
    loss_agg_mode: LossAggModeName = Field(
        "token-mean", description="How per-token losses become one scalar."
    )
    loss_norm_len: int | None = Field(
        None, ge=1, description="seq-mean-token-sum-norm's constant length; None: the max response length."
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient (loss -= coef * entropy).")
    sft_coef: float = Field(0.0, ge=0, description="Coefficient of an NLL term on the SFT-marked tokens.")

    # KL to the reference policy
    kl_coef: float = Field(0.0, ge=0, description="KL coefficient beta; 0 turns the KL off.")
    kl_estimator: KLEstimatorName = Field("k3", description="KL estimator (Schulman's k1, k2, k3, or abs).")
    kl_in: Literal["loss", "reward"] = Field(
        "loss", description="Apply the KL as a loss term, or as a per-token penalty on the reward."
    )
    kl_controller: Literal["fixed", "adaptive"] = Field(
        "fixed", description="KL in the reward: fixed beta, or adapted towards kl_target (Ziegler et al.)."
    )
    kl_target: float = Field(0.1, gt=0, description="Adaptive controller: target per-token KL.")
    kl_horizon: int = Field(10000, ge=1, description="Adaptive controller: horizon in samples.")

    # reward shaping
    reward_norm: RewardNormName = Field(
        "none", description="Normalise rewards before the estimator: by group, batch, running stats, or not."
    )
    reward_clip: float | None = Field(
        None, gt=0, description="Clamp rewards to [-reward_clip, reward_clip] after normalisation; None: off."
    )
    length_penalty: float = Field(
        0.0,
        ge=0,
        description="Subtract length_penalty x response tokens from each reward, after normalisation and "
        "clipping: a check on a learned reward model that favours longer answers (reward hacking); logged "
        "as reward/length_penalty_mean.",
    )
    overlong_shaping: bool = Field(False, description="Add DAPO's soft overlong penalty to the reward.")
    overlong_buffer_len: int = Field(
        4096, ge=1, description="DAPO L_cache: length of the penalty ramp, tokens."
    )
    overlong_penalty: float = Field(
        1.0, ge=0, description="Scale of the overlong penalty (-1 at the max length)."
    )

    # filters
    overlong_filter: bool = Field(False, description="Drop truncated responses from the loss (DAPO).")
    dynamic_sampling: bool = Field(
        False,
        description="Drop groups whose rewards are all equal (DAPO); the rlvr pipeline refills the batch "
        "with extra generation rounds (dynamic_sampling_max_rounds).",
    )
    dynamic_sampling_max_rounds: int = Field(
        3,
        ge=0,
        description="dynamic_sampling: extra generation rounds per step (new prompts each) to refill the "
        "batch to rollout.batch_size with groups that have a reward spread; past them the step trains on "
        "the groups it has (dapo/missing_groups). 0: no refill.",
    )
    correct_threshold: float = Field(
        0.5, description="A reward above this counts as correct (RAFT++ mask, difficulty mask)."
    )
    positive_only: bool = Field(False, description="Train on correct samples only (RAFT++).")
    difficulty_min: float = Field(0.0, ge=0, le=1, description="Drop prompts whose pass rate is below this.")
    difficulty_max: float = Field(1.0, ge=0, le=1, description="Drop prompts whose pass rate is above this.")

    # train/inference mismatch
    rollout_is: Literal["none", "token", "sequence"] = Field(
        "none", description="Importance-weight pi_old / pi_rollout per token or per sequence; none: off."
    )
    rollout_is_mode: Literal["truncate", "mask"] = Field(
        "truncate", description="truncate: min(w, max) (TIS); mask: zero the weights outside [min, max]."
    )
    rollout_is_max: float = Field(2.0, ge=1, description="Upper bound of the rollout importance weight.")
    rollout_is_min: float = Field(0.0, ge=0, le=1, description="mask mode: lower bound of the weight.")

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        """Fill in the preset's values under the keys the user did not give."""
        if isinstance(data, dict) and data.get("preset") in PRESETS:
            return {**PRESETS[data["preset"]], **data}
        return data

    @model_validator(mode="after")
    def _check_section(self) -> AlgorithmConfig:
        problems = section_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def needs_greedy_baseline(self) -> bool:
        """Whether the estimator's baseline is the reward of each prompt's greedy response (ReMax)."""
        return self.adv_estimator == "remax"


def section_problems(cfg: AlgorithmConfig) -> list[str]:
    """Contradictions inside the algorithm section alone."""
    problems = []
    if cfg.difficulty_min > cfg.difficulty_max:
        problems.append(
            f"algorithm.difficulty_min ({cfg.difficulty_min}) is above algorithm.difficulty_max "
            f"({cfg.difficulty_max}): every prompt would be dropped; set difficulty_min <= difficulty_max"
        )
    if cfg.kl_controller == "adaptive" and cfg.kl_in != "reward":
        problems.append(
            "algorithm.kl_controller 'adaptive' adapts the KL penalty in the reward, but algorithm.kl_in is "
            "'loss': set kl_in to 'reward', or kl_controller to 'fixed'"
        )
    if cfg.kl_controller == "adaptive" and cfg.kl_coef == 0:
        problems.append(
            "algorithm.kl_controller 'adaptive' multiplies algorithm.kl_coef, which is 0.0, so it stays 0: "
            "set kl_coef to a starting value such as 0.05"
        )
    if cfg.rollout_is_mode == "mask" and cfg.rollout_is_min >= cfg.rollout_is_max:
        problems.append(
            f"algorithm.rollout_is_min ({cfg.rollout_is_min}) must be below algorithm.rollout_is_max "
            f"({cfg.rollout_is_max}) in mask mode, or every token is masked"
        )
    if cfg.positive_only and cfg.adv_estimator in ("gae", "reinforce_pp", "step_return"):
        problems.append(
            f"algorithm.positive_only drops every incorrect sample, but adv_estimator {cfg.adv_estimator!r} "
            "whitens over the batch, so the kept samples get negative advantages too: use adv_estimator "
            "'raft' (RAFT++) or 'grpo'"
        )
    problems.extend(_ignored_fields(cfg))
    return problems


# field -> (the setting that reads it, the values of that setting that do)
_READ_BY = {
    "std_scale": ("adv_estimator", ("grpo", "gigpo")),
    "lam": ("adv_estimator", ("gae",)),
    "gigpo_step_weight": ("adv_estimator", ("gigpo",)),
    "dual_clip": ("policy_loss", ("ppo_clip",)),
    "topr_level": ("policy_loss", ("topr",)),
    "dynamic_sampling_max_rounds": ("dynamic_sampling", (True,)),
}


def user_set_fields(cfg: AlgorithmConfig) -> set[str]:
    """The fields given a value other than the preset's, or the default where the preset has none (a
    value equal to those is indistinguishable from not setting it: a run's own config.yaml, which
    writes every field, loads back)."""
    preset = PRESETS.get(cfg.preset or "", {})
    fields = type(cfg).model_fields

    def unchanged(f: str) -> bool:
        return getattr(cfg, f) == (
            preset[f] if f in preset else fields[f].get_default(call_default_factory=True)
        )

    return {f for f in cfg.model_fields_set if not unchanged(f)}


def _ignored_fields(cfg: AlgorithmConfig) -> list[str]:
    """Fields the user set that the chosen algorithm never reads: an error, not a silent no-op."""
    problems = []
    user_set = user_set_fields(cfg)
    for field, (setting, readers) in _READ_BY.items():
        value = getattr(cfg, setting)
        if field in user_set and value not in readers:
            problems.append(
                f"algorithm.{field} is set, but algorithm.{setting} {value!r} does not use it (only "
                f"{' / '.join(repr(r) for r in readers)} does): remove algorithm.{field}, or change {setting}"
            )
    return problems


def check_algorithm(
    cfg: AlgorithmConfig, *, group_size: int, has_critic: bool, max_response_len: int | None = None
) -> list[str]:
    """The reasons ``cfg`` cannot run with the rest of the run config; an empty list means it can.

    ``group_size`` is rollout.group_size (samples per prompt), ``has_critic`` whether a critic
    is configured, ``max_response_len`` rollout's limit on generated tokens (checked when given).
    """
    problems = section_problems(cfg)
    if cfg.adv_estimator == "gae" and not has_critic:
        problems.append(
            "algorithm.adv_estimator 'gae' needs a critic's values, but no critic is configured: add a "
            "critic section, or use a critic-free adv_estimator such as 'grpo' or 'reinforce_pp'"
        )
    if has_critic and cfg.adv_estimator != "gae":
        problems.append(
            f"a critic is configured but algorithm.adv_estimator {cfg.adv_estimator!r} does not use its "
            "values: remove the critic section, or use adv_estimator 'gae'"
        )
    if group_size < 2:
        problems.extend(_group_size_problems(cfg, group_size))
    if cfg.overlong_shaping and max_response_len is not None and cfg.overlong_buffer_len > max_response_len:
        problems.append(
            f"algorithm.overlong_buffer_len ({cfg.overlong_buffer_len}) is longer than rollout.max_new_tokens "
            f"({max_response_len}): set overlong_buffer_len to at most {max_response_len}, "
            f"e.g. {max(1, max_response_len // 5)}"
        )
    return problems


def _group_size_problems(cfg: AlgorithmConfig, group_size: int) -> list[str]:
    problems = []
    if cfg.adv_estimator in GROUP_ESTIMATORS:
        problems.append(
            f"algorithm.adv_estimator {cfg.adv_estimator!r} needs several samples per prompt, but "
            f"rollout.group_size is {group_size}: set rollout.group_size to 2 or more, or use "
            "adv_estimator 'reinforce_pp'"
        )
    needs_groups = {
        "dynamic_sampling": cfg.dynamic_sampling,
        "reward_norm 'group'": cfg.reward_norm == "group",
        "difficulty_min/difficulty_max": cfg.difficulty_min > 0 or cfg.difficulty_max < 1,
    }
    for what, on in needs_groups.items():
        if on:
            problems.append(
                f"algorithm.{what} compares the samples of one prompt, but rollout.group_size is "
                f"{group_size}: set rollout.group_size to 2 or more, or turn it off"
            )
    return problems
