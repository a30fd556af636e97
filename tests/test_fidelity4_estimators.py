"""Two identities the seed states about policy-gradient estimators, measured.

* **Reward-to-go vs total return** (Spinning Up, "Don't let the past distract you"; Williams 1992): weighting
  ∇log π(a_t|s_t) by the reward-to-go Σ_{t' ≥ t} r_t' instead of the whole return Σ_t' r_t' drops terms whose
  expectation is 0 (a reward earned before t does not depend on a_t), so both estimators have the same mean — the
  true gradient — and reward-to-go the lower variance. A statistical test over 40 000 episodes of a bandit-like
  chain (T = 6 Bernoulli(σ(θ)) actions, r_t = a_t + N(0, 1) noise; ∇J(θ) = T·σ(θ)(1 − σ(θ)) in closed form), the
  reward-to-go computed by :func:`spinwheel.rl.advantages.reward_to_go`.
* **TRPO's surrogate has the policy gradient as its gradient at θ_old** (Schulman et al., 2015, §3, eq. 14 and
  after): L(θ) = Σ w · π_θ/π_old · A, ∇L(θ_old) = Σ w · A · ∇log π_θ |_{θ_old}. The gradient the trust-region step
  starts from (:func:`spinwheel.rl.trpo.trust_region_step`'s first line, on the LLM TRPO's surrogate) against the
  REINFORCE gradient of the same batch; away from θ_old the two differ (the ratio weights the terms).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import Transformer
from spinwheel.rl import trpo as trpo_module
from spinwheel.rl.advantages import reward_to_go
from spinwheel.rl.llm.algorithms import trpo as llm_trpo
from spinwheel.rl.llm.token_losses import token_weights
from spinwheel.train.learners import LocalLearner, local_outputs

EPISODES, T, THETA = 40_000, 6, 0.3


@pytest.fixture(scope="module")
def estimates() -> dict[str, torch.Tensor]:
    """Per-episode gradient estimates of both estimators (float64)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.sigmoid(torch.tensor(THETA, dtype=torch.float64))
    actions = (torch.rand(T, EPISODES, generator=gen, dtype=torch.float64) < p).double()  # (T, N)
    rewards = actions + torch.randn(T, EPISODES, generator=gen, dtype=torch.float64)
    score = actions - p  # ∇_θ log π(a_t) for π(1) = σ(θ)
    terminated = torch.zeros(T, EPISODES, dtype=torch.bool)
    terminated[-1] = True
    rtg = reward_to_go(rewards, torch.zeros_like(rewards), terminated, torch.zeros_like(terminated), gamma=1.0)
    total = rtg[0].expand(T, EPISODES)  # the reward-to-go from t = 0 is the episode's return
    assert torch.allclose(total[0], rewards.sum(0))
    return {"rtg": (score * rtg).sum(0), "total": (score * total).sum(0), "truth": T * p * (1 - p)}


def test_reward_to_go_and_total_return_have_the_same_mean(estimates):
    truth = estimates["truth"].item()
    for name in ("rtg", "total"):
        g = estimates[name]
        standard_error = g.std().item() / math.sqrt(EPISODES)
        assert abs(g.mean().item() - truth) < 4 * standard_error, (name, g.mean().item(), truth, standard_error)
    paired = estimates["total"] - estimates["rtg"]  # the dropped terms: mean 0
    assert abs(paired.mean().item()) < 4 * paired.std().item() / math.sqrt(EPISODES)


def test_reward_to_go_has_lower_variance(estimates):
    ratio = (estimates["rtg"].var() / estimates["total"].var()).item()
    # the F test's 4-sigma band for 40 000 samples is ±3%: 0.9 is far outside it
    assert ratio < 0.6, ratio  # measured: 0.45


def _batch(model: Transformer, vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (6, 10), generator=gen)
    mask = (torch.arange(9)[None] >= torch.randint(1, 5, (6, 1), generator=gen)).float()
    batch = {
        "input_ids": ids[:, :-1],
        "labels": ids[:, 1:],
        "weights": token_weights(mask, "token-mean"),
        "advantages": torch.randn(6, 1, generator=gen).expand(6, 9) * mask,
    }
    with torch.no_grad():
        batch["old_logprobs"] = local_outputs(model, batch, False).logprobs
    return batch


def _policy_gradient(model: Transformer, batch: dict[str, torch.Tensor], params) -> torch.Tensor:
    """REINFORCE: ∇ Σ w · A · log π_θ(label), written out from the logits."""
    logp = F.log_softmax(model(batch["input_ids"]).float(), -1).gather(-1, batch["labels"][..., None])[..., 0]
    loss = (batch["weights"] * batch["advantages"] * logp).sum()
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])


def test_trpo_surrogate_gradient_is_the_policy_gradient_at_theta_old(monkeypatch):
    vocab = 48
    model = Transformer(preset_config("test", vocab)).init_weights(5)
    batch = _batch(model, vocab)
    seen = {}
    step = trpo_module.trust_region_step

    def capture(params, surrogate_fn, kl_fn, max_kl, **kwargs):
        params = list(params)
        seen["params"], seen["surrogate_fn"] = params, surrogate_fn
        seen["at_old"] = trpo_module.flat_grad(surrogate_fn(), params)  # what the step starts from
        seen["pg_old"] = _policy_gradient(model, batch, params)
        return step(params, surrogate_fn, kl_fn, max_kl, **kwargs)

    monkeypatch.setattr(llm_trpo, "trust_region_step", capture)
    stats = llm_trpo.trpo_update(LocalLearner(model, None), batch, max_kl=1e-2, damping=0.1, cg_iters=10)
    got, want = seen["at_old"], seen["pg_old"]
    assert want.norm() > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    # After the step (θ ≠ θ_old) the ratio π_θ/π_old weights the terms: the two gradients part.
    assert stats["accepted"] == 1.0
    after = trpo_module.flat_grad(seen["surrogate_fn"](), seen["params"])
    assert (after - _policy_gradient(model, batch, seen["params"])).norm() > 1e-3 * want.norm()
