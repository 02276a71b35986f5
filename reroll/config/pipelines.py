"""Each pipeline's config model: ``RunConfig`` plus the sections that pipeline reads, its checks and the
values derived from them.

A section appears in the models of the pipelines that read it, and only there: ``data`` in rlvr, sft,
dpo and distill; ``algorithm`` in rlvr and agentic; ``sft`` as a warm start in rlvr, agentic, dpo and
distill (the whole run in sft); ``reward`` where held-out generations are scored. A key of another
pipeline is an error naming the pipelines that read it (``RunConfig.foreign_key``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from reroll.config.agentic import AgenticConfig
from reroll.config.algorithm import AlgorithmConfig, check_algorithm
from reroll.config.data import DataConfig, HubDatasetConfig
from reroll.config.loader import ConfigProblem
from reroll.config.preference import DPOConfig, PreferenceConfig, RewardModelConfig, check_dpo
from reroll.config.reward import RewardConfig, check_reward
from reroll.config.run import RunConfig, register_pipeline_config
from reroll.config.teacher import DistillConfig, check_distill
from reroll.config.training import CriticConfig, SFTConfig

_ALGORITHM_DOC = "The RL algorithm: advantages, policy loss, KL (presets in docs/algorithms.md)."
_WARM_START_DOC = "An SFT warm start before the loop (sft.steps supervised steps on the rows' targets)."
_REWARD_DOC = "Rewards that score responses (the held-out evaluation's, and in rlvr the training reward)."


def _required(cfg: RunConfig, section: str, what: str) -> list[ConfigProblem]:
    """A section the pipeline cannot run without (kept optional in the schema so the message says why)."""
    if getattr(cfg, section) is not None:
        return []
    return [ConfigProblem(section, f"pipeline {cfg.pipeline!r} needs a `{section}:` section ({what})")]


def _synthetic_targets(data: DataConfig | None) -> list[ConfigProblem]:
    """data.synthetic writes files: the entries it writes to must be paths, not datasets by name."""
    if data is None or data.synthetic is None:
        return []
    targets = [("data.train_files[0]", data.train_files[0])]
    targets += [("data.eval_files[0]", f) for f in data.eval_files[:1]]
    return [
        ConfigProblem(
            key,
            f"data.synthetic writes its rows to a file, but this entry is the dataset {src.label!r}: name "
            f"a .jsonl path here, or remove data.synthetic",
        )
        for key, src in targets
        if isinstance(src, HubDatasetConfig)
    ]


def _reward_problems(cfg: RunConfig) -> list[ConfigProblem]:
    """The reward section's problems; ``reward.model`` (RLHF) is rlvr's alone."""
    problems = [ConfigProblem(path, m) for path, m in check_reward(cfg.reward)]
    if cfg.reward.model is not None and not isinstance(cfg, RLVRConfig):
        problems.append(
            ConfigProblem("reward.model", f"is read by pipeline 'rlvr' only, not {cfg.pipeline!r}: remove it")
        )
    return problems


def _scoring(reward: RewardConfig) -> list[str]:
    """The roles that score generations: the reward workers, and the judge where ``reward.judge`` is set."""
    return ["reward", "judge"] if reward.judge is not None else ["reward"]


def _lora_reference(cfg: RunConfig, warm_start_steps: int) -> list[ConfigProblem]:
    """With LoRA the reference is actor_train's base model, which a warm start has moved away from."""
    if cfg.strategy.lora is None or not cfg.needs_reference or not warm_start_steps:
        return []
    return [
        ConfigProblem(
            "strategy.lora",
            "with LoRA the reference is the base model (adapters disabled), not the policy after the SFT "
            f"warm start (sft.steps={warm_start_steps}): run the SFT as its own run and point model.path at "
            "its checkpoint, or set algorithm.kl_coef=0 (pipeline dpo: dpo.loss=simpo)",
        )
    ]


class _RLConfig(RunConfig):
    """What the pipelines that learn from rewards of their own samples share (rlvr, agentic)."""

    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description=_ALGORITHM_DOC)
    sft: SFTConfig | None = Field(None, description=_WARM_START_DOC)
    trains_on_rollouts: ClassVar[bool] = True

    @property
    def needs_reference(self) -> bool:
        return self.algorithm.kl_coef > 0

    @property
    def warm_start_steps(self) -> int:
        return self.sft.steps if self.sft is not None else 0

    @property
    def dynamic_sampling(self) -> bool:
        return self.algorithm.dynamic_sampling

    def _algorithm_problems(self, *, has_critic: bool) -> list[ConfigProblem]:
        problems = [
            ConfigProblem("algorithm", m)
            for m in check_algorithm(
                self.algorithm,
                group_size=self.rollout.group_size,
                has_critic=has_critic,
                max_response_len=self.rollout.max_new_tokens,
            )
        ]
        if self.rollout.logprobs is False and self.algorithm.rollout_is != "none":
            problems.append(
                ConfigProblem(
                    "rollout.logprobs",
                    f"is false, but algorithm.rollout_is {self.algorithm.rollout_is!r} weighs each token by "
                    "the engine's log-prob: set rollout.logprobs to 'auto', or algorithm.rollout_is to 'none'",
                )
            )
        return problems


@register_pipeline_config
class RLVRConfig(_RLConfig):
    """Pipeline rlvr: RL with verifiable rewards (and RLHF, with ``reward.model``)."""

    pipeline: Literal["rlvr"] = Field("rlvr", description="RL with verifiable rewards.")
    data: DataConfig | None = Field(
        None, description="Prompts for rollouts, held-out prompts for evaluation."
    )
    reward: RewardConfig = Field(default_factory=RewardConfig, description=_REWARD_DOC)
    critic: CriticConfig | None = Field(
        None,
        description="A learned value function, needed by (and only by) adv_estimator 'gae', as in preset "
        "ppo; its betas, weight decay, grad clip and micro-batch size are optim's.",
    )
    bounded_rows: ClassVar[bool] = True

    @property
    def rollout_source(self) -> bool:
        return True

    def _roles(self) -> list[str]:
        roles = ["actor_train", "actor_infer", *_scoring(self.reward), *self._reference_role()]
        roles += ["critic"] if self.critic is not None else []
        return roles + (["learned_reward"] if self.reward.model is not None else [])

    def _scoring_roles(self) -> list[str]:
        return _scoring(self.reward)

    @model_validator(mode="before")
    @classmethod
    def _async_correction(cls, data: Any) -> Any:
        """Async rollouts are off-policy: importance-sampling correction on ('token') unless the user
        set algorithm.rollout_is (the resolved config shows the value)."""
        if not isinstance(data, dict) or not isinstance(data.get("rollout"), dict):
            return data
        algorithm = data.get("algorithm") or {}
        if (
            data["rollout"].get("async_steps")
            and isinstance(algorithm, dict)
            and "rollout_is" not in algorithm
        ):
            data = {**data, "algorithm": {**algorithm, "rollout_is": "token"}}
        return data

    @property
    def engine_logprobs(self) -> bool:
        if self.rollout.logprobs != "auto":
            return self.rollout.logprobs
        return self.algorithm.rollout_is != "none"

    @property
    def critic_model_path(self) -> str:
        """Where the critic starts from: ``critic.model_path``, else the policy's ``model.path``."""
        return (self.critic and self.critic.model_path) or self.model.path

    def _pipeline_model_paths(self) -> dict[tuple[str, ...], str]:
        paths = {}
        if self.critic is not None and self.critic.model_path is not None:
            paths["critic", "model_path"] = self.critic.model_path
        if self.reward.judge is not None:
            paths["reward", "judge", "model_path"] = self.reward.judge.model_path
        return paths

    @property
    def reward_domains(self) -> dict[str, Any]:
        return self.reward.domains

    def _pipeline_problems(self) -> list[ConfigProblem]:
        problems = _required(self, "data", "train_files")
        problems += self._algorithm_problems(has_critic=self.critic is not None)
        if self.algorithm.adv_estimator in ("step_return", "gigpo"):
            problems.append(
                ConfigProblem(
                    "algorithm.adv_estimator",
                    f"{self.algorithm.adv_estimator!r} needs per-turn rewards from multi-turn episodes, which "
                    f"only pipeline 'agentic' produces: use 'grpo', 'rloo' or 'reinforce_pp'",
                )
            )
        problems += _reward_problems(self)
        problems += _synthetic_targets(self.data)
        return problems + _lora_reference(self, self.warm_start_steps)


@register_pipeline_config
class SFTRunConfig(RunConfig):
    """Pipeline sft: supervised fine-tuning for ``sft.steps`` steps."""

    pipeline: Literal["sft"] = Field("sft", description="Supervised fine-tuning.")
    data: DataConfig | None = Field(
        None, description="Rows to learn from (and held-out rows to evaluate on)."
    )
    sft: SFTConfig | None = Field(None, description="The SFT run: steps, batch size, learning rate, targets.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description=_REWARD_DOC)

    @property
    def reads_targets(self) -> bool:
        return self.sft is not None

    def _roles(self) -> list[str]:
        held_out = self.data is not None and bool(self.data.eval_files)  # generated and scored
        return ["actor_train", *(["actor_infer", *_scoring(self.reward)] if held_out else [])]

    def _scoring_roles(self) -> list[str]:
        return _scoring(self.reward)

    @property
    def reward_domains(self) -> dict[str, Any]:
        return self.reward.domains

    def _pipeline_problems(self) -> list[ConfigProblem]:
        problems = _required(self, "data", "train_files") + _required(self, "sft", "steps, batch_size, lr")
        if "total_steps" in self.changed_fields():
            problems.append(
                ConfigProblem("total_steps", "pipeline 'sft' runs sft.steps steps: set sft.steps instead")
            )
        problems += _reward_problems(self)
        return problems + _synthetic_targets(self.data)


@register_pipeline_config
class AgenticRunConfig(_RLConfig):
    """Pipeline agentic: multi-turn episodes against an environment."""

    pipeline: Literal["agentic"] = Field("agentic", description="Multi-turn RL in environments.")
    agentic: AgenticConfig | None = Field(None, description="Environment episodes.")
    no_rollout_source: ClassVar[str] = "its episodes play turn by turn against the environments"

    def _roles(self) -> list[str]:
        return ["actor_train", "actor_infer", "env", *self._reference_role()]

    def _pipeline_problems(self) -> list[ConfigProblem]:
        problems = _required(self, "agentic", "the environment, env")
        problems += self._algorithm_problems(has_critic=False)
        kl_reward = self.algorithm.kl_in == "reward" and self.algorithm.kl_coef > 0
        if self.rollout.logprobs is False and kl_reward:
            problems.append(
                ConfigProblem(
                    "rollout.logprobs",
                    "is false, but the agentic pipeline's KL penalty in the reward (algorithm.kl_in 'reward') "
                    "reads the engine's log-probs: set rollout.logprobs to 'auto', or algorithm.kl_in to 'loss'",
                )
            )
        return problems + self._agent_problems() + _lora_reference(self, self.warm_start_steps)

    def _agent_problems(self) -> list[ConfigProblem]:
        a, problems = self.agentic, []
        if a is None:
            return []
        if not a.env.startswith("agent:"):
            if a.tasks or a.eval_tasks:
                problems.append(
                    ConfigProblem(
                        "agentic.tasks", "tasks are read by 'agent:' environments only: remove them"
                    )
                )
            return problems
        if a.system_prompt:
            problems.append(
                ConfigProblem(
                    "agentic.system_prompt",
                    "an 'agent:' environment writes its own messages: put the system prompt in the agent",
                )
            )
        if self.warm_start_steps:
            problems.append(
                ConfigProblem(
                    "sft",
                    "an 'agent:' environment has no scripted policy for an SFT warm start: remove `sft:` "
                    "and start from a model that can already follow the agent's prompts",
                )
            )
        if a.streaming:
            problems.append(
                ConfigProblem(
                    "agentic.streaming",
                    "'agent:' episodes always advance independently (each agent calls the endpoint when "
                    "it is ready): remove agentic.streaming",
                )
            )
        return problems


@register_pipeline_config
class RewardModelRunConfig(RunConfig):
    """Pipeline reward_model: a reward model trained on preference pairs."""

    pipeline: Literal["reward_model"] = Field("reward_model", description="Reward-model training.")
    preference: PreferenceConfig | None = Field(None, description="Preference pairs.")
    reward_model: RewardModelConfig = Field(
        default_factory=RewardModelConfig, description="Reward-model training settings."
    )

    @property
    def policy_head(self) -> Literal["causal_lm", "reward"]:
        return "reward"

    def _roles(self) -> list[str]:
        return ["actor_train"]

    def _pipeline_problems(self) -> list[ConfigProblem]:
        return _required(self, "preference", "train_files of pairs")


@register_pipeline_config
class DPORunConfig(RunConfig):
    """Pipeline dpo: DPO and its family on preference pairs."""

    pipeline: Literal["dpo"] = Field("dpo", description="Direct preference optimisation.")
    preference: PreferenceConfig | None = Field(None, description="Preference pairs.")
    dpo: DPOConfig = Field(default_factory=DPOConfig, description="DPO-family settings.")
    data: DataConfig | None = Field(
        None, description="Rows of the SFT warm start and the held-out generations (optional)."
    )
    sft: SFTConfig | None = Field(None, description=_WARM_START_DOC + " Learns from data.train_files.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description=_REWARD_DOC)

    @property
    def needs_reference(self) -> bool:
        return self.dpo.loss != "simpo"

    def _roles(self) -> list[str]:
        held_out = self.data is not None and bool(self.data.eval_files)  # generated and scored
        roles = ["actor_train", *(["actor_infer", *_scoring(self.reward)] if held_out else [])]
        return roles + self._reference_role()

    def _scoring_roles(self) -> list[str]:
        return _scoring(self.reward)

    @property
    def warm_start_steps(self) -> int:
        return self.sft.steps if self.sft is not None else 0

    @property
    def reward_domains(self) -> dict[str, Any]:
        return self.reward.domains

    def _pipeline_problems(self) -> list[ConfigProblem]:
        problems = _required(self, "preference", "train_files of pairs")
        if self.warm_start_steps and self.data is None:
            problems.append(
                ConfigProblem(
                    "data",
                    f"the SFT warm start (sft.steps={self.warm_start_steps}) learns from data.train_files: "
                    "add a `data:` section, or set sft.steps=0",
                )
            )
        problems += [ConfigProblem(path, m) for path, m in check_dpo(self.dpo)]
        if self.data is not None:
            problems += _reward_problems(self)
        problems += _synthetic_targets(self.data)
        return problems + _lora_reference(self, self.warm_start_steps)


@register_pipeline_config
class DistillRunConfig(RunConfig):
    """Pipeline distill: a student learns from frozen teachers, on its own samples or offline."""

    pipeline: Literal["distill"] = Field("distill", description="Distillation from teachers.")
    data: DataConfig | None = Field(None, description="Prompts (on-policy), rows (offline), held-out rows.")
    distill: DistillConfig | None = Field(
        None, description="Teachers and loss (on-policy or offline distillation)."
    )
    sft: SFTConfig | None = Field(None, description=_WARM_START_DOC)
    reward: RewardConfig = Field(default_factory=RewardConfig, description=_REWARD_DOC)
    trains_on_rollouts: ClassVar[bool] = True
    bounded_rows: ClassVar[bool] = True

    @property
    def warm_start_steps(self) -> int:
        return self.sft.steps if self.sft is not None else 0

    @property
    def on_policy(self) -> bool:
        return self.distill is not None and self.distill.mode == "on_policy"

    @property
    def reads_targets(self) -> bool:
        return self.warm_start_steps > 0 or not self.on_policy  # offline: the teachers score the targets

    @property
    def rollout_source(self) -> bool:
        return self.on_policy  # offline distillation generates only for the held-out evaluation

    def started_roles(self, *, generate_only: bool = False) -> dict[str, int]:
        roles = super().started_roles(generate_only=generate_only)
        if "teacher" in roles and self.distill is not None:  # a group of roles.teacher's ranks per teacher
            roles["teacher"] = len(self.distill.teachers)
        return roles

    def _roles(self) -> list[str]:
        held_out = self.data is not None and bool(self.data.eval_files)  # generated and scored
        generates = self.on_policy or held_out
        return [
            "actor_train",
            *(["actor_infer"] if generates else []),
            *(_scoring(self.reward) if held_out else []),
            "teacher",
        ]

    def _scoring_roles(self) -> list[str]:
        return _scoring(self.reward)

    def _pipeline_model_paths(self) -> dict[tuple[str, ...], str]:
        if self.distill is None:
            return {}
        return {
            ("distill", "teachers", name, "model_path"): t.model_path
            for name, t in self.distill.teachers.items()
        }

    @property
    def reward_domains(self) -> dict[str, Any]:
        return self.reward.domains

    def _pipeline_problems(self) -> list[ConfigProblem]:
        problems = _required(self, "data", "train_files")
        problems += _required(self, "distill", "teachers: {name: {model_path}}")
        if self.distill is not None:
            problems += [ConfigProblem(path, m) for path, m in check_distill(self.distill)]
        if self.on_policy and self.rollout.temperature != 1.0:
            problems.append(
                ConfigProblem(
                    "rollout.temperature",
                    f"on-policy distillation estimates the reverse KL on the student's own samples, which "
                    f"must come from the distribution it trains (temperature 1), not "
                    f"{self.rollout.temperature:g}: set rollout.temperature: 1.0",
                )
            )
        problems += _reward_problems(self)
        return problems + _synthetic_targets(self.data)
