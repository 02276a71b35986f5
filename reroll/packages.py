"""Whether a module can be imported here, asked without importing it: the one test behind every "is
this package installed" check (engines, strategies, rewards, trackers, plots)."""

from __future__ import annotations

import importlib.util


def importable(module: str) -> bool:
    """Whether ``module`` (dotted names too) would import here. A dotted name whose parent package is
    missing makes ``find_spec`` raise rather than answer: that is a no, as is a malformed name."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
