"""Answer extraction (spinwheel/envs/answers.py) on hand-written replies; reasoning-gym episodes scored through it."""

from __future__ import annotations

import pytest

from spinwheel.envs.answers import answer_tag, auto_extraction, boxed, extractor, last_number, tag_or_text
from spinwheel.envs.base import Action, EnvError
from spinwheel.envs.registry import load_env

BASIC = ["min_terms=2", "max_terms=2", "min_digits=1", "max_digits=1"]


def test_last_number_reads_the_final_number_of_a_sentence():
    cases = {
        "5 - 3 = 2. The answer is 2.": "2",
        "3 - 5 = -2": "-2",
        "x=-7.": "-7",
        "10-3": "3",  # a minus between digits is the operator, not the sign
        "(4)-3": "3",
        "There are 1,234 apples": "1234",
        "It is 4.0": "4",
        "2.50 dollars": "2.5",
        "-0": "0",
        "Answer: 12 apples and 7 pears": "7",
        "no digits here": None,
        "": None,
    }
    assert {text: last_number(text) for text in cases} == cases


def test_answer_tag_matches_reasoning_gyms_extract_answer():
    from reasoning_gym.utils import extract_answer

    replies = [
        "think <answer>42</answer>",
        "<answer> 7 </answer> then <answer>8</answer>",
        "<answer>\nline one\nline two\n</answer>",
        "no tag at all",
        "<answer>unclosed",
        "<answer></answer>",
    ]
    assert [answer_tag(r) for r in replies] == [extract_answer(r) for r in replies]
    assert [answer_tag(r) for r in replies] == ["42", "8", "line one\nline two", None, None, ""]


def test_boxed_tag_or_text_and_the_auto_rule():
    assert boxed(r"so \boxed{\frac{1}{2}} or \boxed{3}") == "3"
    assert boxed(r"we get \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert boxed(r"\boxed{1") is None and boxed("none") is None
    assert tag_or_text("  cat dog <answer>dog cat</answer> ") == "dog cat"
    assert tag_or_text("  cat dog \n") == "cat dog"
    assert auto_extraction(["1", "-28", "3.5", 4]) == "last-number"
    assert auto_extraction(["1", "cat"]) == "tag-or-text"
    assert auto_extraction([]) == "tag-or-text"
    assert extractor("none")("  The answer is 2. ") == "The answer is 2."
    with pytest.raises(ValueError, match="answer extraction must be one of auto, last-number"):
        extractor("first-number")


def _scores(env_factory, replies: list[str]) -> tuple[list[float], list[dict[str, float]]]:
    """The test split's episode 0 answered by each reply, scored through the environment's batched step."""
    envs = [env_factory("test") for _ in replies]
    for env in envs:
        env.reset(0)
    steps = type(envs[0]).step_batch(envs, [Action(r, []) for r in replies])
    return [s.reward for s in steps], [s.info for s in steps]


def test_reasoning_gym_episode_is_scored_on_the_extracted_answer():
    factory = load_env("reasoning-gym:basic_arithmetic", BASIC)
    env = factory("test")
    question = env.reset(0)
    answer = env.example["answer"]
    assert env.answer_extraction == "last-number"  # auto: the dataset's answers are numbers
    assert question == "Calculate 8 + -7." and answer == "1"
    replies = [f"8 + -7 = {answer}. So the answer is {answer}.", "8 + -7 = 3", "I do not know", answer]
    rewards, info = _scores(factory, replies)
    assert rewards == [1.0, 0.0, 0.0, 1.0]
    assert [i["correct"] for i in info] == [1.0, 0.0, 0.0, 1.0]
    assert [i["answered"] for i in info] == [1.0, 1.0, 0.0, 1.0]
    # without extraction (what spinwheel did before): the sentence earns only reasoning-gym's partial credit
    whole, _ = _scores(load_env("reasoning-gym:basic_arithmetic", BASIC, "none"), replies[:1])
    assert whole == [pytest.approx(len(answer) / len(replies[0].strip()))]
    tagged, _ = _scores(load_env("reasoning-gym:basic_arithmetic", BASIC, "answer-tag"), [f"<answer>{answer}</answer>"])
    assert tagged == [1.0]


def test_answer_extraction_is_refused_where_it_does_not_act():
    with pytest.raises(EnvError, match="--answer-extraction acts for --env reasoning-gym:NAME, not --env guess"):
        load_env("guess", (), "last-number")
    with pytest.raises(EnvError, match="disagree"):
        load_env("reasoning-gym:basic_arithmetic", [*BASIC, "answer_extraction=boxed"], "last-number")
    with pytest.raises(EnvError, match="answer extraction must be one of"):
        load_env("reasoning-gym:basic_arithmetic", [*BASIC, "answer_extraction=first"])
    from spinwheel.rl.llm import RLConfig

    with pytest.raises(ValueError, match="--answer-extraction acts for --env reasoning-gym:NAME"):
        RLConfig(model="test", env="guess", answer_extraction="boxed")
