"""The run config: ``RunConfig`` (``reroll.config.run``), validated into its pipeline's model
(``reroll.config.pipelines``), with one typed section per concern (``reroll.config.model``, ``data``,
``rollout``, ``training``, ``runtime``, ``roles``, ``algorithm``, ``reward``, ``preference``, ``teacher``,
``agentic``).

Every field has a type, a default (or is required), a range where one applies and a one-line
description; ``reroll config-docs`` prints this schema as a reference, grouped by pipeline. Nothing
here is changed behind the user's back: values that depend on others are properties of the config,
and the run writes the resolved config into its directory. Import ``RunConfig`` from here: this
module registers the built-in pipelines' models.
"""

from __future__ import annotations

from reroll.config.pipelines import (
    AgenticRunConfig,
    DistillRunConfig,
    DPORunConfig,
    RewardModelRunConfig,
    RLVRConfig,
    SFTRunConfig,
)
from reroll.config.run import (
    RunConfig,
    config_docs,
    pipeline_config,
    pipeline_names,
    register_pipeline_config,
)

__all__ = [
    "AgenticRunConfig",
    "DPORunConfig",
    "DistillRunConfig",
    "RLVRConfig",
    "RewardModelRunConfig",
    "RunConfig",
    "SFTRunConfig",
    "config_docs",
    "pipeline_config",
    "pipeline_names",
    "register_pipeline_config",
]
