"""The data sections: prompts and held-out rows (``data``), file paths or datasets by name."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag

from reroll.config.base import StrictModel


class SyntheticDataConfig(StrictModel):
    """Generate a synthetic verifiable task into the data files if they do not exist."""

    task: Literal["arithmetic", "shapes"] = Field(
        "arithmetic",
        description="Which synthetic task: 'arithmetic' (a op b), or 'shapes' (count the squares drawn in "
        "a 32x32 image, 1 to max_operand; rows with images, for a vision-language model).",
    )
    n_train: int = Field(5000, ge=1, description="Training rows.")
    n_test: int = Field(500, ge=1, description="Held-out rows (disjoint from training).")
    max_operand: int = Field(99, ge=1, description="Largest operand ('shapes': the most shapes, up to 9).")
    ops: str = Field("+", min_length=1, description="Operators to draw from, e.g. '+-'.")
    seed: int = Field(0, description="Seed of the generator.")


class HubDatasetConfig(StrictModel):
    """A Hugging Face dataset by name, one split; read from the local cache when HF_DATASETS_OFFLINE=1."""

    dataset: str = Field(
        description="Hub id ('org/name', loaded with datasets.load_dataset), or a directory written by "
        "datasets' save_to_disk (a DatasetDict's split is picked by `split`).",
    )
    split: str = Field("train", min_length=1, description="The split to read ('train', 'test', ...).")
    subset: str | None = Field(
        None,
        description="The dataset's configuration (load_dataset's `name`, e.g. 'main'); None: its default.",
    )
    rename: dict[str, str] = Field(
        default_factory=dict,
        description="Fields renamed as rows are read, {name in the dataset: name the config reads}, e.g. "
        "{problem: question, solution: answer}; the other fields keep their names.",
    )

    @property
    def label(self) -> str:
        """How errors and row ids name it: ``org/name[subset]:split``."""
        subset = f"[{self.subset}]" if self.subset else ""
        return f"{self.dataset}{subset}:{self.split}"


def _source_kind(value: Any) -> str:
    return "HubDatasetConfig" if isinstance(value, dict | HubDatasetConfig) else "str"


DataSource = Annotated[
    Union[Annotated[str, Tag("str")], Annotated[HubDatasetConfig, Tag("HubDatasetConfig")]],  # noqa: UP007
    Discriminator(_source_kind),
]
"""One entry of ``data.train_files`` / ``eval_files`` / ``sft.files``: a file path or a dataset by name."""


class DataConfig(StrictModel):
    """Prompts for rollouts, held-out prompts for evaluation."""

    train_files: list[DataSource] = Field(
        min_length=1,
        description="Training rows: each entry a path (JSONL / JSON / Parquet file, or a datasets "
        "save_to_disk directory; a relative path is read from the current directory) or a Hugging Face "
        "dataset by name, {dataset: org/name, split: train, subset: ..., rename: {...}}.",
    )
    eval_files: list[DataSource] = Field(
        default_factory=list, description="Held-out rows for evaluation, in the same forms as train_files."
    )
    prompt_template: str = Field(
        "{question}", description="Python format string over a row's fields: the user message."
    )
    chat_template: Literal["auto", True, False] = Field(
        "auto",
        description="Render prompts with the tokenizer's chat template (the user message, after "
        "system_prompt) in rollouts, evaluation and SFT: 'auto' when the tokenizer has one, true (an "
        "error without one), false (the prompt_template text as it is).",
    )
    system_prompt: str | None = Field(
        None, description="A system message before each prompt (needs a chat template)."
    )
    answer_field: str = Field("answer", description="The row field the reward compares against.")
    id_field: str = Field("id", description="The row field that identifies a row (optional in rows).")
    eval_limit: int | None = Field(None, ge=1, description="Evaluate on at most this many held-out rows.")
    shuffle: bool = Field(True, description="Reshuffle training prompts every epoch.")
    synthetic: SyntheticDataConfig | None = Field(
        None, description="If set, generate this task into train_files[0] / eval_files[0] when missing."
    )
    image_field: str | None = Field(
        "images",
        description="The row field holding a prompt's images (a vision-language model): one image or a "
        "list, each a file path (relative to the data file), a base64 string or data:image/...;base64 URI, "
        "or a Hugging Face dataset's Image feature. Rows without it are text only; null: images are not "
        "read. The prompt places them before the prompt_template's text.",
    )
