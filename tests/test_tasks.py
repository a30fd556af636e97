"""Arithmetic task: splits (disjoint, seeded), answers against Python's own arithmetic, reward and evaluate."""

from __future__ import annotations

import argparse
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spinwheel.config import add_arguments, from_args
from spinwheel.tasks import ArithmeticConfig, ArithmeticTask, Example, evaluate, extract_answer, reward
from spinwheel.tasks.arithmetic import canonical_integer

PROMPT = re.compile(r"^(\d+)([+\-*])(\d+)=$")


def small(**kwargs) -> ArithmeticConfig:
    return ArithmeticConfig(**{"num_train": 300, "num_test": 50, **kwargs})


def check_examples(examples: list[Example], config: ArithmeticConfig) -> None:
    """Each prompt is ``a op b=`` with operands in range, and its answer is what Python computes."""
    for ex in examples:
        m = PROMPT.match(ex.prompt)
        assert m, ex.prompt
        a, op, b = int(m[1]), m[2], int(m[3])
        assert 0 <= a < 10**config.num_digits and 0 <= b < 10**config.num_digits
        assert op in config.operators
        # str(int(...)) keeps the reference canonical ("-12", never "-012"); eval is safe on this matched prompt.
        assert ex.answer == str(eval(ex.prompt[:-1])), ex  # noqa: S307


# --- config ------------------------------------------------------------------------------------------------


def test_default_config_builds_the_documented_splits():
    task = ArithmeticTask()
    assert len(task.train) == 8000 and len(task.test) == 500
    check_examples(task.train[:200] + task.test[:200], task.config)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_digits": 0}, "num_digits must be an integer in 1..9"),
        ({"num_digits": 10}, "num_digits must be an integer in 1..9"),
        ({"operators": ()}, "operators must not be empty"),
        ({"operators": ("+", "/")}, r"unknown operators \['/'\]"),
        ({"operators": "+-"}, "got the string"),
        ({"operators": ("+", "+")}, "operators must be distinct"),
        ({"num_train": 0}, "num_train must be an integer >= 1"),
        ({"num_test": 0}, "num_test must be an integer >= 1"),
        ({"num_digits": 1, "num_train": 95, "num_test": 6}, r"101 exceeds the 100 distinct problems.*lower num_train"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticConfig(**kwargs)


def test_config_round_trips_through_cli_options():
    parser = argparse.ArgumentParser()
    add_arguments(parser, ArithmeticConfig)
    ns = parser.parse_args(["--num-digits", "3", "--operators", "+", "*", "--num-train", "10", "--seed", "4"])
    config = from_args(ArithmeticConfig, ns)
    assert config == ArithmeticConfig(num_digits=3, operators=("+", "*"), num_train=10, seed=4)


# --- splits --------------------------------------------------------------------------------------------------


def test_splits_are_disjoint_and_without_duplicates():
    task = ArithmeticTask(small(operators=("+", "-", "*")))
    train, test = {ex.prompt for ex in task.train}, {ex.prompt for ex in task.test}
    assert len(train) == 300 and len(test) == 50
    assert not train & test


def test_small_space_is_used_up_exactly():
    # 1 digit, one operator: 100 problems, all of them assigned.
    task = ArithmeticTask(ArithmeticConfig(num_digits=1, num_train=90, num_test=10))
    prompts = {ex.prompt for ex in task.train + task.test}
    assert prompts == {f"{a}+{b}=" for a in range(10) for b in range(10)}


def test_large_space_samples_unique_problems():
    # 9 digits: 10**18 problems per operator, drawn by rejection rather than enumerated.
    config = small(num_digits=9, operators=("-", "*"))
    task = ArithmeticTask(config)
    prompts = [ex.prompt for ex in task.train + task.test]
    assert len(set(prompts)) == len(prompts) == 350
    check_examples(task.train + task.test, config)
    # Uniform operands up to 10**9: nearly all have 9 digits, so short ones would betray a biased draw.
    assert sum(len(PROMPT.match(p)[1]) >= 8 for p in prompts) > 300


def test_splits_are_deterministic_and_differ_across_seeds():
    a, b, c = ArithmeticTask(small(seed=1)), ArithmeticTask(small(seed=1)), ArithmeticTask(small(seed=2))
    assert a.train == b.train and a.test == b.test
    assert a.train != c.train and a.test != c.test


@pytest.mark.parametrize("num_digits", [2, 9])
def test_test_split_does_not_depend_on_num_train(num_digits):
    short = ArithmeticTask(small(num_digits=num_digits, num_train=10))
    long = ArithmeticTask(small(num_digits=num_digits, num_train=300))
    assert short.test == long.test
    assert long.train[:10] == short.train


def test_splits_use_no_global_rng():
    import random

    random.seed(123)
    state = random.getstate()
    ArithmeticTask(small())
    assert random.getstate() == state


# --- answers -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["+", "-", "*"])
def test_answers_for_each_operator(op):
    config = small(operators=(op,))
    task = ArithmeticTask(config)
    check_examples(task.train + task.test, config)
    assert all(ex.prompt[:-1].count(op) == 1 for ex in task.train)


def test_subtraction_answers_can_be_negative():
    task = ArithmeticTask(small(operators=("-",)))
    answers = [int(ex.answer) for ex in task.train]
    assert min(answers) < 0 < max(answers)
    for ex in task.train:
        a, _, b = PROMPT.match(ex.prompt).groups()
        assert ex.answer.startswith("-") == (int(a) < int(b)), ex


@settings(max_examples=40, deadline=None)
@given(
    num_digits=st.integers(1, 9),
    operators=st.lists(st.sampled_from(["+", "-", "*"]), min_size=1, max_size=3, unique=True),
    seed=st.integers(0, 2**32),
)
def test_answers_match_python_arithmetic(num_digits, operators, seed):
    config = ArithmeticConfig(num_digits=num_digits, operators=tuple(operators), num_train=20, num_test=5, seed=seed)
    task = ArithmeticTask(config)
    check_examples(task.train + task.test, config)


# --- extract_answer and reward -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("46", "46"),
        ("46\n", "46"),
        ("The answer is 46.", "46"),
        ("12+34=46", "46"),
        ("3-15=-12", "-12"),
        ("-12", "-12"),
        ("abc", None),
        ("", None),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("The answer is 46", "46", 1.0),
        ("46\n", "46", 1.0),
        ("046", "46", 1.0),
        ("-12", "-12", 1.0),
        ("12", "-12", 0.0),
        ("46 or maybe 47", "46", 0.0),  # the last integer is the final answer
        ("4 6", "46", 0.0),
        ("abc", "46", 0.0),
        ("", "0", 0.0),
    ],
)
def test_reward(completion, answer, expected):
    assert reward(completion, answer) == expected


def test_reward_rejects_non_integer_answer():
    with pytest.raises(ValueError, match="integer answers; got answer '3.5'"):
        reward("3.5", "3.5")


@given(st.integers(-(10**12), 10**12), st.text(alphabet="abc =.\n", max_size=10))
def test_reward_of_any_integer_after_text(n, prefix):
    assert reward(f"{prefix} {n}", str(n)) == 1.0
    assert reward(f"{prefix} {n + 1}", str(n)) == 0.0


def test_reward_compares_integers_past_the_digit_limit():
    """int() refuses more than 4300 digits: a long answer or completion is compared, never a crash mid-run."""
    long = "9" * 5000
    assert reward(f"it is {long}", "00" + long) == 1.0
    assert reward(long + "8", long) == 0.0
    assert reward(long, "12") == 0.0
    with pytest.raises(ValueError, match=r"got answer '9{40}\.\.\. \(5001 characters\)'"):
        reward("1", long + "x")


@given(st.integers(-(10**30), 10**30), st.sampled_from(["", "0", "00"]), st.sampled_from(["", "+", " ", " +"]))
def test_canonical_integer_is_int_as_text(n, zeros, before):
    text = ("-" if n < 0 else before) + zeros + str(abs(n)) + " "
    assert canonical_integer(text) == str(int(text)) == str(n)


# --- evaluate ------------------------------------------------------------------------------------------------------


def test_evaluate_perfect_and_broken_generate():
    examples = ArithmeticTask(small(operators=("+", "-"))).test
    calls = []

    def perfect(prompts: list[str]) -> list[str]:
        calls.append(len(prompts))
        return [f" {eval(p[:-1])}" for p in prompts]  # noqa: S307

    result = evaluate(perfect, examples, batch_size=16)
    assert result.exact_match == 1.0 and result.num_examples == 50
    assert calls == [16, 16, 16, 2]
    assert result.samples == [(ex.prompt, f" {ex.answer}", ex.answer) for ex in examples[:8]]

    broken = evaluate(lambda prompts: ["I don't know"] * len(prompts), examples)
    assert broken.exact_match == 0.0 and broken.num_examples == 50
    assert broken.samples[0] == (examples[0].prompt, "I don't know", examples[0].answer)


def test_evaluate_counts_partial_accuracy():
    examples = [Example("1+1=", "2"), Example("2+2=", "4"), Example("3+3=", "6"), Example("4+4=", "8")]
    result = evaluate(lambda prompts: ["2", "5", "6", "x"], examples)
    assert result.exact_match == 0.5


def test_evaluate_rejects_wrong_number_of_completions():
    examples = [Example("1+1=", "2"), Example("2+2=", "4")]
    with pytest.raises(ValueError, match="returned 1 completions for 2 prompts"):
        evaluate(lambda prompts: ["2"], examples)
    with pytest.raises(ValueError, match="at least one example"):
        evaluate(lambda prompts: prompts, [])
