"""Datasets by name: a Hugging Face id with split, subset and renamed fields, read from the local cache
offline; `reroll validate` names what is missing and how to fetch it. No network: the cache is built here."""

from __future__ import annotations

import json
import shutil

import pytest

from reroll.cli import main
from reroll.config.data import HubDatasetConfig
from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.data.datasets import read_rows
from reroll.pipelines.common import load_data
from reroll.pipelines.preflight import check_inputs
from tests.conftest import write_config

datasets = pytest.importorskip("datasets")

TRAIN = [{"problem": f"{i}+1", "solution": str(i + 1), "level": i % 3} for i in range(6)]
TEST = [{"problem": f"{i}+2", "solution": str(i + 2), "level": 0} for i in range(3)]


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """A datasets cache holding 'someone/tiny_math' (subset 'main', splits train and test) exactly as
    load_dataset leaves one after a download, and datasets set offline with that cache."""
    from datasets.packaged_modules.json.json import Json

    cache, files = tmp_path / "hf-cache", {}
    for split, rows in (("train", TRAIN), ("test", TEST)):
        files[split] = tmp_path / f"{split}.jsonl"
        files[split].write_text("\n".join(json.dumps(r) for r in rows))
    builder = Json(
        cache_dir=str(cache),
        dataset_name="tiny_math",
        config_name="main",
        config_id="main",
        hash="0123abcd",
        data_files={k: str(v) for k, v in files.items()},
    )
    builder.download_and_prepare()
    # a Hub dataset's cache directory is '<namespace>___<name>/<subset>/<version>/<hash>'
    shutil.move(cache / "tiny_math", cache / "someone___tiny_math")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return cache


def _hub(split: str = "train", **kw) -> dict:
    entry = {"dataset": "someone/tiny_math", "subset": "main", "split": split}
    return entry | {"rename": {"problem": "question", "solution": "answer"}} | kw


def _config(tmp_path, assets, train: list, evaluation: list | None = None) -> RunConfig:
    data = {"train_files": train, "eval_files": evaluation or [], "chat_template": False}
    return load_config(write_config(tmp_path / "c.yaml", assets, data=data), RunConfig)


def test_a_cached_dataset_by_name_loads_with_split_subset_and_renamed_fields(tmp_path, assets, offline_cache):
    cfg = _config(tmp_path, assets, [_hub("train")], [_hub("test")])
    assert check_inputs(cfg) == []  # what `reroll validate` runs
    train, held_out = load_data(cfg)
    assert [(s.prompt, s.row["answer"]) for s in train] == [(f"{i}+1=", str(i + 1)) for i in range(6)]
    assert [s.prompt for s in held_out] == [f"{i}+2=" for i in range(3)]
    assert train[0].row == {"question": "0+1", "answer": "1", "level": 0}  # other fields keep their names
    assert train[0].uid == "someone/tiny_math[main]:train-0"
    # mixed with a file path in the same list
    cfg = _config(tmp_path, assets, [str(assets["train"]), _hub("test")])
    train, _ = load_data(cfg)
    assert train[-1].prompt == "2+2=" and len(train) == 400 + 3


def test_a_dataset_not_in_the_cache_says_so_and_how_to_fetch_it(tmp_path, assets, offline_cache, capsys):
    cfg_path = write_config(
        tmp_path / "c.yaml",
        assets,
        data={"train_files": [{"dataset": "someone/elsewhere", "split": "train"}], "eval_files": []},
    )
    assert main(["validate", str(cfg_path)]) == 2
    err = capsys.readouterr().err
    assert "data.train_files[0]: dataset 'someone/elsewhere:train' is not in the local cache" in err
    assert str(offline_cache) in err and "HF_DATASETS_OFFLINE" in err
    assert "datasets.load_dataset('someone/elsewhere', split='train')" in err
    assert "Traceback" not in err


def test_an_unreachable_hub_reads_the_cache_without_offline_variables(
    tmp_path, assets, offline_cache, monkeypatch
):
    """No HF_*_OFFLINE set, and the Hub does not answer: the cache is read as if offline (datasets'
    retries would take most of a minute), and a dataset not there says the Hub cannot be reached."""
    import reroll.data.hub as hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setattr(hub, "hub_reachable", lambda: False)
    train, _ = load_data(_config(tmp_path, assets, [_hub("train")]))
    assert len(train) == 6
    assert datasets.config.HF_HUB_OFFLINE is False  # offline for the one call only
    [problem] = check_inputs(_config(tmp_path, assets, [{"dataset": "someone/elsewhere", "split": "train"}]))
    assert "the Hub (huggingface.co:443) cannot be reached" in problem.message
    assert "datasets.load_dataset('someone/elsewhere', split='train')" in problem.message


def test_hub_reachable_is_one_bounded_connection(monkeypatch):
    import socket

    from reroll.data.hub import hub_reachable

    for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(v, raising=False)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    assert hub_reachable.__wrapped__(timeout_s=1.0)
    server.close()  # nothing listens there now: refused at once
    assert not hub_reachable.__wrapped__(timeout_s=1.0)


def test_a_wrong_split_subset_or_rename_is_named(tmp_path, assets, offline_cache):
    found = {
        p.path: p.message
        for p in check_inputs(_config(tmp_path, assets, [_hub("validation")], [_hub(subset="nosuch")]))
    }
    assert "validation" in found["data.train_files[0]"] and "fix `split`" in found["data.train_files[0]"]
    assert "'nosuch'" in found["data.eval_files[0]"] and "fix `subset`" in found["data.eval_files[0]"]
    [problem] = check_inputs(_config(tmp_path, assets, [_hub(rename={"prob": "question"})]))
    assert "has no field 'prob' to rename" in problem.message
    [problem] = check_inputs(_config(tmp_path, assets, [_hub(rename={})]))  # the template reads {question}
    assert "has no field 'question'" in problem.message and "someone/tiny_math[main]:train" in problem.message


def test_a_save_to_disk_directory_by_split(tmp_path, assets):
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(TRAIN), "test": datasets.Dataset.from_list(TEST)}
    ).save_to_disk(str(saved))
    rows = read_rows(HubDatasetConfig(dataset=str(saved), split="test", rename={"problem": "question"}))
    assert [r["question"] for r in rows] == ["0+2", "1+2", "2+2"]
    datasets.Dataset.from_list(TEST).save_to_disk(str(tmp_path / "one"))  # a Dataset: a plain path
    assert read_rows(str(tmp_path / "one"), limit=2) == TEST[:2]
    cfg = _config(tmp_path, assets, [str(saved)])  # a plain path to a dataset with splits
    [problem] = check_inputs(cfg)
    assert "holds the splits ['train', 'test']: name one" in problem.message


def test_synthetic_data_needs_a_file_path(tmp_path, assets):
    from reroll.config.loader import ConfigError

    path = write_config(
        tmp_path / "c.yaml",
        assets,
        data={"train_files": [{"dataset": "org/name"}], "synthetic": {"task": "arithmetic"}},
    )
    with pytest.raises(
        ConfigError, match=r"data\.train_files\[0\]: data\.synthetic writes its rows to a file"
    ):
        load_config(path, RunConfig)
