"""PPO's critic learns its value function (Schulman et al., 2017; Ouyang et al., 2022): over a short LLM PPO run of
the tiny built-in model on 1-digit arithmetic, the clipped value loss falls and the explained variance of the
critic's rollout-time values V(s_t) for the GAE returns R_t,

    EV = 1 − Var[R − V] / Var[R]          (over the sampled tokens of a step's batch; CleanRL's diagnostic),

rises from below 0 (a fresh scalar head's values are off) to above 0 (part of the variation explained). Each
step's EV is measured *before* the critic trains on that step's batch: it scores what the critic learned from
earlier batches on rollouts it has not seen.
"""

from __future__ import annotations

import pytest
import torch
from helpers import REWARD_MODULE, small_config

from spinwheel.rl.llm import train_rl
from spinwheel.rl.llm.algorithms.ppo import PPO
from spinwheel.rl.losses import explained_variance
from spinwheel.train.metrics import read_metrics

STEPS = 12


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory) -> tuple[list[float], list[float]]:
    """(value loss, explained variance) per step."""
    seen: list[float] = []
    prepare = PPO.prepare

    def measured_prepare(self, rewards, mask, inputs, old_logprobs, ref_logprobs, *step_data):
        out = prepare(self, rewards, mask, inputs, old_logprobs, ref_logprobs, *step_data)
        on = mask.bool()
        seen.append(explained_variance(out["old_values"][on].double(), out["returns"][on].double()).item())
        return out

    out_dir = tmp_path_factory.mktemp("ppo")
    (out_dir / "rl_test_reward.py").write_text(REWARD_MODULE)  # the reward `rl_test_reward:digits` (helpers.py)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(out_dir))
        mp.setattr(PPO, "prepare", measured_prepare)
        # λ = 1: the value targets are the Monte-Carlo returns, not partly the critic's own bootstrap
        config = dict(critic_lr=3e-3, beta=0.02, max_new_tokens=4, prompts_per_step=8, lam=1.0, epochs=4)
        train_rl(small_config(out_dir, algo="ppo", steps=STEPS, **config))
    losses = [r["value_loss"] for r in read_metrics(out_dir / "metrics.jsonl") if "value_loss" in r]
    return losses, seen


@pytest.mark.slow
def test_value_loss_falls(ppo_run):
    losses, _ = ppo_run
    assert len(losses) == STEPS
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.2 * first, losses  # measured: 0.92 -> 0.026


@pytest.mark.slow
def test_explained_variance_rises(ppo_run):
    _, ev = ppo_run
    assert len(ev) == STEPS and all(torch.isfinite(torch.tensor(ev)))
    first, last = sum(ev[:3]) / 3, sum(ev[-3:]) / 3
    # measured: from -28 (a fresh scalar head's values are off in scale) to 0.18 (it predicts part of the variation
    # between completions from the tokens sampled so far)
    assert first < -1 and last > 0.05, ev
