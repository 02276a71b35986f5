"""Arithmetic questions answered with tools: a calculator and a sandboxed Python.

Each seed draws a question such as ``What is (37 * 24 + 15) / 3?``. The policy may call the tools
(``reroll.envs.tools``: ``calculator``, ``python``) and ends the episode with ``<answer>...</answer>``
(or ``\\boxed{...}``), which ``reroll.rewards.math.math_verify`` checks against the exact value:
reward 1 if equal, else 0. A turn with neither a tool call nor an answer gets a reminder.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from reroll.envs.tools import Calculator, PythonTool, ToolEnv, ToolFormat
from reroll.rewards.math import math_verify

_ANSWER = re.compile(r"<answer>(.*?)</answer>|\\boxed\{([^{}]*)\}", re.DOTALL)


class MathQuestions:
    """The inner environment: a question, then one final answer."""

    def __init__(self, max_operand: int = 99, num_ops: int = 3) -> None:
        if max_operand < 2 or num_ops < 1:
            raise ValueError(
                f"tool_math: max_operand ({max_operand}) >= 2 and num_ops ({num_ops}) >= 1 needed"
            )
        self.max_operand, self.num_ops = max_operand, num_ops
        self.expression, self.answer = "", ""
        self._agent_rng = random.Random(1)

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        self._agent_rng = random.Random(None if seed is None else seed + 1)
        expr = str(rng.randint(2, self.max_operand))
        for _ in range(self.num_ops):
            op = rng.choice("+-*/")
            expr = (
                f"({expr} {op} {rng.randint(2, self.max_operand)})"
                if op in "*/"
                else f"{expr} {op} {rng.randint(2, self.max_operand)}"
            )
        self.expression = expr
        self.answer = Calculator()(expr)
        question = (
            f"What is {expr}? Give the exact value (a fraction if needed) as <answer>...</answer>. "
            "You may call the tools calculator and python."
        )
        return question, {"answer": self.answer}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        m = _ANSWER.search(action)
        if m is None:
            return "no answer found: call a tool, or answer as <answer>...</answer>", 0.0, False, False, {}
        given = (m.group(1) if m.group(1) is not None else m.group(2)).strip()
        score = math_verify("", given, {"answer": self.answer}, think=False).score
        return f"answer {'correct' if score else 'wrong'}", score, True, False, {"success": score > 0}

    def sample_random_action(self) -> str:
        return f"<answer>{self._agent_rng.randint(-self.max_operand, self.max_operand**2)}</answer>"


class ToolMath(ToolEnv):
    """``MathQuestions`` with the calculator and Python tools; see the module docstring."""

    def __init__(
        self,
        max_operand: int = 99,
        num_ops: int = 3,
        tools: tuple[str, ...] = ("calculator", "python"),
        tool_format: ToolFormat = "hermes",
        tag: str = "tool_call",
        max_tool_calls: int = 4,
    ) -> None:
        made = {"calculator": Calculator, "python": PythonTool}
        unknown = [t for t in tools if t not in made]
        if unknown:
            raise ValueError(f"tool_math: unknown tool {unknown[0]!r}; the tools are {', '.join(made)}")
        inner = MathQuestions(max_operand, num_ops)
        super().__init__(
            inner, [made[t]() for t in tools], fmt=tool_format, tag=tag, max_calls=max_tool_calls
        )
        self.questions = inner

    def _call_text(self, name: str, arguments: dict[str, Any]) -> str:
        body = json.dumps({"name": name, "arguments": arguments})
        return f"<{'tool_call' if self.fmt == 'hermes' else self.tag}>{body}</{'tool_call' if self.fmt == 'hermes' else self.tag}>"

    def sample_random_action(self) -> str:
        """A calculator call on the question's expression, a Python call, or a random answer."""
        rng = self.questions._agent_rng
        pick = rng.random()
        if pick < 0.3 and "calculator" in self.tools:
            return self._call_text("calculator", {"expression": self.questions.expression})
        if pick < 0.5 and "python" in self.tools:
            return self._call_text("python", {"code": f"print({rng.randint(0, 99)})"})
        return self.questions.sample_random_action()

    def scripted_action(self) -> str:
        """Ask the calculator first, then answer with what it returned."""
        if not self.last_results:
            return self._call_text("calculator", {"expression": self.questions.expression})
        return f"<answer>{self.last_results[-1]}</answer>"
