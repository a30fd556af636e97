"""``calculator``: multiplications a tiny model cannot do in its head, with a calculator tool it can call.

An episode (the built-in char model's whole context is 256 tokens, so every format is short)::

    317*46=                 the first observation: the problem (left_digits × right_digits, default 3 × 2)
    <calc>317*46</calc>     the model's tool call; the turn ends at the stop string ``</calc>``
    =14582\\n                the environment's answer (``=error\\n`` for a call it cannot evaluate)
    14582                   the model's final answer, ending at EOS

A turn without a complete ``<calc>…</calc>`` is the final answer: reward 1.0 when its last integer is the product
written canonically (``str(product)``: ``3874``, not ``03874`` or ``+3874``; stricter than the arithmetic task's
integer-valued rule, which a policy exploited by padding 4-digit products to 5 digits), else 0.0; a model still
calling the tool at its ``max_turns``-th turn gets 0.
The tool evaluates integer expressions with ``+ - *`` and parentheses by walking their syntax tree (never
``eval``): at most :data:`MAX_EXPRESSION_CHARS` characters, every intermediate result within ±:data:`MAX_RESULT`;
anything else is an error observation. ``info``: ``tool_calls``, ``correct``, ``turns``.

Problems are drawn per split from ``random.Random("calculator:<split>:<seed>")``; a problem belongs to the test
split when the CRC32 of its text is 0 mod 10, so the splits never share a problem.
"""

from __future__ import annotations

import ast
import operator
import random
import re
import zlib
from collections.abc import Sequence
from typing import ClassVar

from spinwheel.envs.base import Action, Env, Segment, Step
from spinwheel.tasks.arithmetic import extract_answer

MAX_EXPRESSION_CHARS = 40
MAX_RESULT = 10**15
_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_EXPRESSION_CHARS = re.compile(r"[0-9+\-*() ]+")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> int | None:
    """The value of an integer expression over ``+ - *`` and parentheses, or None (not one, too long, too large)."""
    if len(expression) > MAX_EXPRESSION_CHARS or not _EXPRESSION_CHARS.fullmatch(expression):
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return _value(tree.body)


def _value(node: ast.AST) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value: int | None = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _value(node.operand)
        value = None if inner is None else (-inner if isinstance(node.op, ast.USub) else inner)
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        value = None if left is None or right is None else _OPERATORS[type(node.op)](left, right)
    else:
        return None
    return value if value is not None and abs(value) <= MAX_RESULT else None


def answer_reward(text: str, product: int) -> float:
    """1.0 when the text's last integer is ``product`` written canonically (``str(product)``), else 0.0."""
    return float(extract_answer(text) == str(product))


def _operand_range(num_digits: int) -> tuple[int, int]:
    return (0 if num_digits == 1 else 10 ** (num_digits - 1), 10**num_digits - 1)


def _positive_int(name: str, value: object, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ValueError(f"{name} must be an integer in 1..{high}, got {value!r}")
    return value


class CalculatorEnv(Env):
    """Multi-turn: 3-digit × 2-digit products with a calculator tool, <calc>317*46</calc> -> =14582."""

    name: ClassVar[str] = "calculator"
    max_turns: ClassVar[int] = 3
    stop: ClassVar[Sequence[str]] = ("</calc>",)

    def __init__(self, split: str = "train", left_digits: int = 3, right_digits: int = 2, max_turns: int = 3) -> None:
        super().__init__(split)
        self.left_digits = _positive_int("left_digits", left_digits, 6)
        self.right_digits = _positive_int("right_digits", right_digits, 6)
        self.max_turns = _positive_int("max_turns", max_turns, 16)  # type: ignore[misc]  # this instance's
        self.answer: int | None = None
        self.turns = self.tool_calls = 0

    def problem(self, seed: int) -> tuple[int, int]:
        """The operands of episode ``seed`` of this split."""
        rng = random.Random(f"calculator:{self.split}:{seed}")
        (a_low, a_high), (b_low, b_high) = _operand_range(self.left_digits), _operand_range(self.right_digits)
        while True:  # rejection: about one draw in ten lands in the test split
            a, b = rng.randint(a_low, a_high), rng.randint(b_low, b_high)
            if (zlib.crc32(f"{a}*{b}".encode()) % 10 == 0) == (self.split == "test"):
                return a, b

    def reset(self, seed: int) -> str:
        a, b = self.problem(seed)
        self.answer, self.turns, self.tool_calls = a * b, 0, 0
        return f"{a}*{b}="

    def step(self, action: Action) -> Step:
        if self.answer is None:
            raise RuntimeError("CalculatorEnv.step before reset")
        self.turns += 1
        calls = _CALL.findall(action.text)
        if not calls:  # the final answer
            correct = answer_reward(action.text, self.answer)
            return Step(None, correct, True, self._info(correct))
        self.tool_calls += 1
        if self.turns >= self.max_turns:  # out of turns while still calling the tool
            return Step(None, 0.0, True, self._info(0.0))
        value = calculate(calls[-1])
        return Step("=error\n" if value is None else f"={value}\n", 0.0, False, self._info(0.0))

    def _info(self, correct: float) -> dict[str, float]:
        return {"tool_calls": float(self.tool_calls), "correct": correct, "turns": float(self.turns)}

    def expert(self, seed: int) -> list[Segment]:
        """Call the tool with the problem, then answer with its result."""
        a, b = self.problem(seed)
        return [
            Segment(f"{a}*{b}=", model=False),
            Segment(f"<calc>{a}*{b}</calc>", model=True),
            Segment(f"={a * b}\n", model=False),
            Segment(str(a * b), model=True),
        ]
