"""Unit tests see no Ray session: integration tests run first in one pytest process and leave theirs
up (reroll starts Ray once per process), and `reroll validate`'s checks look at the cluster this
process is connected to when there is one (a 2-CPU session would refuse every sized example)."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True)
def _no_ray_session(monkeypatch: pytest.MonkeyPatch) -> None:
    ray = sys.modules.get("ray")
    if ray is not None:
        monkeypatch.setattr(ray, "is_initialized", lambda: False)
