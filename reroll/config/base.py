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

    def changed_fields(self) -> set[str]:
        """The fields set to something other than their default. Checks of the form "X is set but
        unused" read this, not ``model_fields_set``: a run's own config.yaml writes every field, and
        must load back."""
        fields = type(self).model_fields
        return {
            f
            for f in self.model_fields_set
            if getattr(self, f) != fields[f].get_default(call_default_factory=True)
        }
