"""GSPO (arXiv 2507.18071), the example of adding an algorithm: its loss against the paper's formula written out
as a loop over sequences, its gradient, and a short run through its command."""

from __future__ import annotations

import math

import pytest
import torch

from spinwheel.rl.llm.algorithms import ALGORITHMS
from spinwheel.rl.llm.token_losses import grpo_loss, token_weights


def _formula(logp, old, adv, mask, eps_low, eps_high) -> float:
    """Eq. (5)-(7), negated: -1/G Σ_i min(s_i A_i, clip(s_i, 1-ε_low, 1+ε_high) A_i),
    s_i = exp(1/|y_i| Σ_t (log π − log π_old)) over the sequence's tokens; G = the rows with tokens."""
    rows = [i for i in range(mask.shape[0]) if mask[i].sum() > 0]
    total = 0.0
    for i in rows:
        tokens = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
        s = math.exp(sum(float(logp[i, t] - old[i, t]) for t in tokens) / len(tokens))
        a = float(adv[i])
        total += min(s * a, min(max(s, 1 - eps_low), 1 + eps_high) * a)
    return -total / len(rows)


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.2, 0.28)])
def test_gspo_loss_equals_the_formula(eps):
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.float)
    old = -torch.rand(5, 4, generator=g) * 2
    logp = old + torch.randn(5, 4, generator=g) * 0.3  # ratios far enough from 1 that some clip
    adv = torch.tensor([1.0, -0.5, 0.7, 0.0, -1.2])
    weights = token_weights(mask, "seq-mean-token-mean")
    loss, stats = grpo_loss(logp, old, adv[:, None] * mask, weights, eps_low=eps[0], eps_high=eps[1], level="sequence")
    assert float(loss) == pytest.approx(_formula(logp, old, adv, mask, *eps), rel=1e-6)
    if eps[0] < 1e-3:
        assert float(stats["clip_frac"]) > 0  # the narrow paper range clips here: both branches are exercised


def test_gspo_gradient_is_the_sequence_ratio_times_the_mean_token_gradient():
    """∇ of an unclipped sequence's term: -A_i/G · s_i · (1/|y_i|) Σ_t ∇ log π(y_i,t) (the paper's eq. (10))."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -1.0]])
    logp = (old + torch.tensor([[0.01, -0.02, 0.0], [0.0, 0.01, 0.02]])).requires_grad_()
    adv = torch.tensor([1.0, -1.0])
    weights = token_weights(mask, "seq-mean-token-mean")
    loss, _ = grpo_loss(logp, old, adv[:, None] * mask, weights, eps_low=1, eps_high=1, level="sequence")
    loss.backward()
    s = (((logp - old) * mask).sum(1) / mask.sum(1)).exp().detach()
    expected = -(adv * s / 2)[:, None] * mask / mask.sum(1, keepdim=True)
    torch.testing.assert_close(logp.grad, expected)


def test_gspo_is_a_registered_command_with_its_own_defaults():
    from spinwheel.cli import build_parser

    assert ALGORITHMS["gspo"].defaults == {"eps_low": 3e-4, "eps_high": 4e-4}
    ns = build_parser().parse_args(["gspo"])
    assert (ns.algo, ns.eps_low, ns.eps_high, ns.out_dir) == ("gspo", 3e-4, 4e-4, "runs/gspo")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gspo", "--loss-agg", "token-mean"])  # it fixes its own aggregation


def test_gspo_runs_through_the_loop(tmp_path):
    from spinwheel.rl.llm import RLConfig, train_rl
    from spinwheel.tasks.arithmetic import ArithmeticConfig

    config = RLConfig(
        algo="gspo", model="test", out_dir=str(tmp_path), steps=3, prompts_per_step=2, group_size=4,
        max_new_tokens=3, epochs=2, eval_every=0, eval_examples=4, save_every=0, progress=False, num_threads=1,
        eps_low=3e-4, eps_high=4e-4, task=ArithmeticConfig(num_digits=1, num_train=20, num_test=4),
    )  # fmt: skip
    result = train_rl(config)
    records = result["history"]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and 0.9 < r["ratio_mean"] < 1.1 for r in records)
