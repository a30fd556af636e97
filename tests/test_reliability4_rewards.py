"""Rewards at the edge of float32 (issue 37, reliability item 3): a reward finite as a double but not as float32
(1e39) fails its episode only, as any non-finite reward does; valid float32 rewards whose sum overflows (3e38 each)
give finite group statistics, equal to the float64 formula; and a run on such an environment trains to the end."""

from __future__ import annotations

import pytest
import torch
from helpers import small_config

from spinwheel.envs import EnvError
from spinwheel.envs.base import Step
from spinwheel.models.tokenizer import load_tokenizer
from spinwheel.rl.llm import train_rl
from spinwheel.rl.llm.agents.agent_calls import ModelCall, agent_episode
from spinwheel.rl.llm.env_calls import EnvCallError, checked_step
from spinwheel.rl.llm.token_advantages import group_advantages, reinforce_pp_advantages, rloo_advantages, whiten
from spinwheel.train.metrics import read_metrics

BIG = 3e38  # a valid float32; four of them overflow a float32 sum


def test_a_reward_beyond_float32_is_a_failed_step_not_a_number():
    assert checked_step(Step("ok", BIG, False))[1] == BIG
    for reward in (1e39, -1e39, 2**200):
        with pytest.raises(EnvCallError, match="float32"):
            checked_step(Step("ok", reward, False))


@pytest.mark.parametrize(("reward", "failed"), [(BIG, False), (1e39, True), (-1e39, True)])
def test_an_agent_reward_beyond_float32_fails_its_episode(reward, failed):
    tokenizer = load_tokenizer("test")
    ids = tokenizer.encode("1+1=")
    call = ModelCall(ids, tokenizer.encode("2", add_special_tokens=False), [-0.5], "2")
    e = agent_episode([call], reward, None, tokenizer, 0, 0, 0)
    assert e.failed is failed and (failed or e.reward == BIG)


@pytest.mark.parametrize("rewards", [[BIG] * 4, [BIG, BIG, -BIG, 0.0], [-BIG, 1.0, BIG, 2.5]])
def test_group_statistics_of_huge_valid_rewards_are_finite_and_exact(rewards):
    r32 = torch.tensor(rewards * 2, dtype=torch.float32)
    r64 = r32.double().view(-1, 4)
    mean, std = r64.mean(dim=1, keepdim=True), r64.std(dim=1, keepdim=True)
    grpo = group_advantages(r32, 4)
    assert grpo.dtype == torch.float32 and torch.isfinite(grpo).all()
    torch.testing.assert_close(grpo.double(), ((r64 - mean) / (std + 1e-6)).reshape(-1), rtol=1e-6, atol=1e-6)
    others = (r64.sum(dim=1, keepdim=True) - r64) / 3
    expected_rloo = (r64 - others).reshape(-1)
    if expected_rloo.abs().max() < torch.finfo(torch.float32).max:  # representable: then exact
        torch.testing.assert_close(rloo_advantages(r32, 4).double(), expected_rloo, rtol=1e-6, atol=0.0)
    mask = torch.ones(8, 3)
    x = r32[:, None].expand(8, 3).contiguous()
    white = whiten(x, mask)
    assert torch.isfinite(white).all()
    flat = x.double().reshape(-1)
    torch.testing.assert_close(
        white.double().reshape(-1), (flat - flat.mean()) / (flat.var() + 1e-8).sqrt(), rtol=1e-5, atol=1e-5
    )
    kl = torch.zeros(8, 3)
    assert torch.isfinite(reinforce_pp_advantages(r32, kl, mask, beta=0.1, group_size=4)).all()


HUGE_ENV = '''
from spinwheel.envs import Env, Step


class Huge(Env):
    """One step; the reward is 1e39 (not a float32) for seeds 0 mod 4, else 3e38 (a float32, four overflow a sum)."""

    def __init__(self, split="train"):
        super().__init__(split)

    def reset(self, seed):
        self.seed = seed
        return "1+1="

    def step(self, action):
        return Step(None, 1e39 if self.seed % 4 == 0 else 3e38, True)
'''


def test_a_run_on_huge_rewards_fails_the_bad_episodes_only_and_trains(tmp_path, monkeypatch):
    (tmp_path / "huge_env.py").write_text(HUGE_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = dict(data=None, reward="task", env="huge_env:Huge", steps=2, max_new_tokens=4, beta=0.0, eval_every=0)
    train_rl(small_config(tmp_path / "run", **config))
    recs = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert 0 < r["episodes_failed"] < r["episodes"] / 2
        ok = r["episodes"] - r["episodes_failed"]  # a failed episode counts 0 in the mean, as every failed one
        assert r["reward_mean"] == pytest.approx(BIG * ok / r["episodes"], rel=1e-6)


TWICE_ENV = '''
from spinwheel.envs import Env, Step


class Twice(Env):
    """Two turns of reward 2e38 each: each a float32, their total (4e38) not."""

    max_turns = 2

    def __init__(self, split="train"):
        super().__init__(split)
        self.turns = 0

    def reset(self, seed):
        return "1+1="

    def step(self, action):
        self.turns += 1
        return Step("ok\\n" if self.turns == 1 else None, 2e38, self.turns == 2)
'''


def test_an_episode_total_past_float32_fails_the_episode(tmp_path, monkeypatch):
    (tmp_path / "twice_env.py").write_text(TWICE_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = dict(data=None, reward="task", env="twice_env:Twice", steps=1, max_new_tokens=3, beta=0.0, eval_every=0)
    with pytest.raises(EnvError) as e:  # every episode failed: the run stops with one line (not loss = nan)
        train_rl(small_config(tmp_path / "run", **config))
    assert str(e.value) == (
        "16 of 16 episodes of twice_env:Twice failed: env.step: the episode's total reward 4e+38 is past float32's "
        "range (±3.4e38)"
    )
