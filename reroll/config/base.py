"""The base class every config section derives from: strict, typed, documented."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A config section. Unknown keys are errors, values are validated on assignment too.

    Every field carries a default (or is required), a type (``Literal[...]`` for choices),
    a range where one applies (``Field(ge=1)``) and a one-line ``description``: the config
    schema is the documentation.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)
