"""spinwheel vs Stable-Baselines3 on classic control: final return and env-steps/s, side by side, one run.

For each seed the two libraries train in turn in this process (interleaved, so a change in machine load
hits both), with the same environment, budget, network (separate 64-64 tanh actor and critic, orthogonal
init) and hyperparameters; SB3 PPO for ``ppo``, sb3-contrib TRPO for ``trpo``. Both final policies are
evaluated by the same deterministic routine on the same seeded episodes.

env-steps/s = environment steps / wall seconds of training (evaluation and model construction excluded);
CPU-steps/s uses this process's CPU time instead, which a busy shared machine disturbs less.

    .venv/bin/pip install -e ".[bench]"
    .venv/bin/python benchmarks/classic_rl.py                        # CartPole-v1, ppo+trpo, 5 seeds, 100k steps
    .venv/bin/python benchmarks/classic_rl.py --algos ppo --seeds 0 1 --steps 50000
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spinwheel.rl.classic import ClassicConfig, train  # noqa: E402
from spinwheel.rl.classic.envs import evaluate_policy  # noqa: E402

# Hyperparameters per (algo, env), used by both libraries. PPO: the rl-baselines3-zoo CartPole tuning with a
# constant clip range; TRPO: a 1024-step batch, δ = 0.02.
SETTINGS = {
    "ppo": dict(
        num_envs=8,
        num_steps=32,
        minibatch_size=256,
        update_epochs=20,
        gamma=0.98,
        gae_lambda=0.8,
        lr=1e-3,
        anneal_lr=True,
        clip_range=0.2,
        ent_coef=0.0,
        vf_coef=0.5,
        max_grad_norm=0.5,
    ),
    "trpo": dict(
        num_envs=4,
        num_steps=256,
        minibatch_size=128,
        update_epochs=10,
        gamma=0.99,
        gae_lambda=0.95,
        vf_lr=1e-3,
        max_kl=0.02,
        cg_iters=10,
        cg_damping=0.1,
        backtrack_coef=0.8,
        backtrack_iters=10,
    ),
}


class SB3Adapter:
    """Gives an SB3 model the ``deterministic_action`` that :func:`evaluate_policy` calls."""

    def __init__(self, model):
        self.model = model

    def deterministic_action(self, obs: torch.Tensor) -> torch.Tensor:
        action, _ = self.model.predict(obs.numpy(), deterministic=True)
        return torch.as_tensor(action)


def run_spinwheel(algo: str, env: str, steps: int, seed: int, eval_episodes: int, out_root: str) -> dict:
    config = ClassicConfig(
        algo=algo,
        env=env,
        steps=steps,
        seed=seed,
        eval_episodes=eval_episodes,
        out_dir=f"{out_root}/spinwheel-{algo}-{seed}",
        progress=False,
        **SETTINGS[algo],
    )
    result = train(config)
    return {
        "eval_mean": result["eval_return_mean"],
        "eval_std": result["eval_return_std"],
        "env_steps": result["env_steps"],
        "train_s": result["train_seconds"],
        "cpu_s": result["train_cpu_seconds"],
    }


def run_sb3(algo: str, env: str, steps: int, seed: int, eval_episodes: int) -> dict:
    from stable_baselines3.common.env_util import make_vec_env

    s = SETTINGS[algo]
    vec_env = make_vec_env(env, n_envs=s["num_envs"], seed=seed)
    policy_kwargs = dict(net_arch=dict(pi=[64, 64], vf=[64, 64]), activation_fn=torch.nn.Tanh)
    if algo == "ppo":
        from stable_baselines3 import PPO

        lr = s["lr"]
        model = PPO(
            "MlpPolicy",
            vec_env,
            n_steps=s["num_steps"],
            batch_size=s["minibatch_size"],
            n_epochs=s["update_epochs"],
            gamma=s["gamma"],
            gae_lambda=s["gae_lambda"],
            learning_rate=(lambda remaining: lr * remaining) if s["anneal_lr"] else lr,
            clip_range=s["clip_range"],
            ent_coef=s["ent_coef"],
            vf_coef=s["vf_coef"],
            max_grad_norm=s["max_grad_norm"],
            policy_kwargs=policy_kwargs,
            seed=seed,
            device="cpu",
        )
    else:
        from sb3_contrib import TRPO

        model = TRPO(
            "MlpPolicy",
            vec_env,
            n_steps=s["num_steps"],
            batch_size=s["minibatch_size"],
            n_critic_updates=s["update_epochs"],
            gamma=s["gamma"],
            gae_lambda=s["gae_lambda"],
            learning_rate=s["vf_lr"],
            target_kl=s["max_kl"],
            cg_max_steps=s["cg_iters"],
            cg_damping=s["cg_damping"],
            line_search_shrinking_factor=s["backtrack_coef"],
            line_search_max_iter=s["backtrack_iters"],
            policy_kwargs=policy_kwargs,
            seed=seed,
            device="cpu",
        )
    cpu, start = time.process_time(), time.perf_counter()
    model.learn(total_timesteps=steps)
    train_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    returns = evaluate_policy(SB3Adapter(model), env, eval_episodes, seed=seed + 1_000_000)
    vec_env.close()
    return {
        "eval_mean": float(np.mean(returns)),
        "eval_std": float(np.std(returns)),
        "env_steps": model.num_timesteps,
        "train_s": train_s,
        "cpu_s": cpu_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--algos", nargs="+", default=["ppo", "trpo"], choices=sorted(SETTINGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--eval-episodes", type=int, default=10)
    parser.add_argument("--target", type=float, default=500.0, help="return that counts as solved")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-sb3", action="store_true", help="run spinwheel only")
    parser.add_argument("--json", help="also write the per-run figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print(f"# classic RL benchmark: {args.env}, {args.steps} steps, seeds {args.seeds}, algos {args.algos}")
    print(
        f"# torch {torch.__version__}, {args.threads} thread(s), python {platform.python_version()}, "
        f"{platform.processor() or platform.machine()}; network: actor 64-64 tanh + critic 64-64 tanh"
    )
    for algo in args.algos:
        print(f"# {algo} settings (both libraries): {SETTINGS[algo]}")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as out_root:
        for seed in args.seeds:
            for algo in args.algos:
                row = {
                    "algo": algo,
                    "seed": seed,
                    "spinwheel": run_spinwheel(algo, args.env, args.steps, seed, args.eval_episodes, out_root),
                }
                if not args.no_sb3:
                    row["sb3"] = run_sb3(algo, args.env, args.steps, seed, args.eval_episodes)
                runs.append(row)
                print(format_row(row), flush=True)

    print()
    print(summary(runs, args.algos, args.target))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


def _sps(r: dict) -> float:
    return r["env_steps"] / r["train_s"]


def _cpu_sps(r: dict) -> float:
    return r["env_steps"] / r["cpu_s"]


def format_row(row: dict) -> str:
    sw = row["spinwheel"]
    text = (
        f"{row['algo']:5s} seed {row['seed']}: spinwheel return {sw['eval_mean']:6.1f} ± {sw['eval_std']:5.1f}, "
        f"{_sps(sw):6.0f} steps/s"
    )
    if "sb3" in row:
        sb = row["sb3"]
        text += (
            f" | SB3 return {sb['eval_mean']:6.1f} ± {sb['eval_std']:5.1f}, {_sps(sb):6.0f} steps/s"
            f" | speed ratio {_sps(sw) / _sps(sb):.2f}× (CPU-time {_cpu_sps(sw) / _cpu_sps(sb):.2f}×)"
        )
    return text


def summary(runs: list[dict], algos: list[str], target: float) -> str:
    lines = [
        "| algo | library | final return per seed (deterministic eval) | seeds at target | "
        "median env-steps/s | median ratio (wall / CPU) |",
        "|---|---|---|---|---|---|",
    ]
    for algo in algos:
        rows = [r for r in runs if r["algo"] == algo]
        for lib in ("spinwheel", "sb3"):
            if not rows or lib not in rows[0]:
                continue
            figures = [r[lib] for r in rows]
            returns = ", ".join(f"{f['eval_mean']:.0f}" for f in figures)
            solved = sum(f["eval_mean"] >= target for f in figures)
            ratio = ""
            if lib == "spinwheel" and "sb3" in rows[0]:
                wall = statistics.median(_sps(r["spinwheel"]) / _sps(r["sb3"]) for r in rows)
                cpu = statistics.median(_cpu_sps(r["spinwheel"]) / _cpu_sps(r["sb3"]) for r in rows)
                ratio = f"{wall:.2f}× / {cpu:.2f}×"
            name = "spinwheel" if lib == "spinwheel" else ("SB3 PPO" if algo == "ppo" else "sb3-contrib TRPO")
            lines.append(
                f"| {algo} | {name} | {returns} | {solved}/{len(figures)} | "
                f"{statistics.median(_sps(f) for f in figures):.0f} | {ratio} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
