"""Losses against the published formulas on hand-made inputs, computed here with Python floats."""

import math

import pytest
import torch

from spinwheel.rl.losses import (
    approx_kl,
    entropy_loss,
    explained_variance,
    policy_gradient_loss,
    ppo_clip_loss,
    value_loss,
)


def test_ppo_clip_loss_equals_the_formula():
    # PPO paper eq. (7): L = E[min(r A, clip(r, 1-ε, 1+ε) A)], loss = -L.
    p_old = [0.5, 0.5, 0.25, 0.8, 0.1]
    p_new = [0.75, 0.3, 0.25, 0.6, 0.2]
    adv = [1.0, -2.0, 3.0, -0.5, 2.0]
    eps = 0.2
    terms = []
    for po, pn, a in zip(p_old, p_new, adv):
        r = pn / po
        terms.append(min(r * a, min(max(r, 1 - eps), 1 + eps) * a))
    expected = -sum(terms) / len(terms)
    # hand check of the same numbers: r = 1.5, 0.6, 1, 0.75, 2
    assert terms == pytest.approx([1.2, -1.6, 3.0, -0.4, 2.4])

    logp_old = torch.tensor(p_old, dtype=torch.float64).log()
    logp_new = torch.tensor(p_new, dtype=torch.float64).log()
    loss, stats = ppo_clip_loss(logp_new, logp_old, torch.tensor(adv, dtype=torch.float64), eps)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert loss.item() == pytest.approx(-(1.2 - 1.6 + 3.0 - 0.4 + 2.4) / 5, abs=1e-12)
    # |r - 1| > 0.2 for r = 1.5, 0.6, 0.75 (not 1, and 2 is outside too): 4 of 5
    assert stats["clip_frac"].item() == pytest.approx(4 / 5)
    ratios = [pn / po for po, pn in zip(p_old, p_new)]
    assert stats["approx_kl"].item() == pytest.approx(sum((r - 1) - math.log(r) for r in ratios) / 5)
    assert stats["approx_kl_k1"].item() == pytest.approx(sum(-math.log(r) for r in ratios) / 5)


def test_ppo_gradient_vanishes_where_clipped():
    logp_old = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    logp_new = torch.log(torch.tensor([0.9, 0.9, 0.2, 0.52])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    loss, _ = ppo_clip_loss(logp_new, logp_old, adv, 0.2)
    loss.backward()
    grad = logp_new.grad
    # r = 1.8 with A > 0: clipped, no gradient. r = 1.8 with A < 0: the unclipped term is the min, gradient.
    # r = 0.4 with A < 0: clipped, no gradient. r = 1.04 inside the range: gradient -r A / n.
    assert grad[0].item() == 0.0
    assert grad[1].item() == pytest.approx(1.8 / 4)
    assert grad[2].item() == 0.0
    assert grad[3].item() == pytest.approx(-1.04 / 4, rel=1e-5)


def test_kl_estimators_are_unbiased_under_the_old_policy():
    # Samples in exact proportion to p_old = [1/4, 1/2, 1/4]: the sample mean is the expectation.
    p_old = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)
    p_new = torch.tensor([0.4, 0.3, 0.3], dtype=torch.float64)
    actions = torch.tensor([0, 1, 1, 2])
    exact = (p_old * (p_old / p_new).log()).sum().item()
    for estimator in ("k1", "k3"):
        value = approx_kl(p_new.log()[actions], p_old.log()[actions], estimator).item()
        assert value == pytest.approx(exact, abs=1e-12)
    with pytest.raises(ValueError, match="k1"):
        approx_kl(p_new.log(), p_old.log(), "k4")


def test_k3_is_never_negative_but_k1_can_be():
    logp_old = torch.tensor([-1.0, -2.0])
    logp_new = torch.tensor([-0.5, -1.5])  # new policy likes every sampled action more
    assert approx_kl(logp_new, logp_old, "k1").item() < 0
    assert approx_kl(logp_new, logp_old, "k3").item() > 0


def test_value_loss_plain_and_clipped():
    v = torch.tensor([1.0, 3.0, -1.0])
    ret = torch.tensor([2.0, 0.0, -1.5])
    old = torch.tensor([0.0, 2.0, -1.0])
    loss, stats = value_loss(v, ret)
    assert loss.item() == pytest.approx((1 + 9 + 0.25) / 3)
    assert stats["value_loss"].item() == loss.item()
    # clipped predictions (ε = 0.5): 0.5, 2.5, -1 → squared errors 2.25, 6.25, 0.25; max with unclipped
    loss, _ = value_loss(v, ret, old, clip_range=0.5)
    assert loss.item() == pytest.approx((max(1, 2.25) + max(9, 6.25) + max(0.25, 0.25)) / 3)
    with pytest.raises(ValueError, match="old_values"):
        value_loss(v, ret, clip_range=0.5)


def test_policy_gradient_and_entropy_losses():
    logp = torch.tensor([-0.1, -2.0], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    loss, _ = policy_gradient_loss(logp, adv)
    assert loss.item() == pytest.approx(-(-0.2 + 2.0) / 2)
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv / 2)
    ent_loss, stats = entropy_loss(torch.tensor([0.5, 1.5]))
    assert ent_loss.item() == -1.0 and stats["entropy"].item() == 1.0


def test_explained_variance():
    target = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(target, target).item() == pytest.approx(1.0)
    assert explained_variance(torch.full((4,), 2.5), target).item() == pytest.approx(0.0)
    # error [1, -1, 1, -1] has variance 1; target variance 1.25
    assert explained_variance(target + torch.tensor([1.0, -1.0, 1.0, -1.0]), target).item() == pytest.approx(0.2)
    assert math.isnan(explained_variance(target, torch.ones(4)).item())
