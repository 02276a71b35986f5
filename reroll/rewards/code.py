"""Code rewards: run the response's program against the row's test cases in the sandbox.

The program is the last fenced ````python`` block of the response (after any ``</think>``). The
row's ``tests`` is a list of cases in one of two styles:

- stdin/stdout: ``{"stdin": "3 4\\n", "stdout": "7\\n"}``; outputs are compared line by line with
  trailing whitespace ignored. Each case is one sandboxed run.
- function call: ``{"call": "add(3, 4)", "expected": 7}``; the program is executed and the call's value
  compared with ``expected`` (JSON values; tuples compare as lists). All call cases share one run.

The score is the fraction of cases passed, or 0/1 with ``all_or_nothing``. Programs run in
bubblewrap (an unprivileged uid in its own namespaces, read-only files, no network, a seccomp
filter): docs/sandbox.md says what is enforced and measured. ``sandbox: audit_hook`` in the reward's args opts
into the weaker in-process guard where bubblewrap cannot be installed (a warning is logged).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from reroll.rewards.base import RewardResult
from reroll.rewards.math import final_answer_text
from reroll.rewards.sandbox import Limits, Sandbox, SandboxResult, run_python

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)

# Appended to the program for call-style cases: evaluate each call, write one JSON line per case
# to the results channel (a pipe the parent reads; the sandbox has no path to it).
_CALL_HARNESS = """

def __reroll_cases():
    import json as _json, os as _os
    with open(int(_os.environ["REROLL_RESULTS_FD"]), "w") as _out:
        for _i, _call in enumerate({calls!r}):
            try:
                _value = _json.loads(_json.dumps(eval(_call)))
                _out.write(_json.dumps({{"i": _i, "value": _value}}) + "\\n")
            except BaseException as _e:
                _out.write(_json.dumps({{"i": _i, "error": type(_e).__name__}}) + "\\n")
            _out.flush()
__reroll_cases()
"""


def extract_program(response: str) -> str | None:
    """The last fenced python block of the response's final answer, or None if there is none."""
    text = final_answer_text(response)
    blocks = _FENCE.findall(text or "")
    return blocks[-1] if blocks else None


def code_tests(
    prompt: str,
    response: str,
    sample: Mapping[str, Any],
    *,
    all_or_nothing: bool = False,
    cpu_s: int = 5,
    wall_s: float = 10.0,
    memory_mb: int = 1024,
    max_output_bytes: int = 1 << 20,
    sandbox: Sandbox = "bubblewrap",
) -> RewardResult:
    """Fraction of ``sample["tests"]`` the response's program passes (0/1 with ``all_or_nothing``).

    details: ``passed`` (fraction), ``correct`` 0/1 (all passed), ``no_code`` 0/1, and per-outcome
    counts ``timeouts``, ``memory``, ``output_limit``, ``errors`` over the runs. ``sandbox``:
    ``bubblewrap`` (default; ``SandboxUnavailable`` names the fix if it cannot run) or ``audit_hook``.
    """
    tests = sample["tests"]
    if isinstance(tests, str):
        tests = json.loads(tests)
    if not tests:
        raise ValueError("code_tests: the row's tests list is empty")
    program = extract_program(response)
    counts = {"timeouts": 0, "memory": 0, "output_limit": 0, "errors": 0}
    if program is None:
        return RewardResult(0.0, {"passed": 0.0, "correct": 0, "no_code": 1, **counts})
    limits = Limits(cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes)
    io_cases = [t for t in tests if "stdin" in t or "stdout" in t]
    call_cases = [t for t in tests if "call" in t]
    if len(io_cases) + len(call_cases) != len(tests):
        raise ValueError(f"code_tests: each test needs 'stdin'/'stdout' or 'call'/'expected'; got {tests!r}")
    passed = 0
    for case in io_cases:
        run = run_python(program, str(case.get("stdin", "")), limits=limits, sandbox=sandbox)
        _count(counts, run)
        passed += int(run.status == "ok" and _same_output(run.stdout, str(case.get("stdout", ""))))
    if call_cases:
        passed += _run_calls(program, call_cases, limits, counts, sandbox)
    fraction = passed / len(tests)
    correct = int(passed == len(tests))
    score = float(correct) if all_or_nothing else fraction
    return RewardResult(score, {"passed": fraction, "correct": correct, "no_code": 0, **counts})


def _run_calls(
    program: str, cases: Sequence[Mapping[str, Any]], limits: Limits, counts: dict, sandbox: Sandbox
) -> int:
    harness = _CALL_HARNESS.format(calls=[str(c["call"]) for c in cases])
    run = run_python(program + harness, "", limits=limits, as_main=False, sandbox=sandbox)
    _count(counts, run)
    got = {}
    for line in run.results.splitlines():
        try:
            row = json.loads(line)
            got[int(row["i"])] = row
        except (ValueError, KeyError, TypeError):  # a truncated or forged line: that case failed
            continue
    expected = [json.loads(json.dumps(c.get("expected"))) for c in cases]
    return sum(i in got and "value" in got[i] and got[i]["value"] == want for i, want in enumerate(expected))


def _count(counts: dict, run: SandboxResult) -> None:
    key = {"timeout": "timeouts", "memory": "memory", "output_limit": "output_limit", "error": "errors"}
    if run.status in key:
        counts[key[run.status]] += 1


def _same_output(got: str, want: str) -> bool:
    norm = lambda s: [line.rstrip() for line in s.strip().splitlines()]  # noqa: E731
    return norm(got) == norm(want)
