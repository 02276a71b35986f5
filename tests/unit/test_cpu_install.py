"""The README's CPU install takes torch's CPU build: PyPI's torch is the CUDA build on Linux (~530 MB plus
~3 GB of CUDA libraries). The README's lines and the Makefile's (.ci/torch_source.py) name the same pin
and index, and a dry-run resolution of the README's line, away from this machine's pip config (whose
local wheel directory would hide what the index gives), installs no CUDA package."""

from __future__ import annotations

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
_spec = importlib.util.spec_from_file_location("torch_source", ROOT / ".ci" / "torch_source.py")
torch_source = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(torch_source)

CUDA_NAME = re.compile(r"(nvidia|cuda)[-_]|triton$")  # what PyPI's CUDA torch brings, name by name


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
