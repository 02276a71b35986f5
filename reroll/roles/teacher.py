"""teacher: frozen models that score the student's tokens for distillation (pipeline 'distill').

Each teacher of ``distill.teachers`` is a group of ``TeacherWorker`` ranks holding its model in a training
strategy (forward only, like the reference), placed by ``roles.teacher``. ``TeacherSet`` is the
``teacher`` role of a run: it routes each row of a batch to its teacher (``teacher_for``, by the row's
domain tag) and offloads, reloads, restarts and stops every teacher together, so a phase that names
``teacher`` holds the devices of all of them.

Outputs are aligned like the log-probs (``reroll.data.types``): ``compute_logprobs`` gives log pi_T of
the batch's own tokens ``(B, T)`` (on-policy), ``compute_topk`` the teacher's ``k`` most likely next
tokens at each position, log-probs and ids ``(B, T, k)`` (offline). Both at temperature 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from reroll.algorithms.logprobs import token_logprobs, token_topk
from reroll.config.schema import RunConfig
from reroll.data.types import TrainBatch
from reroll.roles.strategy_worker import StrategyGroup, StrategyWorker

ROLE = "teacher"


class TeacherWorker(StrategyWorker):
    """One rank of one teacher."""

    head_everywhere = True  # log-probs and top-k of the whole output

    def __init__(self, rank: int, cfg: RunConfig, model_path: str) -> None:
        super().__init__(ROLE, rank, cfg, model_path=model_path, trainable=False, head="causal_lm")

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``(B, T)`` log pi_T(x_t | x_<t) of the batch's tokens, temperature 1."""
        return self._score(batch, lambda mb: token_logprobs(self.forward(mb), mb.input_ids))

    @torch.no_grad()
    def compute_topk(self, batch: TrainBatch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` most likely next tokens at each position: log-probs ``(B, T, k)`` and ids ``(B, T, k)``."""
        width, values, ids = batch.input_ids.shape[1], [], []
        mbs, back = self._forward_only_micro_batches(batch)
        for mb in mbs:
            v, i = token_topk(self.forward(mb), k)
            values.append(_pad_time(v.cpu(), width))
            ids.append(_pad_time(i.cpu(), width))
        return torch.cat(values)[back], torch.cat(ids)[back]


def _pad_time(x: torch.Tensor, width: int) -> torch.Tensor:
    """``(b, t, k)`` right-padded with zeros to ``(b, width, k)``."""
    return torch.nn.functional.pad(x, (0, 0, 0, width - x.shape[1]))


class TeacherGroup(StrategyGroup):
    """The ranks of one teacher; batches are split by rows across them."""

    def __init__(self, cfg: RunConfig, name: str, model_path: str) -> None:
        super().__init__(
            ROLE, TeacherWorker, lambda rank: (rank, cfg, model_path), cfg, name=f"teacher-{name}"
        )

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        shards = batch.split(self.world_size)
        parts = self._wait([h.compute_logprobs.remote(s) for h, s in zip(self.handles, shards)], "teacher")
        return TrainBatch.concat(parts, width=batch.input_ids.shape[1])

    def compute_topk(self, batch: TrainBatch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        shards = batch.split(self.world_size)
        parts = self._wait([h.compute_topk.remote(s, k) for h, s in zip(self.handles, shards)], "teacher")
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class TeacherSet:
    """The ``teacher`` role: one ``TeacherGroup`` per teacher, rows routed to theirs by name."""

    role = ROLE

    def __init__(self, cfg: RunConfig) -> None:
        assert cfg.distill is not None, "the teacher role needs a distill section"
        self.groups: dict[str, TeacherGroup] = {}
        try:
            for name, t in cfg.distill.teachers.items():
                self.groups[name] = TeacherGroup(cfg, name, t.model_path)
        except BaseException:
            self.shutdown()
            raise

    @property
    def residency_check(self) -> Callable[[str], None] | None:
        return next(iter(self.groups.values())).residency_check

    @residency_check.setter
    def residency_check(self, check: Callable[[str], None] | None) -> None:
        for g in self.groups.values():
            g.residency_check = check

    def compute_logprobs(self, batch: TrainBatch, owners: Sequence[str]) -> torch.Tensor:
        """``(B, T)`` log-probs of each row's tokens under the teacher ``owners[row]`` names."""
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for name, rows in _rows_by_owner(owners).items():
            out[rows] = self.groups[name].compute_logprobs(batch.select(rows))
        return out

    def compute_topk(
        self, batch: TrainBatch, owners: Sequence[str], k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's teacher's top-``k`` next-token log-probs and ids, ``(B, T, k)`` each (``k`` at most
        the vocabulary size)."""
        values = ids = None
        for name, rows in _rows_by_owner(owners).items():
            v, i = self.groups[name].compute_topk(batch.select(rows), k)
            if values is None or ids is None:
                values = v.new_zeros((len(batch), *v.shape[1:]))
                ids = i.new_zeros((len(batch), *i.shape[1:]))
            values[rows], ids[rows] = v, i
        assert values is not None and ids is not None, "an empty batch"
        return values, ids

    def offload(self) -> int:
        return sum(g.offload() for g in self.groups.values())

    def reload(self) -> int:
        return sum(g.reload() for g in self.groups.values())

    def restart(self) -> None:
        for g in self.groups.values():
            g.restart()

    def shutdown(self) -> None:
        for g in self.groups.values():
            g.shutdown()


def _rows_by_owner(owners: Sequence[str]) -> dict[str, torch.Tensor]:
    rows: dict[str, list[int]] = {}
    for i, name in enumerate(owners):
        rows.setdefault(name, []).append(i)
    return {name: torch.tensor(idx, dtype=torch.long) for name, idx in rows.items()}
