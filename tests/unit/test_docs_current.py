"""docs/config.md is generated from the schema; it must not drift."""

from pathlib import Path

from reroll.config.loader import config_reference
from reroll.config.schema import RunConfig


def test_config_reference_is_current():
    doc = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert doc.read_text() == config_reference(RunConfig) + "\n", (
        "regenerate: reroll config-docs > docs/config.md"
    )
