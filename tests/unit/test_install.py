"""The README's CPU install: reroll's own dependencies, no extras, and torch's CPU build.

- What a module imports when it is loaded is one of reroll's dependencies: an optional backend
  (vLLM, DeepSpeed, wandb, ...) is imported inside the function that needs it, so the quickstart runs
  without the extras. CI installs every extra, so only this static check sees such an import.
- PyPI's torch is the CUDA build on Linux (~530 MB plus ~3 GB of CUDA libraries): the README's lines and
  the Makefile's (.ci/torch_source.py) name the same pin and CPU index, and a dry-run resolution of the
  README's line, away from this machine's pip config (whose local wheel directory would hide what the
  index gives), installs no CUDA package.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# modules that are an optional backend themselves, loaded only by name when a config asks for it
# modules that only their backend's code imports (inside its functions), so they may import it when loaded
BACKEND_MODULES = {
    "reroll/strategies/deepspeed.py": "deepspeed",
    "reroll/strategies/megatron_context.py": "megatron",
}
IMPORT_TO_PACKAGE = {"yaml": "pyyaml", "pydantic_core": "pydantic"}  # where the names differ
_spec = importlib.util.spec_from_file_location("torch_source", ROOT / ".ci" / "torch_source.py")
torch_source = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(torch_source)

CUDA_NAME = re.compile(r"(nvidia|cuda)[-_]|triton$")  # what PyPI's CUDA torch brings, name by name


def module_level_imports(path: Path) -> set[str]:
    """The top-level names of the packages ``path`` imports when it is loaded: its module body and the
    ``if``/``try`` blocks in it, not a function's body nor ``if TYPE_CHECKING``."""
    names, todo = set(), list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.dump(node.test):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody
    return names


def test_modules_import_only_reroll_s_dependencies_when_loaded():
    from packaging.requirements import Requirement

    try:
        import tomllib
    except ImportError:  # Python 3.10
        from pip._vendor import tomli as tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    allowed = {Requirement(r).name.lower() for r in project["dependencies"]}
    assert {"torch", "ray", "transformers"} <= allowed, allowed
    checked, bad = 0, []
    for path in sorted((ROOT / "reroll").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for name in module_level_imports(path) - {"reroll", "__future__", *sys.stdlib_module_names}:
            checked += 1
            if IMPORT_TO_PACKAGE.get(name, name).lower() not in allowed | {BACKEND_MODULES.get(rel)}:
                bad.append(f"{rel}: import {name}")
    assert checked > 50, f"only {checked} imports found: the parse no longer reads the package"
    assert not bad, (
        "imported when the module loads, but not a dependency in pyproject.toml (the quickstart's install "
        "lacks it): import it inside the function that needs it:\n" + "\n".join(bad)
    )


def test_a_module_level_import_of_an_extra_is_found(tmp_path: Path):
    (tmp_path / "m.py").write_text(
        "import torch\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import vllm\n"
        "try:\n    import wandb\nexcept ImportError:\n    wandb = None\n"
        "def f():\n    import deepspeed\n"
    )  # fmt: skip
    assert module_level_imports(tmp_path / "m.py") == {"torch", "typing", "wandb"}


def cuda_packages(report: dict) -> list[str]:
    """The packages of a ``pip install --report`` that belong to a CUDA build: nvidia-*, cuda-*, triton,
    and a +cuXXX build of anything."""
    found = []
    for item in report["install"]:
        name, version = item["metadata"]["name"].lower(), item["metadata"]["version"]
        if CUDA_NAME.match(name) or "+cu" in version:
            found.append(f"{name} {version}")
    return found


def readme_torch_lines() -> list[str]:
    """The README's code lines that install torch."""
    return [
        line.strip()
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("pip install torch==")
    ]


def test_the_readme_and_make_take_torch_from_the_cpu_index():
    expected = f"pip install {torch_source.TORCH} --index-url {torch_source.CPU_INDEX}"
    lines = readme_torch_lines()
    assert len(lines) >= 2, f"the README's quickstart and test installs each install torch; found {lines}"
    assert all(line == expected for line in lines), f"README: {lines}; .ci/torch_source.py: {expected}"
    makefile = (ROOT / "Makefile").read_text()
    assert "PIP_TORCH = pip install $$($(PYTHON) .ci/torch_source.py)" in makefile
    assert makefile.count("$(PIP_TORCH) && pip install -e") == 2  # the quickstart's install and the suite's


def test_the_make_line_without_the_index_pins_the_cpu_build(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch_source, "unreachable", lambda url: "no network")
    monkeypatch.setattr(torch_source.sys, "platform", "linux")
    assert torch_source.pip_args() == [f"{torch_source.TORCH}+cpu"]
    monkeypatch.setattr(torch_source, "unreachable", lambda url: None)
    assert torch_source.pip_args() == [torch_source.TORCH, "--index-url", torch_source.CPU_INDEX]


def test_cuda_packages_are_found_in_a_report():
    # an excerpt of `pip install --dry-run --report` for `pip install torch==2.13.0` from PyPI on Linux
    pypi = {"install": [{"metadata": {"name": n, "version": v}} for n, v in [
        ("torch", "2.13.0"), ("nvidia-cudnn-cu13", "9.20.0.48"), ("triton", "3.7.1"),
        ("cuda-bindings", "13.5.0"), ("sympy", "1.14.0"), ("torchvision", "0.28.0+cu130"),
    ]]}  # fmt: skip
    assert cuda_packages(pypi) == [
        "nvidia-cudnn-cu13 9.20.0.48", "triton 3.7.1", "cuda-bindings 13.5.0", "torchvision 0.28.0+cu130"
    ]  # fmt: skip
    cpu = {"install": [{"metadata": {"name": "torch", "version": "2.13.0+cpu"}}, pypi["install"][4]]}
    assert cuda_packages(cpu) == []


def test_the_readme_cpu_line_resolves_without_cuda(tmp_path: Path):
    if why := torch_source.unreachable(f"{torch_source.CPU_INDEX}/torch/"):
        pytest.skip(f"{torch_source.CPU_INDEX} does not answer ({why}): the dry run resolves torch from it")
    [line, *_] = readme_torch_lines()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}  # no local wheel directory
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    cmd += ["--report", str(report), *shlex.split(line)[2:]]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{shlex.join(cmd)} failed:\n{done.stderr[-3000:]}"
    installs = json.loads(report.read_text())
    versions = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in installs["install"]}
    assert "torch" in versions, f"the dry run resolved no torch: {versions}"
    assert cuda_packages(installs) == [], f"`{line}` would install CUDA packages"
    if sys.platform == "linux":  # the CPU index's Linux wheels are tagged +cpu; macOS's are untagged
        assert versions["torch"].endswith("+cpu"), f"`{line}` resolves torch {versions['torch']}"
