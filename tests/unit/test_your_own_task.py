"""docs/your-own-task.md and docs/real-model.md: their snippets parse, and the reward they show works as
they say (a RewardResult or a plain number, in the worker's thread or in a child process, found from
the current directory by `reroll validate`)."""

from __future__ import annotations

import ast
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import yaml

from reroll.cli import main
from reroll.config.reward import RewardConfig
from reroll.rewards.isolation import ProcessPool
from reroll.rewards.routing import RewardRouter, RewardTermError
from tests.conftest import write_config

DOCS = Path(__file__).resolve().parents[2] / "docs"
GUIDES = [DOCS / "your-own-task.md", DOCS / "real-model.md"]
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def _blocks(path: Path, language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(path.read_text()) if lang == language]


@pytest.mark.parametrize("path", GUIDES, ids=lambda p: p.name)
def test_the_guides_snippets_parse(path):
    for body in _blocks(path, "python"):
        ast.parse(body)
    for body in _blocks(path, "yaml"):
        assert isinstance(yaml.safe_load(body), dict)
    for body in _blocks(path, "json"):
        json.loads(body)
    assert "](docs/your-own-task.md)" in (DOCS.parent / "README.md").read_text()
    assert "](docs/real-model.md)" in (DOCS.parent / "README.md").read_text()


@pytest.fixture
def my_rewards(tmp_path, monkeypatch):
    """The guide's my_rewards.py, written to a directory that is the current one (and nowhere else on sys.path)."""
    [code] = [b for b in _blocks(DOCS / "your-own-task.md", "python") if b.startswith("# my_rewards.py")]
    (tmp_path / "my_rewards.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    return tmp_path


def test_the_reward_returns_a_result_or_a_plain_number_in_a_thread_or_a_process(my_rewards, monkeypatch):
    monkeypatch.syspath_prepend(str(my_rewards))
    [config] = [yaml.safe_load(b) for b in _blocks(DOCS / "your-own-task.md", "yaml") if "my_rewards" in b]
    thread = RewardRouter(RewardConfig(**config["reward"]))  # no process pool: in the calling thread
    result = thread.score("What is 12 * 7?", "It is 84.004", {"answer": "84"}, "default")
    assert (result.score, dict(result.details)) == (1.0, {"correct": 1, "parsed": 1})
    assert thread.score("q", "no idea", {"answer": "84"}, "default").details == {"correct": 0, "parsed": 0}
    trl = RewardRouter(RewardConfig(fn="my_rewards:reversed_exactly"))  # the row's fields as keywords
    assert trl.score("q", " 84", {"answer": "84", "id": "x"}, "default").score == 1.0
    assert trl.score("q", "48", {"answer": "84", "id": "x"}, "default").score == 0.0
    pool = ProcessPool(1, preload=[("my_rewards:exact", {})])
    try:  # `isolation: auto` runs a module:function reward in a child process, the default
        isolated = RewardRouter(RewardConfig(fn="my_rewards:exact"), pool)
        result = isolated.score("q", " 84", {"answer": "84"}, "default", deadline=time.monotonic() + 30)
        assert (result.score, dict(result.details)) == (1.0, {})
    finally:
        pool.close()


def test_a_reward_returning_something_else_is_an_error_that_says_what_to_return(tmp_path, monkeypatch):
    (tmp_path / "bad_rewards.py").write_text("def text(prompt, response, row):\n    return '1'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    router = RewardRouter(RewardConfig(fn="bad_rewards:text"))
    with pytest.raises(RewardTermError, match=r"returned str '1': return a number or RewardResult"):
        router.score("q", "r", {}, "default")


def test_validate_finds_a_reward_module_in_the_current_directory(my_rewards, assets, capsys):
    cfg = write_config(
        my_rewards / "task.yaml",
        assets,
        reward={"fn": "my_rewards:close_enough", "args": {"tolerance": 0.01}},
    )
    assert os.getcwd() == str(my_rewards) and str(my_rewards) not in sys.path
    assert main(["validate", str(cfg)]) == 0, capsys.readouterr().err
    bad = write_config(
        my_rewards / "bad.yaml", assets, reward={"fn": "my_rewards:close_enough", "args": {"tolerence": 1}}
    )
    assert main(["validate", str(bad)]) == 2
    assert "'tolerence' (did you mean 'tolerance'?)" in capsys.readouterr().err
