"""Which groups ``_recover`` rebuilds after a worker died, on stand-in roles: only the dead role's, and
the trainer's partner (critic, actor_train) only where no checkpoint holds its state; a lost node is
checked before anything restarts. The runs themselves: tests/integration/test_rank_recovery.py and
test_recovery.py (``long``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from reroll.errors import RoleError, UserError
from reroll.pipelines import run as run_module

CKPT = Path("/runs/x/checkpoints/step_000004")


class _Group:
    def __init__(self, role: str) -> None:
        self.role = role


class _Roles:
    """What ``_recover`` uses of ``Roles``: its groups, the restarts it makes, the placement check."""

    def __init__(self, *names: str, lost_node: bool = False, node_held: tuple[str, ...] = ()) -> None:
        self.groups = {n: _Group(n) for n in names}
        self.restarted: list[str] = []  # what the run counts (one per death)
        self.rebuilt: list[str] = []  # the groups rebuilt
        self.checked: list[tuple[int, Path | None]] = []
        self.lost_node, self.node_held = lost_node, set(node_held)
        self.placement = SimpleNamespace(check_nodes=self._check_nodes)

    def _check_nodes(self, step: int, checkpoint: Path | None) -> set[str]:
        self.checked.append((step, checkpoint))
        if self.lost_node and not self.node_held:
            raise UserError(
                "placement: 1 Ray node died at step 5, and the rest of the cluster no longer fits"
            )
        return self.node_held

    def restart(self, role: str) -> None:
        self.rebuilt.append(role)

    def pop_timings(self) -> dict[str, float]:
        return {}


class _Pipeline:
    def __init__(self) -> None:
        self.cfg = SimpleNamespace(runtime=SimpleNamespace(max_restarts=3), run_dir=Path("/runs/x"))
        self.rewound: list[str] = []

    def rewind(self, saved: str) -> None:
        self.rewound.append(saved)


def _recover(monkeypatch, roles: _Roles, role: str, checkpoint: Path | None, *, trained: bool = False):
    """``_recover`` after ``role``'s rank 1 died at step 5, the latest checkpoint being ``checkpoint``:
    (the step the loop continues after, the pipeline, ``_begin``'s calls)."""
    begun: list[tuple[Path | None, bool]] = []

    def begin(pipeline, roles, resume_from, *, recovering=False):
        begun.append((resume_from, recovering))
        return 4 if resume_from else 0

    monkeypatch.setattr(run_module, "_begin", begin)
    monkeypatch.setattr(run_module.checkpoint, "latest", lambda run_dir: checkpoint)
    pipeline: Any = _Pipeline()
    died = RoleError(role, 1, "train", "the worker process died (ActorDiedError)", died=True)
    snapshots = ("before", "initial")
    after = run_module._recover(died, 5, pipeline, cast(Any, roles), snapshots, trained=trained)
    return after, pipeline, begun


def test_a_dead_trainer_rank_rebuilds_its_group_alone_and_goes_back_to_the_checkpoint(monkeypatch):
    roles = _Roles("actor_train", "actor_infer", "reference", "reward", "critic")
    after, pipeline, begun = _recover(monkeypatch, roles, "actor_train", CKPT)
    assert roles.rebuilt == ["actor_train"]  # the critic loads the checkpoint with it, in _begin
    assert begun == [(CKPT, True)]  # recovering: the reference keeps the snapshot it holds
    assert after == 4 and pipeline.rewound == []  # step 5 redone after the checkpoint's step 4
    assert roles.restarted == ["actor_train at step 5"] and roles.checked == [(5, CKPT)]


def test_a_dead_critic_rebuilds_only_the_critic_where_a_checkpoint_holds_the_trainer(monkeypatch):
    roles = _Roles("actor_train", "actor_infer", "critic")
    _recover(monkeypatch, roles, "critic", CKPT)
    assert roles.rebuilt == ["critic"]


def test_without_a_checkpoint_the_trainer_and_critic_both_start_over(monkeypatch):
    """Only a fresh group holds the run's starting weights: the partner is rebuilt too, and the
    pipeline goes back to its start."""
    roles = _Roles("actor_train", "actor_infer", "critic")
    after, pipeline, begun = _recover(monkeypatch, roles, "actor_train", None)
    assert roles.rebuilt == ["actor_train", "critic"]
    assert begun == [(None, True)] and after == 0 and pipeline.rewound == ["initial"]


def test_a_dead_engine_rank_rebuilds_the_engine_and_retries_the_step(monkeypatch):
    roles = _Roles("actor_train", "actor_infer", "reference", "reward")
    after, pipeline, begun = _recover(monkeypatch, roles, "actor_infer", CKPT)
    assert roles.rebuilt == ["actor_infer"] and begun == []
    assert after == 4 and pipeline.rewound == ["before"]  # step 5 again, with its prompts


def test_a_lost_node_that_no_longer_fits_stops_before_anything_restarts(monkeypatch):
    roles = _Roles("actor_train", "actor_infer", lost_node=True)
    with pytest.raises(UserError, match="no longer fits"):
        _recover(monkeypatch, roles, "actor_train", CKPT)
    assert roles.rebuilt == [] and roles.checked == [(5, CKPT)]


def test_every_role_a_lost_node_held_restarts_at_once_the_engine_last(monkeypatch):
    """The node held actor_train, reference and the engine (one pool device): one recovery restarts the
    three (the engine after the trainer, whose weights its restart syncs) and goes back to the checkpoint."""
    held = ("actor_infer", "reference", "actor_train")
    roles = _Roles("actor_train", "actor_infer", "reference", "reward", lost_node=True, node_held=held)
    after, _, begun = _recover(monkeypatch, roles, "actor_infer", CKPT)
    assert roles.rebuilt == ["actor_train", "reference", "actor_infer"]
    assert roles.restarted == ["actor_infer at step 5"]  # one death counted, not three
    assert begun == [(CKPT, True)] and after == 4
