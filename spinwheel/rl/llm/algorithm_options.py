"""Which :class:`~spinwheel.rl.llm.config.RLConfig` options act for which algorithm, by command name: the table the
config validates against (it imports nothing of the run, so the config needs no algorithm to check its options)
and each algorithm class declares as its ``options``. Every other field is shared by all algorithms."""

from __future__ import annotations

# The clipped-surrogate options every member of the GRPO family takes.
SURROGATE = frozenset({"beta", "eps_low", "eps_high", "epochs", "minibatches", "tis_cap", "loss_agg"})
# Asynchronous rollouts and their sequence-level correction (token-level IS weights on the surrogate).
ASYNC = frozenset({"max_staleness", "mis_cap", "rollout_ranks"})
PPO_OPTIONS = frozenset(
    {"beta", "eps_low", "eps_high", "epochs", "minibatches", "tis_cap", "loss_agg", "gamma", "lam", "critic_lr"}
    | {"value_clip", "whiten_advantages", "kl_target", "kl_horizon", "max_staleness", "mis_cap", "rollout_ranks"}
)

OPTIONS: dict[str, frozenset[str]] = {
    "grpo": SURROGATE | ASYNC | {"kl_estimator", "scale_rewards"},
    "rloo": SURROGATE | ASYNC | {"kl_estimator"},
    "reinforce-pp": SURROGATE | ASYNC,
    "ppo": PPO_OPTIONS,
    "trpo": frozenset({"scale_rewards", "loss_agg", "max_kl", "cg_iters", "cg_damping", "fisher_fraction"}),
    "gspo": frozenset({"beta", "kl_estimator", "eps_low", "eps_high", "scale_rewards", "epochs", "minibatches"}),
    "cispo": SURROGATE | ASYNC | {"kl_estimator", "scale_rewards"},
}
ALGORITHM_OPTIONS = frozenset().union(*OPTIONS.values())  # options that act for some algorithms only
AGENT_ALGOS = ("grpo", "rloo", "reinforce-pp")  # --agent: the group-baseline algorithms (one reward per run)
