"""Per-token LLM losses against the published formulas, computed by Python loops over rows and tokens.

The oracle below walks every (row, token) with scalar operations, written from the papers (DeepSeekMath eq. (3)
for GRPO, Dr. GRPO's constant normaliser, DAPO's clip-higher and token mean, Schulman's k1/k2/k3), independently
of the vectorised code; it runs on 0-d float64 tensors so that autograd gives the oracle's gradient too.
"""

import math

import pytest
import torch

from spinwheel.rl.llm.token_advantages import group_advantages
from spinwheel.rl.llm.token_losses import (
    clipped_policy_loss,
    clipped_value_loss,
    grpo_loss,
    kl_per_token,
    logprob_mismatch,
    token_weights,
    truncated_is_weights,
)

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
ESTIMATORS = ["k1", "k2", "k3"]

# 4 completions of lengths 3, 1, 4, 2 over T = 5 positions (right padding); garbage in the padding.
MASK = [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
# ratios r = π/π_old chosen to land on every side of [1 - 0.2, 1 + 0.28] and of the symmetric [0.8, 1.2]
RATIOS = [
    [1.25, 0.75, 1.0, 9.0, 9.0],
    [1.5, 9.0, 9.0, 9.0, 9.0],
    [0.7, 1.1, 1.3, 0.9, 9.0],
    [1.22, 0.85, 9.0, 9.0, 9.0],
]
ADV = [1.0, -2.0, -0.5, 0.75]  # one advantage per completion (GRPO's outcome advantage)


def _inputs():
    old = torch.tensor(
        [
            [-1.0, -0.5, -2.0, -0.3, -1.1],
            [-0.7, -1.2, -0.9, -0.4, -2.2],
            [-1.5, -0.2, -0.8, -1.9, -0.6],
            [-0.4, -1.3, -0.5, -0.8, -1.0],
        ],
        dtype=torch.float64,
    )
    logp = old + torch.tensor(RATIOS, dtype=torch.float64).log()
    ref = old + torch.tensor(
        [
            [0.3, -0.2, 0.1, 0.0, 0.5],
            [-0.4, 0.2, 0.0, 0.1, 0.3],
            [0.2, 0.25, -0.3, 0.1, 0.0],
            [-0.1, 0.4, 0.2, -0.2, 0.1],
        ],
        dtype=torch.float64,
    )
    mask = torch.tensor(MASK, dtype=torch.float64)
    return logp, old, ref, torch.tensor(ADV, dtype=torch.float64), mask


def oracle_loss(logp, old, ref, adv, mode, estimator, beta, eps_low, eps_high, max_len=None, is_w=None):
    """The aggregated loss from its definition, one token at a time (0-d tensors, so it is differentiable)."""
    num_rows, num_pos = len(MASK), len(MASK[0])
    lengths = [sum(row) for row in MASK]
    total = 0.0
    for i in range(num_rows):
        for t in range(num_pos):
            if not MASK[i][t]:
                continue
            r = torch.exp(logp[i, t] - old[i, t])
            a = adv[i] if adv.dim() == 1 else adv[i, t]
            clipped = min(max(r, 1 - eps_low), 1 + eps_high)
            surrogate = -min(r * a, clipped * a)
            if is_w is not None:
                surrogate = surrogate * is_w[i][t]
            delta = logp[i, t] - ref[i, t]  # log π - log π_ref
            kl = {"k1": delta, "k2": 0.5 * delta**2, "k3": torch.exp(-delta) + delta - 1}[estimator]
            term = surrogate + beta * kl
            if mode == "token-mean":
                total = total + term / sum(lengths)
            elif mode == "seq-mean-token-mean":  # 1/G Σ_i 1/|o_i| Σ_t
                total = total + term / (lengths[i] * sum(1 for n in lengths if n))
            else:  # Dr. GRPO: 1/(G · L) Σ_i Σ_t
                total = total + term / (num_rows * (max_len or num_pos))
    return total


def test_token_weights_per_mode():
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)  # an empty row
    w = token_weights(mask, "token-mean")
    assert w.sum().item() == pytest.approx(1.0) and w[0, 0].item() == pytest.approx(1 / 4)
    w = token_weights(mask, "seq-mean-token-mean")
    # two non-empty rows: each row's tokens share 1/2
    assert w[0, :3].tolist() == pytest.approx([1 / 6] * 3) and w[2, 0].item() == pytest.approx(1 / 2)
    assert w.sum().item() == pytest.approx(1.0) and w[1].abs().sum().item() == 0.0
    w = token_weights(mask, "seq-mean-token-sum-norm")
    assert w[0, 0].item() == pytest.approx(1 / (3 * 4)) and w.sum().item() == pytest.approx(4 / 12)
    w = token_weights(mask, "seq-mean-token-sum-norm", max_len=8)
    assert w[2, 0].item() == pytest.approx(1 / (3 * 8))
    assert w.dtype == torch.float32 and not w.requires_grad
    assert token_weights(mask, "token-mean", dtype=torch.float64).dtype == torch.float64
    for mode in MODES:
        assert (token_weights(mask, mode)[~mask] == 0).all()
    with pytest.raises(ValueError, match="aggregation"):
        token_weights(mask, "seq-mean")


def test_kl_estimators_equal_the_formulas():
    logp = torch.tensor([-1.0, -0.2, -3.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -0.2, -1.0], dtype=torch.float64)
    for estimator, formula in [
        ("k1", lambda lp, rf: lp - rf),
        ("k2", lambda lp, rf: 0.5 * (lp - rf) ** 2),
        ("k3", lambda lp, rf: math.exp(rf - lp) - (rf - lp) - 1),
    ]:
        got = kl_per_token(logp, ref, estimator).tolist()
        assert got == pytest.approx([formula(a, b) for a, b in zip(logp.tolist(), ref.tolist())], abs=1e-12)
    assert (kl_per_token(logp, ref, "k3") >= 0).all()
    # under π itself, k1 and k3 are unbiased for KL(π ‖ π_ref): samples in exact proportion to π
    p = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)
    q = torch.tensor([0.4, 0.3, 0.3], dtype=torch.float64)
    tokens = torch.tensor([0, 1, 1, 2])
    exact = (p * (p / q).log()).sum().item()
    for estimator in ("k1", "k3"):
        assert kl_per_token(p.log()[tokens], q.log()[tokens], estimator).mean().item() == pytest.approx(exact)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_grpo_loss_equals_the_formula(mode, estimator):
    logp, old, ref, adv, mask = _inputs()
    beta, eps_low, eps_high = 0.04, 0.2, 0.28
    weights = token_weights(mask, mode)
    loss, stats = grpo_loss(logp, old, adv, weights, ref, beta, eps_low, eps_high, estimator)
    expected = oracle_loss(logp, old, ref, adv, mode, estimator, beta, eps_low, eps_high)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6, rel=1e-6)
    no_kl = oracle_loss(logp, old, ref, adv, mode, estimator, 0.0, eps_low, eps_high)
    assert stats["policy_loss"].item() == pytest.approx(no_kl.item(), abs=1e-6, rel=1e-6)
    assert stats["kl"].item() == pytest.approx(((expected - no_kl) / beta).item(), abs=1e-6, rel=1e-6)
    assert stats["loss"].item() == loss.item()


@pytest.mark.parametrize("mode", MODES)
def test_grpo_gradient_equals_the_oracle_gradient(mode):
    logp, old, ref, adv, mask = _inputs()
    mine = logp.clone().requires_grad_()
    loss, _ = grpo_loss(mine, old, adv, token_weights(mask, mode), ref, 0.1, 0.2, 0.28, "k3")
    loss.backward()
    theirs = logp.clone().requires_grad_()
    oracle_loss(theirs, old, ref, adv, mode, "k3", 0.1, 0.2, 0.28).backward()
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-9, atol=1e-12)
    # where the clip is active (row 2 token 0: r = 0.7 < 0.8 with A < 0) only the KL term has a gradient:
    # β · w · d k3 / d log π = β · w · (1 - exp(log π_ref - log π))
    w = token_weights(mask, mode)[2, 0].item()
    kl_grad = 0.1 * w * (1 - math.exp((ref[2, 0] - logp[2, 0]).item()))
    assert mine.grad[2, 0].item() == pytest.approx(kl_grad, abs=1e-12)
    assert (
        abs(
            mine.grad[2, 1].item()
            - 0.1 * token_weights(mask, mode)[2, 1].item() * (1 - math.exp((ref[2, 1] - logp[2, 1]).item()))
        )
        > 1e-3
    )  # a live token has more
    assert (mine.grad[mask == 0] == 0).all()


def test_clip_higher_differs_from_symmetric_clipping():
    # row 0 token 0: r = 1.25, A = 1: clipped at 1.2 by ε = 0.2, not by ε_high = 0.28; row 3 token 0 (r = 1.22,
    # A = 0.75) the same. row 2 token 2: r = 1.3 with A < 0 is never clipped (the min picks r·A).
    # row 2 token 0: r = 0.7 with A = -0.5: clipped low at 0.8 by both.
    logp, old, _, adv, mask = _inputs()
    w = token_weights(mask, "token-mean")  # 10 tokens, w = 1/10 each
    sym, sym_stats = clipped_policy_loss(logp, old, adv, w, 0.2, 0.2)
    high, high_stats = clipped_policy_loss(logp, old, adv, w, 0.2, 0.28)
    # only the two tokens with 1.2 < r < 1.28 and A > 0 change: -1.2·A → -r·A
    assert (high - sym).item() == pytest.approx(-(1.25 - 1.2) * 1.0 / 10 - (1.22 - 1.2) * 0.75 / 10, abs=1e-12)
    assert sym.item() == pytest.approx(oracle_loss(logp, old, old, adv, "token-mean", "k1", 0.0, 0.2, 0.2).item())
    # clip activity (TRL's definition): low = r < 1 - ε_low with A < 0, high = r > 1 + ε_high with A > 0.
    # low: row 2 token 0 only (row 0 token 1 has r = 0.75 but A > 0, so the min keeps r·A);
    # high: rows 0 and 3 token 0 under ε = 0.2, none under ε_high = 0.28 (row 1's r = 1.5 has A < 0).
    assert sym_stats["clip_frac_low"].item() == pytest.approx(1 / 10)
    assert sym_stats["clip_frac_high"].item() == pytest.approx(2 / 10)
    assert sym_stats["clip_frac"].item() == pytest.approx(3 / 10)
    assert high_stats["clip_frac_high"].item() == pytest.approx(0.0)
    assert high_stats["clip_frac"].item() == pytest.approx(1 / 10)
    ratios = [RATIOS[i][t] for i in range(4) for t in range(5) if MASK[i][t]]
    assert high_stats["ratio_mean"].item() == pytest.approx(sum(ratios) / 10)
    assert high_stats["approx_kl"].item() == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / 10)
    assert high_stats["weight_sum"].item() == pytest.approx(1.0)


def test_dr_grpo_is_unscaled_advantages_over_a_constant():
    # Dr. GRPO (Liu et al. 2025): A_i = r_i - mean(r_group), loss = 1/(G · L) Σ_i Σ_t (-min(...)).
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)  # one group of 4
    adv = group_advantages(rewards, 4, scale_std=False)
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5]
    logp, old, ref, _, mask = _inputs()
    loss, _ = grpo_loss(logp, old, adv, token_weights(mask, "seq-mean-token-sum-norm", max_len=16))
    expected = 0.0
    for i in range(4):
        for t in range(5):
            if MASK[i][t]:
                r = RATIOS[i][t]
                expected += -min(r * adv[i].item(), min(max(r, 0.8), 1.2) * adv[i].item()) / (4 * 16)
    assert loss.item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_shards_sum_to_the_full_batch(mode):
    logp, old, ref, adv, mask = _inputs()
    weights = token_weights(mask, mode)  # from the global batch, sliced with the rows
    full = logp.clone().requires_grad_()
    loss, stats = grpo_loss(full, old, adv, weights, ref, 0.05, 0.2, 0.28, "k2")
    loss.backward()
    shard = logp.clone().requires_grad_()
    total, shard_stats = 0.0, []
    for rows in (slice(0, 1), slice(1, 4)):  # uneven shards: 1 row and 3 rows
        part, part_stats = grpo_loss(shard[rows], old[rows], adv[rows], weights[rows], ref[rows], 0.05, 0.2, 0.28, "k2")
        part.backward()
        total += part.item()
        shard_stats.append(part_stats)
    assert total == pytest.approx(loss.item(), abs=1e-12)
    torch.testing.assert_close(shard.grad, full.grad, rtol=0, atol=1e-14)
    for key in ("policy_loss", "kl", "clip_frac", "clip_frac_low", "approx_kl", "ratio_mean", "weight_sum"):
        assert sum(s[key].item() for s in shard_stats) == pytest.approx(stats[key].item(), abs=1e-12)


def test_truncated_importance_sampling():
    trainer = torch.tensor([[-1.0, -0.5], [-2.0, -0.1]], dtype=torch.float64, requires_grad=True)
    engine = torch.tensor([[-1.2, -0.5], [-0.5, -3.0]], dtype=torch.float64)
    w = truncated_is_weights(trainer, engine, cap=2.0)
    # min(exp(Δ), 2): exp(0.2), 1, exp(-1.5), exp(2.9) → capped at 2
    assert w.flatten().tolist() == pytest.approx([math.exp(0.2), 1.0, math.exp(-1.5), 2.0], abs=1e-12)
    assert not w.requires_grad
    assert truncated_is_weights(torch.tensor([0.0]), torch.tensor([-1e4]), 5.0).item() == pytest.approx(5.0)
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(trainer, engine, 0.0)
    # the weights multiply the surrogate term of each token and leave the KL term alone
    logp, old, ref, adv, mask = _inputs()
    is_w = torch.linspace(0.5, 1.5, 20, dtype=torch.float64).view(4, 5)
    loss, stats = grpo_loss(logp, old, adv, token_weights(mask, "token-mean"), ref, 0.1, 0.2, 0.2, "k3", is_w)
    expected = oracle_loss(logp, old, ref, adv, "token-mean", "k3", 0.1, 0.2, 0.2, is_w=is_w.tolist())
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    assert stats["is_weight_mean"].item() == pytest.approx(is_w[mask.bool()].mean().item())
    mismatch = logprob_mismatch(trainer, engine, torch.tensor([[1, 1], [1, 0]]))
    assert mismatch["mismatch_max"].item() == pytest.approx(1.5)
    assert mismatch["mismatch_mean"].item() == pytest.approx((0.2 + 0.0 + 1.5) / 3)


def test_per_token_advantages_and_beta_without_reference():
    logp, old, ref, adv, mask = _inputs()
    per_token = adv.unsqueeze(1).expand(4, 5).clone()
    per_token[2, 1] = 3.0  # a token-level advantage (PPO's GAE) differs from the row's
    w = token_weights(mask, "seq-mean-token-mean")
    loss, _ = clipped_policy_loss(logp, old, per_token, w, 0.2, 0.2)
    expected = oracle_loss(logp, old, ref, per_token, "seq-mean-token-mean", "k1", 0.0, 0.2, 0.2)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    _, stats = grpo_loss(logp, old, adv, w)
    assert "kl" not in stats
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, old, adv, w, beta=0.1)


def test_clipped_value_loss_equals_the_formula():
    values = torch.tensor([[1.0, 3.0, -1.0], [0.5, 2.0, 7.0]], dtype=torch.float64)
    old = torch.tensor([[0.0, 2.0, -1.0], [0.5, 1.0, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 0.0, -1.5], [0.0, 1.2, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    w = token_weights(mask, "token-mean", dtype=torch.float64)
    loss, stats = clipped_value_loss(values, old, returns, w, clip=0.5)
    expected, clipped = 0.0, 0
    for i in range(2):
        for t in range(3):
            if mask[i, t]:
                v, vo, ret = values[i, t].item(), old[i, t].item(), returns[i, t].item()
                v_clip = vo + min(max(v - vo, -0.5), 0.5)
                expected += max((v - ret) ** 2, (v_clip - ret) ** 2) / 5
                clipped += (v_clip - ret) ** 2 > (v - ret) ** 2
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    # hand check: clipped values 0.5, 2.5, -1, 0.5, 1.5: max errors 2.25, 9, 0.25, 0.25, 0.64
    assert expected == pytest.approx((2.25 + 9 + 0.25 + 0.25 + 0.64) / 5)
    assert stats["value_clip_frac"].item() == pytest.approx(clipped / 5) and clipped == 1
    plain, _ = clipped_value_loss(values, old, returns, w, clip=None)
    assert plain.item() == pytest.approx((1 + 9 + 0.25 + 0.25 + 0.64) / 5)


def test_padding_with_extreme_values_changes_nothing():
    logp, old, ref, adv, mask = _inputs()
    weights = token_weights(mask, "seq-mean-token-mean")
    clean = logp.clone().requires_grad_()
    loss, _ = grpo_loss(clean, old, adv, weights, ref, 0.1, 0.2, 0.28, "k3")
    loss.backward()
    pad = mask == 0
    noisy_logp = logp.masked_fill(pad, 0.0).requires_grad_()
    noisy_old = old.masked_fill(pad, -1000.0)  # exp(1000) overflows float64
    noisy_ref = ref.masked_fill(pad, 1000.0)
    noisy, _ = grpo_loss(noisy_logp, noisy_old, adv, weights, noisy_ref, 0.1, 0.2, 0.28, "k3")
    noisy.backward()
    assert noisy.item() == pytest.approx(loss.item(), abs=1e-12)
    torch.testing.assert_close(noisy_logp.grad, clean.grad, rtol=0, atol=1e-14)
