"""Errors that are the user's to fix. The CLI prints these as one message, without a traceback."""

from __future__ import annotations


class UserError(Exception):
    """Bad input: a config value, a missing file, a malformed dataset row. The message says how to fix it."""


class RoleError(RuntimeError):
    """A role's worker failed or timed out; the message names the role, the rank and the phase, and
    what the worker runs when the role says (``actor_infer[0] (vllm engine) failed during generate``)."""

    def __init__(
        self,
        role: str,
        rank: int | None,
        phase: str,
        cause: str,
        detail: str | None = None,
        *,
        died: bool = False,
    ) -> None:
        """``died``: the worker's process is gone (killed, crashed, out of memory), not an exception in
        it: the run may restart the role (``runtime.max_restarts``)."""
        where = f"{role}[{rank}]" if rank is not None else role
        if detail:
            where += f" ({detail})"
        super().__init__(f"{where} failed during {phase}: {cause}")
        self.role, self.rank, self.phase, self.cause, self.detail = role, rank, phase, cause, detail
        self.died = died

    def __reduce__(self) -> tuple:  # so the error keeps its fields when it crosses Ray
        return (_role_error, (self.role, self.rank, self.phase, self.cause, self.detail, self.died))

    def in_phase(self, phase: str) -> RoleError:
        """The same error, naming the pipeline phase the failed call belonged to (when it differs)."""
        if self.phase == phase or self.phase.startswith(f"{phase} "):
            return self
        return self.with_phase(f"{phase} ({self.phase})")

    def at_step(self, step: int) -> RoleError:
        """The same error, with the pipeline step in its phase."""
        return self.with_phase(f"{self.phase} at step {step}")

    def with_phase(self, phase: str, cause: str | None = None) -> RoleError:
        """The same error with another phase (and cause)."""
        cause = self.cause if cause is None else cause
        return RoleError(self.role, self.rank, phase, cause, self.detail, died=self.died)


def _role_error(*args: object) -> RoleError:
    *fields, died = args
    return RoleError(*fields, died=bool(died))  # type: ignore[arg-type]


class RewardFailure(UserError):
    """The user's reward fails on too many samples of one call (``reward.max_error_share``): the message
    gives how many, the first error (type and text) and the reward's config key, and stops the run."""

    def __init__(self, phase: str, failed: int, total: int, first: str, rule: str) -> None:
        super().__init__(
            f"the reward failed on {failed} of {total} samples during {phase} ({rule}); the first: {first}. "
            f"A reward is called fn(prompt, response, row, **args) (or with the row's fields as keywords) and "
            f"returns a RewardResult or a number: fix the function or its args (`reroll validate` calls it on "
            f"the first rows' own answers; this failed on the model's responses)"
        )
        self.phase, self.failed, self.total, self.first, self.rule = phase, failed, total, first, rule

    def __reduce__(self) -> tuple:
        return (RewardFailure, (self.phase, self.failed, self.total, self.first, self.rule))

    def at_step(self, step: int) -> RewardFailure:
        """The same error, with the pipeline step in its phase."""
        return RewardFailure(f"{self.phase} at step {step}", self.failed, self.total, self.first, self.rule)
