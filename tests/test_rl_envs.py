"""The RL loop on environments: multi-turn episodes (calculator, guess) through every step, token-in/token-out at the
loop level (the trainer's log-probs equal the engine's on every sampled token), failing environments dropped and
counted or stopping the run with one line, and the ``--env`` options' one-line errors."""

from __future__ import annotations

import pytest
from helpers import small_config

from spinwheel.envs import EnvError
from spinwheel.rl.llm import train_rl
from spinwheel.train.metrics import read_metrics

FLAKY_ENV = '''
from spinwheel.envs import Env, Step

class Flaky(Env):
    """Resets fail for the seeds in `bad` (every seed when bad < 0)."""
    max_turns = 2

    def __init__(self, split="train", bad=-1):
        super().__init__(split)
        self.bad = bad

    def reset(self, seed):
        if self.bad < 0 or seed % 4 < self.bad:
            raise RuntimeError("the sandbox is down")
        return "1+1="

    def step(self, action):
        return Step("ok\\n", 0.5, len(action.token_ids) % 2 == 0, {"length": len(action.token_ids)})
'''


def _env_config(tmp_path, env: str, *args: str, **kw):
    base = dict(data=None, reward="task", env=env, env_arg=tuple(args), steps=2, max_new_tokens=6, beta=0.0)
    return small_config(tmp_path / "run", **{**base, **kw})


@pytest.mark.parametrize("env", ["calculator", "guess"])
def test_multi_turn_episodes_train_and_their_tokens_are_what_the_engine_sampled(tmp_path, env):
    result = train_rl(_env_config(tmp_path, env, eval_examples=4))
    recs = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert r["mismatch_max"] < 1e-4  # the trainer's tokens are the engine's: its log-probs agree
        assert r["episodes"] == 16 and r["episodes_failed"] == 0
        assert 1 <= r["turns_mean"] <= (3 if env == "calculator" else 6)
    evals = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "eval_reward" in r]
    assert len(evals) == 2 and "eval_turns" in evals[0]
    assert result["eval_label"] == "mean reward"


def test_failing_episodes_are_dropped_and_counted(tmp_path, monkeypatch):
    (tmp_path / "flaky_env.py").write_text(FLAKY_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    train_rl(_env_config(tmp_path, "flaky_env:Flaky", "bad=1", eval_examples=2))
    recs = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward_mean" in r]
    assert len(recs) == 2 and all(0 < r["episodes_failed"] < r["episodes"] / 2 for r in recs)


def test_an_environment_that_mostly_fails_stops_the_run_with_one_line(tmp_path, monkeypatch):
    (tmp_path / "flaky_env.py").write_text(FLAKY_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EnvError) as e:  # the harness re-raises the step's cause after saving
        train_rl(_env_config(tmp_path, "flaky_env:Flaky", eval_every=0, eval_examples=1))
    assert str(e.value) == (
        "16 of 16 episodes of flaky_env:Flaky failed: env.reset raised RuntimeError: the sandbox is down"
    )


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(env="guess", data="x.jsonl"), "--env takes its prompts and rewards from the environment"),
        (dict(env="guess", reward="mod:fn"), "--env takes its prompts and rewards from the environment"),
        (dict(env_arg=("n=4",)), "--env-arg passes options to an environment: give --env too"),
        (dict(env="guess", max_turns=0), "--max-turns must be >= 1, got 0"),
    ],
)
def test_env_options_are_checked_in_one_line(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        small_config(tmp_path, **{"data": None, "reward": "task", **kw})


def test_env_arg_repeats_and_unknown_envs_fail_at_start(tmp_path):
    from spinwheel.cli import build_parser
    from spinwheel.config import from_args
    from spinwheel.rl.llm import RLConfig

    ns = build_parser().parse_args(["grpo", "--env", "guess", "--env-arg", "n=8", "max_turns=3", "--env-arg", "n=4"])
    assert from_args(RLConfig, ns).env_arg == ("n=8", "max_turns=3", "n=4")
    with pytest.raises(EnvError, match="no built-in environment 'nosuchenv'"):
        train_rl(_env_config(tmp_path, "nosuchenv"))


ENV_LAYOUTS = [("dp2", dict(dp=2)), ("tp2", dict(tp=2))]


def _guess(out_dir, **kw):
    base = dict(data=None, reward="task", env="guess", env_arg=("max_turns=3",), steps=3, max_new_tokens=4)
    return small_config(out_dir, **{**base, "beta": 0.0, "eval_examples": 2, **kw})


def _env_layout_worker(rank: int, world_size: int, root: str) -> None:
    from spinwheel.parallel import ParallelConfig

    for name, kwargs in ENV_LAYOUTS:
        train_rl(_guess(f"{root}/{name}", parallel=ParallelConfig(**kwargs)))


@pytest.mark.slow
@pytest.mark.distributed
def test_multi_turn_layouts_draw_the_same_episodes_and_steps_as_one_process(tmp_path):
    from spinwheel.parallel import spawn

    train_rl(_guess(tmp_path / "one"))
    ref = [r for r in read_metrics(tmp_path / "one" / "metrics.jsonl") if "reward_mean" in r]
    assert len(ref) == 3 and all(r["turns_mean"] > 1 for r in ref)  # multi-turn episodes
    spawn(_env_layout_worker, 2, args=(str(tmp_path),), timeout_s=400)
    for name, _ in ENV_LAYOUTS:
        recs = [r for r in read_metrics(tmp_path / name / "metrics.jsonl") if "reward_mean" in r]
        for key in ("reward_mean", "turns_mean", "response_len"):
            assert [r[key] for r in recs] == [r[key] for r in ref], (name, key)  # the same episodes
        assert [r["loss"] for r in recs] == pytest.approx([r["loss"] for r in ref], rel=1e-5, abs=1e-7), name
