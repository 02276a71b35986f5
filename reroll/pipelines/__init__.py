"""Pipelines: one ``Pipeline`` class each (rlvr, agentic, sft, reward_model, dpo, distill), run by the
shared skeleton ``run.run``."""

from __future__ import annotations

from reroll.pipelines.run import Pipeline


def pipeline_class(name: str) -> type[Pipeline]:
    """The pipeline ``pipeline: <name>`` names (imported on demand: each pulls in its own roles)."""
    if name == "sft":
        from reroll.pipelines.sft import SFT

        return SFT
    if name == "distill":
        from reroll.pipelines.distill import Distill

        return Distill
    if name == "reward_model":
        from reroll.pipelines.reward_model import RewardModel

        return RewardModel
    if name == "dpo":
        from reroll.pipelines.dpo import DPO

        return DPO
    if name == "agentic":
        from reroll.pipelines.agentic import Agentic

        return Agentic
    from reroll.pipelines.rlvr import RLVR

    return RLVR
