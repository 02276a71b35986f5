"""Pipelines: one ``Pipeline`` class each (rlvr, agentic, sft, reward_model, dpo, distill), run by the
shared skeleton ``run.run``; ``pipeline_class(name)`` finds one by its config's ``pipeline``."""

from __future__ import annotations

from reroll.pipelines.pipeline import Pipeline, pipeline_class, register_pipeline

__all__ = ["Pipeline", "pipeline_class", "register_pipeline"]
