"""What the first training rows show before anything starts, for ``reroll.pipelines.preflight``:

- ``reward_trials``: each reward of your own (``package.module:function``) called on the first
  ``TRIAL_ROWS`` training rows, with the row's own answer as the response (its SFT target with a warm
  start) and with an empty response. Raising, returning something that is not a number, a non-finite
  score or passing ``reward.sample_timeout_s`` on the own answers is a problem: every call of the run
  would fail the same way, after minutes of warm start. Raising on the empty response, or scoring
  every own answer 0 or less, is a warning. Registered rewards are reroll's own and not called.
- ``length_warnings``: the first ``LENGTH_ROWS`` training rows' answers (their SFT targets with a warm
  start) tokenized with the model's tokenizer against ``rollout.max_new_tokens``: the share that is
  cut, and the value that fits them all (``reroll.data.lengths``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reroll.config.loader import ConfigProblem
from reroll.config.schema import RunConfig
from reroll.data import lengths
from reroll.data.datasets import Source, read_rows
from reroll.data.lengths import length_fit
from reroll.errors import UserError
from reroll.rewards import REGISTRY, RENAMED, resolve_reward
from reroll.rewards.base import as_result
from reroll.rewards.calling import describe_error
from reroll.rewards.routing import domain_terms, route, term_key

TRIAL_ROWS = 4  # training rows each reward of your own is called on
LENGTH_ROWS = 1000  # training rows whose answers are measured against rollout.max_new_tokens


@dataclass(frozen=True)
class TrialRow:
    """A training row as the reward sees it, where it came from, and the response it should accept."""

    file: str
    index: int  # from 0
    row: dict[str, Any]
    prompt: str
    reference: str | None  # the row's own answer (its SFT target with a warm start), when it has one


def trial_rows(cfg: RunConfig, rows: Sequence[tuple[str, int, dict[str, Any]]]) -> list[TrialRow]:
    """``(file, index, row)`` of training rows (checked for their fields) as rewards see them: with
    ``row["answer"]`` where ``data.answer_field`` names another field, the prompt template's text."""
    data = cfg.section("data")
    if data is None:
        return []
    out = []
    for file, index, row in rows:
        row = _aliased(cfg, row)
        try:
            prompt = data.prompt_template.format(**row)
        except (KeyError, IndexError, ValueError):  # reported by the field checks
            continue
        out.append(TrialRow(file, index, row, prompt, reference_text(cfg, row)))
    return out


def reference_text(cfg: RunConfig, row: dict[str, Any]) -> str | None:
    """What a right response to ``row`` is: its SFT target where the run learns targets, else its
    answer; None when the row has neither."""
    return lengths.reference_text(row, lengths.answer_template(cfg))


def reward_trials(
    cfg: RunConfig, rows: Sequence[TrialRow], skip: set[str]
) -> tuple[list[ConfigProblem], list[ConfigProblem]]:
    """``(problems, warnings)`` of calling each reward of your own on ``rows`` (module doc); rewards
    whose config key is in ``skip`` (they do not import or bind) are not called."""
    problems: list[ConfigProblem] = []
    warnings: list[ConfigProblem] = []
    for domain, terms in domain_terms(cfg.reward).items():
        mine = [r for r in rows if _routes_to(cfg, r.row, domain)][:TRIAL_ROWS]
        for i, term in enumerate(terms):
            key = term_key(cfg.reward, domain, i)
            if RENAMED.get(term.fn, term.fn) in REGISTRY or key in skip or not mine:
                continue
            try:
                fn = resolve_reward(term.fn, term.args)
            except UserError:  # reported by the import check
                continue
            problem, warning = _trial(fn, term.fn, mine, cfg.reward.sample_timeout_s, cfg)
            problems += [ConfigProblem(f"{key}.fn", problem)] if problem else []
            warnings += [ConfigProblem(f"{key}.fn", warning)] if warning else []
    return problems, warnings


def _routes_to(cfg: RunConfig, row: dict[str, Any], domain: str) -> bool:
    try:
        return route(cfg.reward, str(row.get("domain", "default"))) == domain
    except UserError:  # a row no domain takes: reported by the domain checks
        return False


def _trial(
    fn: Callable[..., Any], name: str, rows: Sequence[TrialRow], timeout: float, cfg: RunConfig
) -> tuple[str | None, str | None]:
    """``(problem, warning)`` of ``fn`` on ``rows``: the first failure on a row's own answer, else one
    on an empty response, or own answers that all score 0 or less."""
    scores = []
    for r in [r for r in rows if r.reference is not None]:
        score, failed = _call(fn, r, r.reference, timeout)
        if failed:
            fields = f" (the row has the fields {sorted(r.row)})" if "KeyError" in failed else ""
            return (
                f"{name!r} {failed} when called on training row {r.index + 1} of {r.file} with the row's "
                f"own answer {r.reference!r} as the response{fields}: fix the function; in a run every "
                f"call would fail the same way, after the warm start",
                None,
            )
        scores.append(score)
    for r in rows:
        _, failed = _call(fn, r, "", timeout)
        if failed:
            return None, (
                f"{name!r} {failed} on an empty response (training row {r.index + 1} of {r.file}): in a run, "
                f"each such call counts in reward/errors and scores reward.error_score, and a step where "
                f"more than reward.max_error_share={cfg.reward.max_error_share:g} of the samples fail "
                f"stops the run: return 0 for a response it cannot read"
            )
    if scores and all(s <= 0 for s in scores):
        return None, (
            f"{name!r} scored {', '.join(f'{s:g}' for s in scores)} for the first {len(scores)} training "
            f"rows' own answers given as the response: if a right answer should score more, check the "
            f"fields it compares (the rows have {sorted(rows[0].row)})"
        )
    return None, None


def _call(fn: Callable[..., Any], r: TrialRow, response: str, timeout: float) -> tuple[float, str | None]:
    """``fn(prompt, response, row)``'s score, or how it failed: ``raised ...``, ``returned ...`` (not a
    number, or not finite), ``did not return ...`` within ``timeout`` seconds."""
    out: dict[str, Any] = {}

    def call() -> None:
        try:
            out["value"] = fn(r.prompt, response, dict(r.row))
        except BaseException as e:  # whatever the user's function raises is reported, not raised
            out["error"] = e

    thread = threading.Thread(target=call, daemon=True, name="reward-trial")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return math.nan, f"did not return within reward.sample_timeout_s={timeout:g}s"
    if "error" in out:
        return math.nan, f"raised {describe_error(out['error'])}"
    try:
        score = as_result(out["value"]).score
    except TypeError as e:
        return math.nan, str(e)
    if not math.isfinite(score):
        return score, f"returned a score of {score}: return a finite number"
    return score, None


def length_warnings(cfg: RunConfig, tokenizer: Any, end: int) -> list[ConfigProblem]:
    """The training rows' answers (SFT targets with a warm start) against ``rollout.max_new_tokens``:
    a warning with the share cut and the value that fits, or with the share left no room for the
    ``end`` tokens that close a response (those count in rollout/truncated)."""
    data = cfg.section("data")
    if data is None or tokenizer is None:
        return []
    texts = [
        t for t in (reference_text(cfg, _aliased(cfg, row)) for row in _first_rows(data.train_files)) if t
    ]
    if not texts:
        return []
    learns = cfg.reads_targets
    end = end if learns else 0
    fit = length_fit(tokenizer, texts, cap=cfg.rollout.max_new_tokens, end=end)
    what = (
        "SFT targets (sft.target_template)"
        if learns
        else f"answers (data.answer_field {data.answer_field!r})"
    )
    longest = f"the longest is {fit.longest} tokens" + (f", plus {end} to end the response" if end else "")
    # a run without a warm start is told only the answers: its responses may need more around them
    at_least = "" if learns else "at least "
    if fit.cut:
        return [
            ConfigProblem(
                "rollout.max_new_tokens",
                f"{fit.cap} cuts {fit.share_cut:.1%} of the training rows' {what} ({fit.cut} of the first "
                f"{fit.rows}): a response that must be longer can never be right, so accuracy stays under "
                f"{fit.ceiling:.3f}; {longest}: set rollout.max_new_tokens to {at_least}{fit.fitting_cap}",
            )
        ]
    if fit.no_end:
        return [
            ConfigProblem(
                "rollout.max_new_tokens",
                f"{fit.cap} leaves no room to end the response after {fit.no_end / fit.rows:.1%} of the "
                f"training rows' {what} ({fit.no_end} of the first {fit.rows}): those responses stop at "
                f"the cap and count in rollout/truncated; {longest}: set rollout.max_new_tokens to "
                f"{at_least}{fit.fitting_cap}",
            )
        ]
    return []


def _aliased(cfg: RunConfig, row: dict[str, Any]) -> dict[str, Any]:
    field = cfg.data.answer_field  # type: ignore[attr-defined]  # called where a data section is
    return {**row, "answer": row[field]} if field != "answer" and field in row else row


def _first_rows(files: Sequence[Source]) -> list[dict[str, Any]]:
    """The first ``LENGTH_ROWS`` rows of ``files`` that read (a file that does not is reported elsewhere)."""
    rows: list[dict[str, Any]] = []
    for file in files:
        if len(rows) >= LENGTH_ROWS:
            break
        if isinstance(file, str) and not Path(file).exists():
            continue
        try:
            rows += read_rows(file, limit=LENGTH_ROWS - len(rows))
        except UserError:
            continue
    return rows
