"""Environments (spinwheel.envs): the built-ins' episodes on fixed seeds, their experts replayed for full reward,
``--env`` / ``--env-arg`` loading and its one-line errors, and the reasoning-gym adapter (skipped when absent)."""

from __future__ import annotations

import pytest

from spinwheel.envs import BUILTINS, Action, EnvError, load_env, parse_env_args, step_batch
from spinwheel.envs.calculator import MAX_RESULT, CalculatorEnv, calculate
from spinwheel.envs.expert import replay
from spinwheel.envs.guess import GuessEnv
from spinwheel.envs.registry import parse_value
from spinwheel.tasks.arithmetic import ArithmeticConfig, ArithmeticTask


def act(text: str) -> Action:
    return Action(text, [])


def test_arithmetic_env_serves_the_task_splits_and_its_reward():
    make = load_env("arithmetic", ["num_digits=1", "num_train=60", "num_test=10", "operators=+,-"])
    task = ArithmeticTask(ArithmeticConfig(num_digits=1, operators=("+", "-"), num_train=60, num_test=10))
    env = make("train")
    assert env.reset(63) == task.train[3].prompt  # split[seed % len(split)]
    step = env.step(act(f"so {task.train[3].answer}"))
    assert (step.observation, step.reward, step.done, step.info) == (None, 1.0, True, {"correct": 1.0})
    env.reset(3)
    assert env.step(act("nope")).reward == 0.0
    test = make("test")
    assert test.reset(0) == task.test[0].prompt
    calc = CalculatorEnv()
    calc.reset(0)
    envs = [make("train"), calc, make("train")]
    prompts = [envs[0].reset(0), envs[2].reset(1)]
    steps = step_batch(envs, [act(task.train[0].answer), act("<calc>1+1</calc>"), act("x")])  # in order
    assert [(s.reward, s.done, s.observation) for s in steps] == [(1.0, True, None), (0.0, False, "=2\n"),
                                                                   (0.0, True, None)]  # fmt: skip
    assert prompts == [task.train[0].prompt, task.train[1].prompt]
    assert replay(make("test"), 4, test.expert(4)) == (1.0, {"correct": 1.0})


def test_calculate_is_integer_arithmetic_and_refuses_everything_else():
    assert [calculate(e) for e in ("317*46", "(1+2)*3", "-5+2", " 7 - 10 ")] == [14582, 9, -3, -3]
    big = "9" * 8
    refused = ["1/2", "2**9", "", "01", "__import__('os')", "a*b", "1" * 50, f"{big}*{big}*{big}", "((((("]
    assert [calculate(e) for e in refused] == [None] * len(refused)
    assert calculate(str(MAX_RESULT)) == MAX_RESULT and calculate(f"{MAX_RESULT}+1") is None


def test_calculator_episode_with_a_tool_call():
    env = CalculatorEnv()
    prompt = env.reset(0)
    a, b = (int(x) for x in prompt.rstrip("=").split("*"))
    assert 100 <= a <= 999 and 10 <= b <= 99
    step = env.step(act(f"<calc>{a}*{b}</calc>"))
    assert (step.observation, step.reward, step.done) == (f"={a * b}\n", 0.0, False)
    step = env.step(act(str(a * b)))
    assert (step.reward, step.done, step.info) == (1.0, True, {"tool_calls": 1.0, "correct": 1.0, "turns": 2.0})
    env.reset(0)
    assert env.step(act("<calc>2**64</calc>")).observation == "=error\n"  # a bad call is an observation
    assert env.step(act("<calc>1/0</calc>")).observation == "=error\n"
    last = env.step(act("<calc>1+1</calc>"))  # the third turn is the last: still calling the tool earns 0
    assert (last.reward, last.done, last.info["tool_calls"], last.info["correct"]) == (0.0, True, 3.0, 0.0)
    env.reset(1)
    assert env.step(act("12")).info == {"tool_calls": 0.0, "correct": 0.0, "turns": 1.0}
    product = env.answer
    for answer, reward in [(f"{product}", 1.0), (f"=> {product}", 1.0), (f"0{product}", 0.0), (f"{product}0", 0.0)]:
        env.reset(1)
        assert env.step(act(answer)).reward == reward, answer  # the canonical form only: no leading zero


def test_calculator_expert_is_right_and_splits_are_disjoint():
    make = load_env("calculator", ["left_digits=2", "right_digits=1", "max_turns=2"])
    problems = {}
    for split in ("train", "test"):
        for seed in range(30):
            segments = make(split).expert(seed)
            assert [s.model for s in segments] == [False, True, False, True]
            reward, info = replay(make(split), seed, segments)
            assert (reward, info["correct"], info["tool_calls"]) == (1.0, 1.0, 1.0)
            problems.setdefault(split, set()).add(segments[0].text)
    assert len(problems["train"]) > 20 and not problems["train"] & problems["test"]
    assert make("train").reset(7) == make("train").reset(7) != make("test").reset(7)


def test_guess_hints_reward_and_expert():
    env = GuessEnv(n=16, max_turns=6)
    target = env.hidden(3)
    assert env.reset(3) == "guess 1-16\n"
    low, high = (target - 1 or target + 1), target  # a wrong guess, then the number
    step = env.step(act(f"{low}\n"))
    assert step.observation == ("higher\n" if low < target else "lower\n") and not step.done
    assert env.step(act("no idea\n")).observation == "?\n"
    step = env.step(act(f"{high}\n"))
    assert (step.reward, step.done, step.info) == (1 - 2 / 6, True, {"turns": 3.0, "found": 1.0})
    for seed in range(16):
        segments = env.expert(seed)
        turns = sum(s.model for s in segments)
        assert turns <= 5 and replay(GuessEnv(), seed, segments) == (1 - (turns - 1) / 6, {"turns": turns, "found": 1})
    env = GuessEnv(n=16, max_turns=2)
    env.reset(0)
    wrong = 1 if env.target != 1 else 2
    steps = [env.step(act(f"{wrong}\n")) for _ in range(2)]
    assert (steps[-1].reward, steps[-1].done, steps[-1].info) == (0.0, True, {"turns": 2.0, "found": 0.0})


def test_env_args_are_typed():
    assert [parse_value(v) for v in ("3", "-2", "0.5", "1e3", "true", "False", "+,-", "")] == [
        3, -2, 0.5, 1000.0, True, False, "+,-", ""
    ]  # fmt: skip
    assert parse_env_args(["max-turns=4", "name=a=b"]) == {"max_turns": 4, "name": "a=b"}


USER_MODULE = """
from spinwheel.envs import Env, Step

class Echo(Env):
    name = "echo"
    def __init__(self, split="train", **options):
        super().__init__(split)
        self.options = options
    def reset(self, seed):
        return f"say {seed}"
    def step(self, action):
        return Step(None, float(action.text == "ok"), True)

class NoStep:
    def reset(self, seed):
        return ""

class Broken(Env):
    def __init__(self, split="train"):
        raise RuntimeError("no sandbox\\nhere")
    def reset(self, seed):
        return ""
    def step(self, action):
        return None

def not_a_class():
    pass
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_envs_t23.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_envs_t23"


def test_user_class_gets_typed_options(user_module):
    make = load_env(f"{user_module}:Echo", ["k=3", "flag=true", "rate=0.5", "who=x"])
    env = make("test")
    assert env.split == "test" and env.options == {"k": 3, "flag": True, "rate": 0.5, "who": "x"}
    assert env.reset(5) == "say 5" and env.step(act("ok")).reward == 1.0


@pytest.mark.parametrize(
    "spec, args, message",
    [
        ("nope", [], "--env nope: no built-in environment 'nope'; the built-ins: " + ", ".join(BUILTINS)),
        ("calculator", ["digits=3"], "has no option 'digits' (its options: left_digits, right_digits, max_turns)"),
        ("calculator", ["left_digits=0"], "building the environment raised ValueError: left_digits must be"),
        ("guess", ["n"], "--env-arg 'n': expected key=value"),
        ("guess", ["n=3", "n=4"], "--env-arg n given twice"),
        ("dataset", [], "needs --env-arg data=PATH"),
        ("no_such_module_t23:Env", [], "cannot import 'no_such_module_t23' (ModuleNotFoundError"),
        ("{mod}:Missing", [], "has no class 'Missing'"),
        ("{mod}:NoStep", [], "is not an environment (it has no step method); subclass spinwheel.envs.Env"),
        ("{mod}:not_a_class", [], "is not an environment"),
        ("{mod}:Broken", [], "building the environment raised RuntimeError: no sandbox here"),
    ],
)
def test_load_errors_are_one_line(user_module, spec, args, message):
    with pytest.raises(EnvError) as info:
        load_env(spec.format(mod=user_module), args)
    text = str(info.value)
    assert message in text and "\n" not in text


def test_reasoning_gym_adapter():
    pytest.importorskip("reasoning_gym")
    options = ["min_terms=2", "max_terms=2", "max_digits=2"]
    make = load_env("reasoning-gym:chain_sum", options)
    env = make("train")
    question = env.reset(3)
    assert question.endswith("=") and question == make("train").reset(3) != make("test").reset(3)
    segments = env.expert(3)
    assert replay(make("train"), 3, segments) == (1.0, {"correct": 1.0, "answered": 1.0})
    env.reset(3)
    assert env.step(act("twelve")).reward == 0.0
    for spec, args, message in [
        ("reasoning-gym:chain_sum", ["colour=2"], "has no option 'colour'"),
        ("reasoning-gym:no_such_task", [], "reasoning-gym has no dataset 'no_such_task'; it has: "),
        ("reasoning-gym:chain_sum", ["min_terms=3", "max_terms=2"], "raised AssertionError: max_terms must be"),
    ]:
        with pytest.raises(EnvError, match="^--env"):
            load_env(spec, args)
        try:
            load_env(spec, args)
        except EnvError as e:
            assert message in str(e) and "\n" not in str(e)
