"""judge: workers that hold a generation engine for ``engine_judge`` rewards, and their group.

The reward group starts the judge group when ``reward.judge`` is set and hands each reward worker a
``JudgeClient``: a reward call sends its one judge prompt to a judge rank (round robin) and waits for
the greedy reply. A judge rank that dies or fails is a ``RoleError`` naming ``judge``, which fails
the reward call, and with it the step (it is not scored as a parse error).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

from reroll.config.rollout import RolloutConfig
from reroll.config.schema import RunConfig
from reroll.data.types import SamplingParams
from reroll.engines import make_engine
from reroll.errors import RoleError
from reroll.runtime.actors import WorkerGroup, gather
from reroll.runtime.placement import configure_process, worker_device


class JudgeWorker:
    """One rank of judge: an engine (``reward.judge.engine``) loaded from ``reward.judge.model_path``.

    ``engine``: use this object (anything with the engine's ``generate``) instead of building one.
    """

    def __init__(self, rank: int, cfg: RunConfig, engine: Any = None) -> None:
        j = cfg.reward.judge
        if j is None:
            raise ValueError("JudgeWorker needs reward.judge")
        self.rank, self.cfg = rank, j
        configure_process(cfg, "judge")  # its torch threads and model.cudnn_attention, as the other roles
        rollout = RolloutConfig(engine=j.engine, generate_batch_size=j.batch_size, vllm=cfg.rollout.vllm)
        device = worker_device(cfg, "judge")
        self.engine = engine or make_engine(j.model_path, rollout, dtype=j.dtype, device=device)
        self.template = self._chat_template() if j.chat_template else None
        self._lock = threading.Lock()  # the local backend calls from several reward threads at once

    def _chat_template(self) -> Any:
        tokenizer = getattr(self.engine, "tokenizer", None)
        return tokenizer if tokenizer is not None and getattr(tokenizer, "chat_template", None) else None

    def generate(self, prompts: list[str]) -> list[str]:
        """Greedy replies, one per prompt (each wrapped as a user turn where the tokenizer has a template)."""
        if self.template is not None:
            prompts = [
                self.template.apply_chat_template(
                    [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
                )
                for p in prompts
            ]
        params = SamplingParams(n=1, temperature=0.0, max_new_tokens=self.cfg.max_new_tokens)
        with self._lock:
            return [group[0].text for group in self.engine.generate(prompts, params)]


class JudgeClient:
    """What a reward worker calls: ``client(prompt) -> reply`` on the next judge rank. Picklable (it
    holds the ranks' actor handles), so Ray passes it to the reward workers."""

    def __init__(self, handles: Sequence[Any], timeout_s: float) -> None:
        self.handles, self.timeout_s = list(handles), timeout_s
        self._next = itertools.count()

    def __getstate__(self) -> dict[str, Any]:
        return {"handles": self.handles, "timeout_s": self.timeout_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["handles"], state["timeout_s"])

    def __call__(self, prompt: str) -> str:
        rank = next(self._next) % len(self.handles)
        try:
            [[reply]] = gather(
                [self.handles[rank].generate.remote([prompt])],
                role="judge",
                phase="judge",
                timeout_s=self.timeout_s,
            )
        except RoleError as e:  # gather numbers the one call rank 0: name the rank that failed
            raise RoleError("judge", rank, e.phase, e.cause, died=e.died) from e
        return reply


class JudgeGroup(WorkerGroup):
    """All judge ranks (``roles.judge``)."""

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__("judge", JudgeWorker, lambda rank: (rank, cfg), cfg)

    def client(self) -> JudgeClient:
        return JudgeClient(self.handles, self.timeout_s)
