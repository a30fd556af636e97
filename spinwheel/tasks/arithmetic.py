"""A seeded, verifiable arithmetic task: prompts like ``"12+34="``, answers like ``"46"``.

The built-in task for SFT and RL smoke runs: problems are cheap to generate, the reward is exact (the last
integer in a completion must equal the answer), and a tiny model can learn it on a CPU. Splits are
deterministic for a seed and disjoint by problem string.

Problems are numbered ``0 .. num_problems - 1`` (operator-major, then the left operand, then the right one)
and the split is a random sequence of distinct numbers drawn with ``random.Random(seed)``: the first
``num_test`` form the test set and the next ``num_train`` the training set, so changing ``num_train`` leaves
the test set unchanged and runs with different training budgets stay comparable.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from spinwheel.config import option

OPERATORS: tuple[str, ...] = ("+", "-", "*")

# Up to this many problems the space is enumerated and shuffled; above it, unique problems are drawn by
# rejection. The choice depends on the problem space only, never on how many are drawn, so a longer draw
# always extends a shorter one. (Rejection slows down only when nearly all of a large space is asked for.)
_ENUMERATE_LIMIT = 1 << 16

_INTEGER = re.compile(r"-?\d+")
_CANONICAL = re.compile(r"\s*([+-]?)0*([0-9]+)\s*")


@dataclass
class ArithmeticConfig:
    """Arithmetic task: operands, operators, split sizes and seed."""

    num_digits: int = option(2, help="max digits of each operand; operands are drawn from 0 .. 10**num_digits - 1")
    operators: tuple[str, ...] = option(("+",), help="operators to use, a subset of + - *")
    num_train: int = option(8000, help="number of training problems")
    num_test: int = option(500, help="number of held-out test problems")
    seed: int = option(0, help="seed of the split (random.Random)")

    def __post_init__(self) -> None:
        if isinstance(self.num_digits, bool) or not isinstance(self.num_digits, int) or not 1 <= self.num_digits <= 9:
            raise ValueError(f"num_digits must be an integer in 1..9, got {self.num_digits!r}")
        if isinstance(self.operators, str):
            # tuple("+-") would silently split the string; ask for the explicit form instead.
            raise ValueError(f"operators must be a tuple of strings like ('+', '-'), got the string {self.operators!r}")
        self.operators = tuple(self.operators)
        if not self.operators:
            raise ValueError(f"operators must not be empty; choose from {' '.join(OPERATORS)}")
        unknown = [op for op in self.operators if op not in OPERATORS]
        if unknown:
            raise ValueError(f"unknown operators {unknown}; choose from {' '.join(OPERATORS)}")
        if len(set(self.operators)) != len(self.operators):
            raise ValueError(f"operators must be distinct, got {self.operators}")
        for name in ("num_train", "num_test"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_train + self.num_test > self.num_problems:
            raise ValueError(
                f"num_train + num_test = {self.num_train + self.num_test} exceeds the {self.num_problems} distinct "
                f"problems with num_digits={self.num_digits} and operators={self.operators}; lower num_train or "
                f"num_test, or raise num_digits or add operators"
            )

    @property
    def num_problems(self) -> int:
        """Number of distinct problem strings: one per (operator, left operand, right operand)."""
        return len(self.operators) * (10**self.num_digits) ** 2


@dataclass(frozen=True)
class Example:
    """One problem: ``prompt`` is ``"12+34="``, ``answer`` the integer result as text (also the SFT completion)."""

    prompt: str
    answer: str


@dataclass
class EvalResult:
    """Exact-match accuracy over ``num_examples``; ``samples`` holds the first (prompt, completion, answer)."""

    exact_match: float
    num_examples: int
    samples: list[tuple[str, str, str]] = field(default_factory=list)


def _apply(op: str, a: int, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


def _draw_indices(num_problems: int, count: int, rng: random.Random) -> list[int]:
    """``count`` distinct problem numbers from ``range(num_problems)`` in random order."""
    if num_problems <= _ENUMERATE_LIMIT:
        indices = list(range(num_problems))
        rng.shuffle(indices)
        return indices[:count]
    # Sparse draw: above the limit count is usually a small fraction of the space, so few draws are rejected;
    # validation caps count at num_problems, so the loop ends.
    seen: set[int] = set()
    indices = []
    while len(indices) < count:
        i = rng.randrange(num_problems)
        if i not in seen:
            seen.add(i)
            indices.append(i)
    return indices


class ArithmeticTask:
    """Disjoint, seeded train/test splits of arithmetic problems (see the module docstring)."""

    def __init__(self, config: ArithmeticConfig | None = None) -> None:
        self.config = config if config is not None else ArithmeticConfig()
        cfg = self.config
        indices = _draw_indices(cfg.num_problems, cfg.num_test + cfg.num_train, random.Random(cfg.seed))
        examples = [self._example(i) for i in indices]
        self.test: list[Example] = examples[: cfg.num_test]
        self.train: list[Example] = examples[cfg.num_test :]

    def _example(self, index: int) -> Example:
        base = 10**self.config.num_digits
        op_index, pair = divmod(index, base * base)
        a, b = divmod(pair, base)
        op = self.config.operators[op_index]
        return Example(prompt=f"{a}{op}{b}=", answer=str(_apply(op, a, b)))


def extract_answer(completion: str) -> str | None:
    """The final answer in a completion: its last integer (``-?\\d+``), or None when it has none.

    >>> extract_answer("The answer is 46.")
    '46'
    >>> extract_answer("3-15=-12")
    '-12'
    """
    matches = _INTEGER.findall(completion)
    return matches[-1] if matches else None


def canonical_integer(text: str) -> str:
    """An integer written as ``int()`` reads it (sign, leading zeros, spaces), as canonical decimal text — also
    past ``int()``'s digit limit, so a 5000-digit answer or completion compares instead of raising.

    >>> canonical_integer(" -046 "), canonical_integer("-0"), canonical_integer("1_000")
    ('-46', '0', '1000')
    """
    m = _CANONICAL.fullmatch(text)
    if m is None:
        return str(int(text))  # other spellings int() takes: underscores, non-ASCII digits; ValueError otherwise
    sign, digits = m.groups()
    return ("-" if sign == "-" and digits != "0" else "") + digits


def reward(completion: str, answer: str) -> float:
    """1.0 when the completion's final integer equals ``answer`` (compared as integers, so "046" == "46"), else 0.0."""
    try:
        target = canonical_integer(answer)
    except ValueError:
        shown = answer if len(answer) <= 40 else answer[:40] + f"... ({len(answer)} characters)"
        raise ValueError(f"reward() compares integer answers; got answer {shown!r}") from None
    found = extract_answer(completion)
    try:
        return 1.0 if found is not None and canonical_integer(found) == target else 0.0
    except ValueError:  # a runaway number of non-ASCII digits past int()'s limit: not the answer
        return 0.0


def evaluate(
    generate: Callable[[list[str]], list[str]],
    examples: Sequence[Example],
    batch_size: int = 256,
    score: Callable[[str, str], float] | None = None,
) -> EvalResult:
    """Mean ``score`` (default: :func:`reward`, exact match of the answer) of ``generate`` (prompts -> completions)
    on ``examples`` (anything with ``prompt`` and ``answer``), in batches of ``batch_size``."""
    score = score or reward
    if not examples:
        raise ValueError("evaluate() needs at least one example")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    num_correct = 0.0
    samples: list[tuple[str, str, str]] = []
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        completions = generate([ex.prompt for ex in batch])
        if len(completions) != len(batch):
            raise ValueError(f"generate returned {len(completions)} completions for {len(batch)} prompts")
        for ex, completion in zip(batch, completions):
            num_correct += score(completion, ex.answer)
            if len(samples) < 8:
                samples.append((ex.prompt, completion, ex.answer))
    return EvalResult(exact_match=num_correct / len(examples), num_examples=len(examples), samples=samples)
