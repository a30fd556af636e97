"""PPO on multi-turn episodes: each turn's reward at the turn's last sampled token, the KL penalty on sampled tokens
only, GAE over the sampled tokens only (observation tokens are not steps) — checked against the recursion written as
a loop over the sampled tokens, on a hand-made 2-turn episode and on the batches of a PPO run on ``guess`` (with a
reward on every turn)."""

from __future__ import annotations

import pytest
import torch
from helpers import small_config

from spinwheel.rl.llm import train_rl
from spinwheel.rl.llm.algorithms import ppo
from spinwheel.rl.llm.episode_tokens import Episode, episode_batch
from spinwheel.rl.llm.token_advantages import token_gae, token_rewards
from spinwheel.train.metrics import read_metrics


def gae_over_sampled(rewards, values, mask, gamma, lam):
    """One row: GAE written as a loop over the sampled positions only (the value after the last one is 0)."""
    steps = [t for t, m in enumerate(mask) if m]
    adv, ret, running = [0.0] * len(mask), [0.0] * len(mask), 0.0
    for k in reversed(range(len(steps))):
        t = steps[k]
        next_value = values[steps[k + 1]] if k + 1 < len(steps) else 0.0
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        adv[t], ret[t] = running, running + values[t]
    return adv, ret


def two_turn_episodes() -> list[Episode]:
    """Prompt (3 tokens) · turn 1 (2 sampled) · observation (3) · turn 2 (3 sampled); a one-turn episode; a failed
    one. Turn rewards 0.25 and 1.0."""
    two = Episode(0, 0, 0, token_ids=[5, 6, 7, 10, 11, 20, 21, 22, 12, 13, 14])
    two.mask = [0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1]
    two.engine_logprobs = [0.0] * 11
    two.turn_ends, two.turn_rewards, two.reward = [4, 10], [0.25, 1.0], 1.25
    one = Episode(0, 1, 0, token_ids=[5, 6, 7, 15, 16], mask=[0, 0, 0, 1, 1], engine_logprobs=[0.0] * 5)
    one.turn_ends, one.turn_rewards, one.reward = [4], [0.5], 0.5
    failed = Episode(0, 2, 0, token_ids=[5, 6, 7, 17], mask=[0, 0, 0, 1], engine_logprobs=[0.0] * 4, failed=True)
    failed.turn_ends, failed.turn_rewards = [3], [3.0]
    return [two, one, failed]


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.7)])
def test_turn_rewards_and_gae_over_sampled_tokens_equal_the_loop(gamma, lam):
    batch = episode_batch(two_turn_episodes(), pad_id=0)
    mask, turn = batch["mask"].double(), batch["turn_rewards"].double()
    # labels are tokens[1:]: turn 1 sits at labels 2-3, turn 2 at 7-9, the observation at labels 4-6
    assert mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 1, 1, 1]
    assert turn[0].tolist() == [0, 0, 0, 0.25, 0, 0, 0, 0, 0, 1.0]  # at each turn's last sampled token
    assert turn[1].tolist()[:4] == [0, 0, 0, 0.5] and turn[2].abs().sum() == 0  # a failed episode: no reward
    gen = torch.Generator().manual_seed(3)
    kl = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    values = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    values[0, 4:7] = 100.0  # values on observation tokens must not matter
    beta = 0.1
    rewards = token_rewards(turn, kl, mask, beta)
    adv, ret = token_gae(rewards, values, mask, gamma, lam)
    for i in range(mask.shape[0]):
        m = mask[i].tolist()
        r = [(turn[i, t].item() - beta * kl[i, t].item()) if m[t] else 0.0 for t in range(len(m))]
        assert rewards[i].tolist() == pytest.approx(r, abs=1e-12)  # the KL penalty on sampled tokens only
        want_adv, want_ret = gae_over_sampled(r, values[i].tolist(), m, gamma, lam)
        assert adv[i].tolist() == pytest.approx(want_adv, abs=1e-12)
        assert ret[i].tolist() == pytest.approx(want_ret, abs=1e-12)
    # hand check, the 2-turn row's last token of turn 1 (label 3): δ = 0.25 - β kl + γ V(label 7) - V(label 3)
    delta = 0.25 - beta * kl[0, 3] + gamma * values[0, 7] - values[0, 3]
    assert adv[0, 3].item() == pytest.approx((delta + gamma * lam * adv[0, 7]).item(), abs=1e-12)
    # a single-turn row is today's layout: the score at the final token gives the same advantages
    single = token_rewards(torch.tensor([0.0, 0.5, 0.0], dtype=torch.float64), kl, mask, beta)
    assert torch.equal(token_gae(single, values, mask, gamma, lam)[0][1], adv[1])


SHAPED_GUESS = """
from spinwheel.envs.guess import GuessEnv

class Shaped(GuessEnv):
    def step(self, action):
        step = super().step(action)
        step.reward += 0.125  # every turn earns a little: rewards before the last turn
        return step
"""


def test_ppo_on_guess_uses_per_turn_rewards_and_gae_over_sampled_tokens(tmp_path, monkeypatch):
    (tmp_path / "shaped_guess.py").write_text(SHAPED_GUESS)
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def recording_gae(rewards, values, mask, gamma, lam):
        out = token_gae(rewards, values, mask, gamma, lam)
        seen.append((rewards, values, mask, gamma, lam, *out))
        return out

    monkeypatch.setattr(ppo, "token_gae", recording_gae)
    env = dict(data=None, reward="task", env="shaped_guess:Shaped", env_arg=("n=4", "max_turns=3"))
    config = small_config(
        tmp_path / "run", algo="ppo", steps=2, max_new_tokens=3, beta=0.0, critic_lr=3e-3, eval_examples=2, **env
    )
    train_rl(config)
    recs = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward_mean" in r]
    assert len(recs) == 2 and len(seen) == 2 and all(r["turns_mean"] > 1 for r in recs)
    gaps = rewarded_turns = 0
    for (rewards, values, mask, gamma, lam, adv, ret), rec in zip(seen, recs):
        on = mask != 0
        gaps += int(((on[:, 1:].int() - on[:, :-1].int()) == 1).sum()) - mask.shape[0]  # runs after the first
        assert rewards[~on].abs().sum() == 0  # every reward sits on a sampled token
        rewarded_turns += int(((rewards != 0).sum(1) > 1).sum())  # rows rewarded at more than their last token
        assert rewards.sum(1).mean().item() == pytest.approx(rec["reward_mean"], abs=1e-6)  # β = 0: the turn rewards
        for i in range(mask.shape[0]):
            want_adv, want_ret = gae_over_sampled(rewards[i].tolist(), values[i].tolist(), on[i].tolist(), gamma, lam)
            assert adv[i].tolist() == pytest.approx(want_adv, abs=1e-5)
            assert ret[i].tolist() == pytest.approx(want_ret, abs=1e-5)
    assert gaps > 0 and rewarded_turns > 0  # observation tokens between turns, rewards on turns before the last
