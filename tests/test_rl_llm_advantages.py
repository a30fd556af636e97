"""LLM advantages against their definitions, computed with Python loops and the ``statistics`` module."""

import statistics

import pytest
import torch

from spinwheel.rl.llm.token_advantages import (
    AdaptiveKLController,
    FixedKLController,
    dynamic_sampling_mask,
    final_token_mask,
    group_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    token_gae,
    token_rewards,
    whiten,
)

REWARDS = [1.0, 0.0, 0.5, 0.0, 2.0, 2.0, 2.0, 2.0, -1.0, 3.0, 0.0, 1.0]  # 3 prompts × G = 4; group 1 all equal


def test_group_advantages_equal_the_definition():
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    got = group_advantages(rewards, 4, eps=1e-4).tolist()
    expected = []
    for g in range(3):
        group = REWARDS[4 * g : 4 * g + 4]
        mean, std = statistics.mean(group), statistics.stdev(group)  # stdev: the unbiased (n - 1) one, as TRL
        expected += [(r - mean) / (std + 1e-4) for r in group]
    assert got == pytest.approx(expected, abs=1e-12)
    assert got[4:8] == [0.0] * 4  # equal rewards: zero advantage, no division by zero
    # hand check, group 0: mean 0.375, stdev sqrt(0.229166...) = 0.47871
    assert got[0] == pytest.approx(0.625 / (0.4787135538781691 + 1e-4), abs=1e-12)
    # Dr. GRPO: centred only
    dr = group_advantages(rewards, 4, scale_std=False).tolist()
    assert dr == pytest.approx(
        [r - statistics.mean(REWARDS[4 * (i // 4) : 4 * (i // 4) + 4]) for i, r in enumerate(REWARDS)], abs=1e-12
    )
    with pytest.raises(ValueError, match="groups of 5"):
        group_advantages(rewards, 5)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(rewards, 1)


def test_rloo_equals_the_leave_one_out_definition():
    got = rloo_advantages(torch.tensor(REWARDS, dtype=torch.float64), 4).tolist()
    expected = []
    for i, r in enumerate(REWARDS):
        g = i // 4
        others = [REWARDS[j] for j in range(4 * g, 4 * g + 4) if j != i]
        expected.append(r - sum(others) / len(others))
    assert got == pytest.approx(expected, abs=1e-12)
    assert got[0] == pytest.approx(1.0 - 0.5 / 3)  # others: 0, 0.5, 0
    # the identity A_i = G / (G - 1) · (r_i - mean)
    centred = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), 4, scale_std=False)
    assert got == pytest.approx((centred * 4 / 3).tolist(), abs=1e-12)


def test_dynamic_sampling_keeps_groups_with_different_rewards():
    keep = dynamic_sampling_mask(torch.tensor(REWARDS), 4)
    assert keep.tolist() == [True] * 4 + [False] * 4 + [True] * 4
    assert dynamic_sampling_mask(torch.tensor([1.0, 1.0, 0.0, 0.0]), 2).tolist() == [False] * 4


def test_whiten_equals_masked_statistics():
    x = torch.tensor([[1.0, 2.0, 9.0], [4.0, -1.0, 0.5]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    kept = [1.0, 2.0, 4.0, -1.0, 0.5]
    mean, var = statistics.mean(kept), statistics.variance(kept)  # unbiased variance, as TRL's masked_whiten
    got = whiten(x, mask)
    expected = [
        [(v - mean) / (var + 1e-8) ** 0.5 if m else 0.0 for v, m in zip(row, mrow)]
        for row, mrow in zip(x.tolist(), mask.tolist())
    ]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    scaled = whiten(x, mask, shift_mean=False)
    assert scaled[0, 0].item() == pytest.approx((1.0 - mean) / (var + 1e-8) ** 0.5 + mean, abs=1e-12)
    assert whiten(torch.tensor([3.0]), torch.tensor([1])).item() == 0.0  # one entry: no spread, no NaN


# three right-padded completions of lengths 3, 1, 4 over T = 5, and an empty one
MASK = [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0]]
SCORES = [1.0, -0.5, 2.0, 3.0]
KL = [[0.1, -0.2, 0.3, 5.0, 5.0], [0.4, 5.0, 5.0, 5.0, 5.0], [0.05, 0.0, -0.1, 0.2, 5.0], [5.0] * 5]
VALUES = [[0.5, 0.2, -0.1, 9.0, 9.0], [0.3, 9.0, 9.0, 9.0, 9.0], [1.0, 1.5, 0.7, 1.2, 9.0], [9.0] * 5]


def _t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_token_rewards_put_the_score_on_the_last_token():
    beta = 0.1
    got = token_rewards(_t(SCORES), _t(KL), torch.tensor(MASK), beta)
    for i, row in enumerate(MASK):
        length = sum(row)
        for t in range(5):
            expected = 0.0
            if t < length:
                expected = -beta * KL[i][t] + (SCORES[i] if t == length - 1 else 0.0)
            assert got[i, t].item() == pytest.approx(expected, abs=1e-12)
    assert final_token_mask(torch.tensor(MASK, dtype=torch.bool)).tolist() == [
        [0, 0, 1, 0, 0],
        [1, 0, 0, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 0, 0],
    ]


def _gae_loop(rewards, values, length, gamma, lam):
    """GAE over one completion of ``length`` tokens, the value after the last one 0 (Schulman et al. 2016)."""
    adv = [0.0] * length
    running = 0.0
    for t in reversed(range(length)):
        next_value = values[t + 1] if t + 1 < length else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
    return adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0)])
def test_token_gae_with_kl_penalty_equals_a_loop(gamma, lam):
    beta = 0.05
    rewards = token_rewards(_t(SCORES), _t(KL), torch.tensor(MASK), beta)
    adv, ret = token_gae(rewards, _t(VALUES), torch.tensor(MASK), gamma, lam)
    for i, row in enumerate(MASK):
        length = sum(row)
        # the per-token rewards from scratch: -β KL_t, plus the score on the final token
        r = [-beta * KL[i][t] + (SCORES[i] if t == length - 1 else 0.0) for t in range(length)]
        expected = _gae_loop(r, VALUES[i], length, gamma, lam)
        assert adv[i, :length].tolist() == pytest.approx(expected, abs=1e-12)
        assert ret[i, :length].tolist() == pytest.approx([a + v for a, v in zip(expected, VALUES[i])], abs=1e-12)
        assert adv[i, length:].abs().sum().item() == 0.0 and ret[i, length:].abs().sum().item() == 0.0
    # hand check, row 1 (one token): A = r - V = (-0.05·0.4 - 0.5) - 0.3
    assert adv[1, 0].item() == pytest.approx(-0.02 - 0.5 - 0.3)


def test_token_gae_on_a_block_after_the_prompt():
    # the completion may start after prompt positions (left-padded or unsliced rows): same numbers, shifted
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    rewards = torch.tensor([[7.0, 7.0, 0.1, 0.2, 1.0]], dtype=torch.float64)
    values = torch.tensor([[5.0, 5.0, 0.5, 0.4, 0.3]], dtype=torch.float64)
    adv, _ = token_gae(rewards, values, mask, 0.9, 0.8)
    expected = _gae_loop([0.1, 0.2, 1.0], [0.5, 0.4, 0.3], 3, 0.9, 0.8)
    assert adv[0, 2:].tolist() == pytest.approx(expected, abs=1e-12) and adv[0, :2].tolist() == [0.0, 0.0]
    # a mask with gaps (multi-turn episodes) is no error: tests/test_rl_ppo_turns.py


@pytest.mark.parametrize("gamma", [1.0, 0.8])
def test_reinforce_pp_equals_the_definition(gamma):
    # REINFORCE++ (Hu et al. 2025): A_t = score - β Σ_{k ≥ t} KL_k (γ = 1), whitened over the batch's tokens
    beta = 0.2
    got = reinforce_pp_advantages(_t(SCORES), _t(KL), torch.tensor(MASK), beta, gamma)
    raw, where = [], []
    for i, row in enumerate(MASK):
        length = sum(row)
        for t in range(length):
            g = sum(
                gamma ** (k - t) * (-beta * KL[i][k] + (SCORES[i] if k == length - 1 else 0.0))
                for k in range(t, length)
            )
            if gamma == 1.0:
                assert g == pytest.approx(SCORES[i] - beta * sum(KL[i][t:length]), abs=1e-12)
            raw.append(g)
            where.append((i, t))
    mean, std = statistics.mean(raw), statistics.stdev(raw)
    for (i, t), g in zip(where, raw):
        assert got[i, t].item() == pytest.approx((g - mean) / (std**2 + 1e-8) ** 0.5, abs=1e-9)
    assert got[torch.tensor(MASK) == 0].abs().sum().item() == 0.0


def test_reinforce_pp_with_group_baseline():
    scores = [1.0, 0.0, 3.0, 1.0]  # two groups of two
    mask = [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]]
    kl = [[0.1, 0.2, 0.0], [0.3, 0.0, 0.0], [0.0, 0.1, 0.2], [0.2, 0.2, 0.0]]
    got = reinforce_pp_advantages(_t(scores), _t(kl), torch.tensor(mask), 0.5, group_size=2)
    centred = [0.5, -0.5, 1.0, -1.0]  # score minus its group's mean
    raw = [centred[i] - 0.5 * sum(kl[i][t : sum(mask[i])]) for i in range(4) for t in range(sum(mask[i]))]
    mean, std = statistics.mean(raw), statistics.stdev(raw)
    flat = [got[i, t].item() for i in range(4) for t in range(sum(mask[i]))]
    assert flat == pytest.approx([(g - mean) / (std**2 + 1e-8) ** 0.5 for g in raw], abs=1e-9)


def test_kl_controllers():
    # Ziegler et al. 2019: β ← β (1 + clip(KL / target - 1, ±0.2) · n / horizon)
    ctl = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    ctl.update(9.0, 256)  # error 0.5 → clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    before = ctl.value
    ctl.update(6.6, 100)  # error 0.1
    assert ctl.value == pytest.approx(before * (1 + 0.1 * 100 / 10000))
    before = ctl.value
    ctl.update(0.0, 1000)  # error -1 → -0.2
    assert ctl.value == pytest.approx(before * (1 - 0.2 * 1000 / 10000))
    restored = AdaptiveKLController(value=1.0, target=6.0)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.05
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(value=0.1, target=0.0)
