"""actor_infer: workers that hold a generation engine, and their group (prompts split across ranks)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from reroll.config.schema import RunConfig
from reroll.data.types import Completion, SamplingParams
from reroll.engines import make_engine
from reroll.runtime.actors import WorkerGroup, _Ready


class RolloutWorker:
    """One rank of actor_infer."""

    def __init__(self, rank: int, cfg: RunConfig) -> None:
        rc = cfg.roles.actor_infer
        torch.set_num_threads(rc.torch_threads or torch.get_num_threads())
        self.rank = rank
        device = "cuda" if rc.num_gpus_per_worker > 0 else "cpu"
        self.engine = make_engine(
            cfg.rollout.engine, cfg.model.path, cfg.rollout, dtype=cfg.model.dtype, device=device
        )

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        return self.engine.generate(prompts, params)

    def update_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.engine.update_weights(weights)

    def score(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        return self.engine.score(input_ids, attention_mask, temperature)

    def metrics(self) -> dict[str, float]:
        return self.engine.metrics()


class RolloutGroup(WorkerGroup):
    """All actor_infer ranks; prompts are dealt to ranks in contiguous blocks."""

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__("actor_infer", RolloutWorker, lambda rank: (rank, cfg), cfg)

    def generate(
        self, prompts: Sequence[str], params: SamplingParams, phase: str = "generate"
    ) -> list[list[Completion]]:
        """``params.n`` completions per prompt, in prompt order."""
        refs = [h.generate.remote(part, params) for h, part in zip(self.handles, self._deal(prompts))]
        return [group for part in self._wait(refs, phase) for group in part]

    def update_weights(self, weights_ref: Any) -> None:
        """Load weights on every rank; ``weights_ref`` is a Ray reference (or a local result)."""
        if isinstance(weights_ref, _Ready):
            if weights_ref.error is not None:
                raise weights_ref.error
            weights_ref = weights_ref.value
        self._wait([h.update_weights.remote(weights_ref) for h in self.handles], "weight_sync")

    def score(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        """Rank 0's log-probs for given sequences (to check that the engine holds the trainer's weights)."""
        [out] = self._wait([self.handles[0].score.remote(input_ids, attention_mask, temperature)], "score")
        return out

    def metrics(self) -> dict[str, float]:
        parts = self._wait([h.metrics.remote() for h in self.handles], "metrics")
        return {k: sum(p[k] for p in parts) for k in parts[0]}
