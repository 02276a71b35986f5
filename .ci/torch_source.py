"""Print pip's arguments for torch's CPU build, for the Makefile's install lines (README, "Install").

On Linux, PyPI's torch is the CUDA build (~530 MB plus ~3 GB of CUDA libraries, which a CPU machine
never uses); PyTorch's CPU wheel index serves the CPU build of the same version. Printed:

- ``torch==X --index-url URL`` when the index answers: the README's CPU line. pip still reads the
  sources its own config names (a local wheel directory, other indexes) next to the index.
- ``torch==X+cpu`` when it does not (no network, or a machine whose pip config serves torch from a
  local wheel directory): pip's configured sources then give the CPU build or fail, never a CUDA one.
  Asking pip for the unreachable index instead costs ~8 s of retries per package (78 s measured).

Standard library only.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

TORCH = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def unreachable(url: str, timeout: float = 5.0) -> str | None:
    """Why ``url`` does not answer a HEAD request within ``timeout`` seconds, or None when it does."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
            return None
    except (urllib.error.URLError, OSError) as e:  # HTTPError, DNS, refused, timed out
        return str(getattr(e, "reason", e))


def pip_args() -> list[str]:
    """The arguments after ``pip install`` that install torch's CPU build (module doc)."""
    why = unreachable(f"{CPU_INDEX}/torch/")
    if why is None:
        return [TORCH, "--index-url", CPU_INDEX]
    pin = f"{TORCH}+cpu" if sys.platform == "linux" else TORCH  # PyPI's builds elsewhere are CPU builds
    print(
        f"{CPU_INDEX} does not answer ({why}): installing {pin} from the sources pip's config names",
        file=sys.stderr,
    )
    return [pin]


if __name__ == "__main__":
    print(" ".join(pip_args()))
