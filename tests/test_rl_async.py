"""Asynchronous rollouts (``--max-staleness``): K = 0 is the synchronous run bit for bit, K = 1 overlaps and logs
its staleness, stale samples are dropped and counted; the off-policy losses (decoupled PPO, MIS, CISPO) equal their
formulas on hand-made inputs."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import small_config

import spinwheel.rl.llm.rollouts.async_rollouts as async_rollouts
from spinwheel.models.hf import load_model
from spinwheel.rl.llm import train_rl
from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm.off_policy import (
    cispo_loss,
    decoupled_policy_loss,
    off_policy_weights,
    sequence_is_mask,
    staleness_figures,
)
from spinwheel.rl.llm.rollouts.async_rollouts import RolloutProducer, WeightBox
from spinwheel.train.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("digit_reward")  # the reward module `rl_test_reward:digits` (helpers.py)


def _steps(path) -> list[dict]:
    return [r for r in read_metrics(path / "metrics.jsonl") if "reward_mean" in r]


def test_staleness_zero_is_the_synchronous_run_exactly(tmp_path):
    """The producer thread, the engine's own weight copy and the published versions change nothing at K = 0: the
    same rewards, losses and final weights, bit for bit in fp32."""
    for name, k in (("sync", None), ("k0", 0)):
        train_rl(small_config(tmp_path / name, steps=3, max_staleness=k))
    sync, k0 = _steps(tmp_path / "sync"), _steps(tmp_path / "k0")
    for key in ("reward_mean", "loss", "kl_ref", "grad_norm", "mismatch_max"):
        assert [r[key] for r in k0] == [r[key] for r in sync], key
    assert all(r["dropped_samples"] == 0 and r["staleness/0"] == 1.0 for r in k0)
    want = load_model(tmp_path / "sync" / "checkpoint").state_dict()
    for name, w in load_model(tmp_path / "k0" / "checkpoint").state_dict().items():
        assert torch.equal(w, want[name]), name


def test_staleness_one_overlaps_and_logs_its_staleness(tmp_path):
    train_rl(small_config(tmp_path, steps=3, max_staleness=1))
    recs = _steps(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert r["dropped_samples"] == 0 and r["staleness_max"] <= 1
        shares = [v for k, v in r.items() if k.startswith("staleness/")]
        assert sum(shares) == pytest.approx(1.0)
        assert all(f"time/{p}" in r for p in ("generate", "wait_rollout", "wait_weights", "step", "train"))
        assert r["overlap"] > 0 and math.isfinite(r["loss"])
    assert recs[0]["staleness/0"] == 1.0  # step 0 is sampled by the initial weights, which it trains


def test_samples_older_than_k_are_dropped_and_counted(tmp_path, monkeypatch):
    """A producer forced to run two steps ahead on weights it never updates: step s's samples are s versions old;
    with K = 1 those of step 2 are dropped (and counted), with a large K none is."""
    monkeypatch.setattr(WeightBox, "latest", lambda self: (-1, None))  # the engine keeps the initial weights
    ahead = lambda play, engine, first, end, k, *a: RolloutProducer(play, engine, first, end, 2, *a)  # noqa: E731
    monkeypatch.setattr(async_rollouts, "RolloutProducer", ahead)
    for name, k in (("k1", 1), ("k5", 5)):
        train_rl(small_config(tmp_path / name, steps=3, max_staleness=k))
    k1, k5 = _steps(tmp_path / "k1"), _steps(tmp_path / "k5")
    rows = 4 * 4  # prompts × group size
    assert [r["dropped_samples"] for r in k1] == [0, 0, rows] and [r["kept_groups"] for r in k1][2] == 0
    assert [r["dropped_samples"] for r in k5] == [0, 0, 0]
    assert [r["staleness_max"] for r in k5] == [0, 1, 2] and k5[2]["staleness/2"] == 1.0


def test_staleness_figures_by_hand():
    versions = torch.tensor([[3, 3, 2, 0], [1, 1, 3, 3], [3, 3, 3, 3]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 0], [0, 1, 1, 1]])  # row 0's version 0 is off the mask
    keep, fig = staleness_figures(versions, mask, step=3, max_staleness=1)
    assert keep.tolist() == [1.0, 0.0, 1.0] and fig["dropped_samples"] == 1
    assert fig["staleness/0"] == pytest.approx(5 / 6) and fig["staleness/1"] == pytest.approx(1 / 6)


def _hand_made(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(3, 5, generator=g) * 2).requires_grad_()
    prox = logp.detach() + torch.randn(3, 5, generator=g) * 0.3
    behav = prox + torch.randn(3, 5, generator=g) * 0.4
    adv = torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1.0, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    return logp, prox, behav, adv, mask, mask / mask.sum()


def test_decoupled_ppo_objective_equals_its_formula():
    """AReaL's decoupled loss: −Σ w · (π_prox / π_behav) · min(r·A, clip(r, 1 − ε, 1 + ε_h)·A), r = π / π_prox."""
    logp, prox, behav, adv, mask, w = _hand_made()
    for cap in (None, 1.5):
        loss, _ = decoupled_policy_loss(logp, prox, behav, adv, w, 0.2, 0.3, cap=cap)
        r = (logp - prox).exp()
        behaviour = (prox - behav).exp() if cap is None else (prox - behav).exp().clamp(max=cap)
        want = -(w * behaviour * torch.minimum(r * adv, r.clamp(0.8, 1.3) * adv)).sum()
        torch.testing.assert_close(loss, want)
    # in the loop: the behaviour weight on stale tokens only; TIS caps every token; MIS zeroes whole rows
    stale = torch.zeros_like(mask)
    stale[0, :2] = 1
    weights = off_policy_weights(prox, behav, mask, stale)
    torch.testing.assert_close(weights[0, :2], (prox - behav).exp()[0, :2])
    assert weights[0, 2:].tolist() == [1.0] * 3 and weights[1:].eq(1).all()
    assert off_policy_weights(prox, behav, mask, torch.zeros_like(mask)) is None
    keep = sequence_is_mask(prox, behav, mask, 2.0)
    seq_ratio = ((prox - behav) * mask).sum(1).exp()
    assert keep.tolist() == [float(0.5 <= x <= 2.0) for x in seq_ratio.tolist()]
    mis = off_policy_weights(prox, behav, mask, None, mis_cap=2.0)
    torch.testing.assert_close(mis, keep[:, None].expand(3, 5))


def test_cispo_equals_its_formula():
    """CISPO: loss = −Σ w · sg(clip(r, 1 − ε_low, 1 + ε_high)) · A · log π; its gradient in log π is
    −w · clip(r) · A on every token (none is silenced by the clip)."""
    logp, prox, _, adv, mask, w = _hand_made(1)
    loss, stats = cispo_loss(logp, prox, adv, w, eps_low=0.1, eps_high=0.2)
    clipped = (logp.detach() - prox).exp().clamp(0.9, 1.2)
    torch.testing.assert_close(loss, -(w * clipped * adv * logp.detach()).sum())
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, -w * clipped * adv)
    r = (logp.detach() - prox).exp()
    assert stats["clip_frac"] == pytest.approx(float((w * ((r < 0.9) | (r > 1.2))).sum()))


def test_algorithms_that_refuse_asynchronous_rollouts():
    with pytest.raises(ValueError, match="--max-staleness does not act for trpo"):
        RLConfig(algo="trpo", max_staleness=1)
    RLConfig(algo="cispo", max_staleness=1)
    with pytest.raises(ValueError, match="give --max-staleness K"):
        RLConfig(kv_on_update="recompute")
    RLConfig(algo="ppo", max_staleness=0)
