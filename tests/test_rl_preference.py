"""DPO (sigmoid, label smoothing, IPO) and Bradley–Terry losses against their formulas, with Python floats."""

import math

import pytest
import torch

from spinwheel.preference.preference_losses import bradley_terry_loss, dpo_loss

# summed log-probs of 4 preference pairs under the policy and the reference
PI_C = [-10.0, -4.0, -7.5, -3.0]
PI_R = [-12.0, -3.0, -7.0, -6.0]
REF_C = [-11.0, -4.5, -7.0, -3.5]
REF_R = [-11.5, -3.5, -7.2, -5.0]


def _log_sigmoid(x):
    return -math.log1p(math.exp(-x))


def _tensors(requires_grad=False):
    t = [torch.tensor(v, dtype=torch.float64) for v in (PI_C, PI_R, REF_C, REF_R)]
    if requires_grad:
        t[0].requires_grad_()
        t[1].requires_grad_()
    return t


def _h(i):
    return (PI_C[i] - REF_C[i]) - (PI_R[i] - REF_R[i])


def test_dpo_sigmoid_equals_eq_7():
    beta = 0.1
    loss, stats = dpo_loss(*_tensors(), beta=beta)
    # DPO eq. (7): -log σ(β log π(y_w)/π_ref(y_w) - β log π(y_l)/π_ref(y_l))
    expected = sum(-_log_sigmoid(beta * _h(i)) for i in range(4)) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    # hand check of h: 1 - (-0.5) = 1.5; 0.5 - 0.5 = 0; -0.5 - 0.2 = -0.7; 0.5 - (-1) = 1.5
    assert [_h(i) for i in range(4)] == pytest.approx([1.5, 0.0, -0.7, 1.5])
    chosen = [beta * (PI_C[i] - REF_C[i]) for i in range(4)]
    rejected = [beta * (PI_R[i] - REF_R[i]) for i in range(4)]
    assert stats["rewards_chosen"].item() == pytest.approx(sum(chosen) / 4)
    assert stats["rewards_rejected"].item() == pytest.approx(sum(rejected) / 4)
    assert stats["margin"].item() == pytest.approx(sum(c - r for c, r in zip(chosen, rejected)) / 4)
    assert stats["accuracy"].item() == pytest.approx(2 / 4)  # h > 0 for pairs 0 and 3 only (pair 1 ties)


def test_dpo_gradient_equals_eq_8():
    # DPO eq. (8): ∇ = -β σ(-β h) (∇ log π(y_w) - ∇ log π(y_l)), here per pair / B
    beta = 0.5
    pi_c, pi_r, ref_c, ref_r = _tensors(requires_grad=True)
    loss, _ = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=beta)
    loss.backward()
    coef = [beta / (1 + math.exp(beta * _h(i))) / 4 for i in range(4)]
    assert pi_c.grad.tolist() == pytest.approx([-c for c in coef], abs=1e-12)
    assert pi_r.grad.tolist() == pytest.approx(coef, abs=1e-12)


def test_dpo_label_smoothing_is_conservative_dpo():
    beta, eps = 0.2, 0.1
    loss, _ = dpo_loss(*_tensors(), beta=beta, label_smoothing=eps)
    expected = sum(-(1 - eps) * _log_sigmoid(beta * _h(i)) - eps * _log_sigmoid(-beta * _h(i)) for i in range(4)) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    # at ε = 0.5 the label carries no information: the loss is even in h, so a tie gives the minimum log 2
    half, _ = dpo_loss(*[torch.zeros(1, dtype=torch.float64)] * 4, beta=beta, label_smoothing=0.5)
    assert half.item() == pytest.approx(math.log(2))
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*_tensors(), beta=beta, label_smoothing=0.6)


def test_ipo_equals_the_squared_loss():
    # IPO (Azar et al. 2023, eq. 17, as TRL writes it): (h - 1/(2β))², β as τ
    beta = 0.25
    loss, _ = dpo_loss(*_tensors(), beta=beta, loss_type="ipo")
    expected = sum((_h(i) - 1 / (2 * beta)) ** 2 for i in range(4)) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert expected == pytest.approx(((1.5 - 2) ** 2 + 4 + 2.7**2 + 0.25) / 4)
    with pytest.raises(ValueError, match="sigmoid"):
        dpo_loss(*_tensors(), beta=beta, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(*_tensors(), beta=beta, loss_type="hinge")


def test_pair_weights_make_shards_add_up():
    full, full_stats = dpo_loss(*_tensors(), beta=0.1)
    weights = torch.full((4,), 1 / 4, dtype=torch.float64)
    parts = [
        dpo_loss(*[t[rows] for t in _tensors()], beta=0.1, weights=weights[rows]) for rows in (slice(0, 1), slice(1, 4))
    ]
    assert sum(p[0].item() for p in parts) == pytest.approx(full.item(), abs=1e-12)
    assert sum(p[1]["accuracy"].item() for p in parts) == pytest.approx(full_stats["accuracy"].item())


def test_bradley_terry_equals_the_formula():
    r_c = torch.tensor([1.0, 0.2, -0.5, 3.0], dtype=torch.float64, requires_grad=True)
    r_r = torch.tensor([0.0, 0.7, -0.5, 1.0], dtype=torch.float64)
    loss, stats = bradley_terry_loss(r_c, r_r)
    diffs = [1.0, -0.5, 0.0, 2.0]
    assert loss.item() == pytest.approx(sum(-_log_sigmoid(d) for d in diffs) / 4, abs=1e-12)
    assert stats["accuracy"].item() == pytest.approx(2 / 4)  # a tie is not a correct ranking
    assert stats["margin"].item() == pytest.approx(sum(diffs) / 4)
    loss.backward()  # d/dr_c of -log σ(d) is -σ(-d)
    assert r_c.grad.tolist() == pytest.approx([-1 / (1 + math.exp(d)) / 4 for d in diffs], abs=1e-12)
    # Llama 2's margin: -log σ(r_c - r_r - m)
    margin = torch.tensor([0.5, 0.0, 1.0, 3.0], dtype=torch.float64)
    with_margin, _ = bradley_terry_loss(r_c, r_r, margin)
    expected = sum(-_log_sigmoid(d - m) for d, m in zip(diffs, margin.tolist())) / 4
    assert with_margin.item() == pytest.approx(expected, abs=1e-12)
    scalar, _ = bradley_terry_loss(r_c, r_r, 0.5)
    assert scalar.item() == pytest.approx(sum(-_log_sigmoid(d - 0.5) for d in diffs) / 4, abs=1e-12)
