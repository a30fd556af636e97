"""A short GRPO run on a black-box agent (:mod:`~spinwheel.rl.llm.agent_proxy`), one process, no harness: what
``spinwheel grpo --agent`` does inside the run loop (:mod:`~spinwheel.rl.llm.agent_run`: checkpoints, resume,
logging, every option of the command), as a small command of its own::

    python -m spinwheel.rl.llm.agent_train --model runs/agent-sft/checkpoint \\
        --agent examples/calculator_agent.py:agent --tasks examples/calculator_agent.py:task --steps 20

Each step: ``tasks_per_step`` tasks (``task(seed, split)`` from the ``--tasks`` function, seeds drawn per step), each
run ``group_size`` times by the agent against the policy served on a local base URL; the recorded episodes →
group-normalised advantages → the GRPO loss (clip 0.2, no KL, ``token-mean`` aggregation as ``spinwheel grpo``'s
default) on the sampled tokens only → the update, which the engine reads in place (the same model object).
Held-out success (test-split tasks, greedy by default: the task's ``temperature`` set to ``--eval-temperature``) is
measured before and after.

Task keys the runner sets, for the agent to honour: ``temperature`` (what to sample at; the trainer's log-probs are
of the distribution at ``--temperature``, and ``mismatch_max`` in the log shows an agent that samples otherwise).
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from spinwheel.engine import LLM
from spinwheel.rl.llm.agent_proxy import Agent, AgentConfig, agent_metrics, load_agent, play_agent_episodes
from spinwheel.rl.llm.episode_tokens import Episode, episode_batch, episode_metrics, episode_rewards
from spinwheel.rl.llm.token_advantages import group_advantages
from spinwheel.rl.llm.token_losses import grpo_loss, logprob_mismatch, token_weights
from spinwheel.train.learners import LocalLearner, OptimConfig

TaskFn = Callable[[int, str], dict]


@dataclass
class AgentTrainConfig:
    model: str  # a checkpoint directory or a preset
    agent: str  # module:function or path/to/file.py:function, agent(client, task) -> reward
    tasks: str  # module:function or path/to/file.py:function, task(seed, split) -> dict
    steps: int = 20
    tasks_per_step: int = 8
    group_size: int = 8
    lr: float = 5e-5
    updates_per_step: int = 1  # optimizer steps on each step's episodes (the ratio is clipped from the second on)
    loss_agg: str = "token-mean"  # or seq-mean-token-mean (the GRPO paper), seq-mean-token-sum-norm (Dr. GRPO)
    temperature: float = 1.0
    eval_tasks: int = 50  # held-out tasks before and after (0: none)
    eval_temperature: float = 0.0  # 0: greedy; the training temperature measures what GRPO sharpened
    seed: int = 0
    timeout_s: float = 60.0  # per agent run
    num_workers: int = 16  # agent runs at once
    out_dir: str | None = None  # where the trained checkpoint goes (None: not saved)


def grpo_step(
    learner: LocalLearner,
    episodes: list[Episode],
    group_size: int,
    lr: float,
    updates: int,
    pad: int,
    loss_agg: str = "token-mean",
) -> dict:
    """One GRPO update on the episodes (group-major, ``group_size`` per task); the step's figures."""
    rewards, keep = episode_rewards(episodes, group_size)
    batch = episode_batch(episodes, pad)
    inputs = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    old = learner.forward(inputs)["logprobs"]
    advantages = group_advantages(rewards, group_size)
    weights = token_weights(batch["mask"] * keep[:, None], loss_agg)  # type: ignore[arg-type]

    def loss_fn(out: Any, _batch: Any) -> tuple[torch.Tensor, dict]:
        return grpo_loss(out.logprobs, old, advantages, weights)

    losses = [learner.train_step(inputs, loss_fn, lr).loss for _ in range(updates)]
    mismatch = logprob_mismatch(old, batch["engine_logprobs"], batch["mask"])
    return {
        "loss": losses[-1],
        "mismatch_max": float(mismatch["mismatch_max"]),
        **episode_metrics(episodes),
        **agent_metrics(episodes),  # type: ignore[arg-type]
    }


def evaluate_agent(
    llm: LLM, agent: Agent, make_task: TaskFn, num: int, seed: int, config: AgentConfig, temperature: float = 0.0
) -> dict:
    """Success on ``num`` test-split tasks (greedy by default): the mean reward of the runs that did not fail, and
    the failures."""
    tasks = [{**make_task(seed * 1_000_003 + i, "test"), "temperature": temperature} for i in range(num)]
    episodes = play_agent_episodes(llm, agent, tasks, 1, seed=seed, config=config)
    ok = [e.reward for e in episodes if not e.failed]
    return {"success": sum(ok) / max(1, len(ok)), "failed": len(episodes) - len(ok)}


def train_agent(config: AgentTrainConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The run (module docstring); returns held-out success before and after and each step's figures."""
    import spinwheel

    torch.manual_seed(config.seed)
    agent, make_task = load_agent(config.agent), load_agent(config.tasks)
    model, tokenizer = spinwheel.load_model(config.model, dtype="float32"), spinwheel.load_tokenizer(config.model)
    learner = LocalLearner(model, OptimConfig(lr=config.lr), temperature=config.temperature)
    llm = LLM(model, tokenizer, seed=config.seed)
    run_config = AgentConfig(timeout_s=config.timeout_s, num_workers=config.num_workers)
    result: dict[str, Any] = {"steps": []}
    evaluation = (config.eval_tasks, config.seed, run_config, config.eval_temperature)
    if config.eval_tasks:
        result["before"] = evaluate_agent(llm, agent, make_task, *evaluation)
        log(f"agent_train: held-out success before {result['before']['success']:.3f}")
    rng = random.Random(config.seed)
    for step in range(config.steps):
        t0 = time.perf_counter()
        tasks = [
            {**make_task(rng.randrange(2**31), "train"), "temperature": config.temperature}
            for _ in range(config.tasks_per_step)
        ]
        episodes = play_agent_episodes(llm, agent, tasks, config.group_size, config.seed, step, run_config)
        if 2 * sum(e.failed for e in episodes) > len(episodes):
            error = next(e.error for e in episodes if e.failed)
            raise SystemExit(f"agent_train: step {step}: most agent runs failed: {error}")
        figures = grpo_step(
            learner, episodes, config.group_size, config.lr, config.updates_per_step, tokenizer.pad_id, config.loss_agg
        )
        llm.update_weights(model)
        figures.update(step=step, step_s=time.perf_counter() - t0)
        result["steps"].append(figures)
        log(
            f"agent_train: step {step} reward {figures['episode_reward_mean']:.3f} loss {figures['loss']:.4f} "
            f"calls {figures['agent_calls_mean']:.2f} failed {figures['episodes_failed']:.0f} "
            f"mismatch {figures['mismatch_max']:.1e} ({figures['step_s']:.1f} s)"
        )
        if not math.isfinite(figures["loss"]):
            raise SystemExit(f"agent_train: step {step}: the loss is not finite")
    if config.eval_tasks:
        result["after"] = evaluate_agent(llm, agent, make_task, *evaluation)
        log(f"agent_train: held-out success after {result['after']['success']:.3f}")
    if config.out_dir:
        spinwheel.save_pretrained(model, config.out_dir, tokenizer=tokenizer)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m spinwheel.rl.llm.agent_train", description=__doc__.split("\n")[0])
    defaults = AgentTrainConfig("", "", "")
    for name, value in vars(defaults).items():
        flag = "--" + name.replace("_", "-")
        if name in ("model", "agent", "tasks"):
            parser.add_argument(flag, required=True)
        elif name == "out_dir":
            parser.add_argument(flag, default=None)
        else:
            parser.add_argument(flag, type=type(value), default=value)
    args = parser.parse_args(argv)
    try:
        train_agent(AgentTrainConfig(**vars(args)))
    except ValueError as e:  # a bad --agent / --tasks: one line
        raise SystemExit(f"agent_train: error: {e}") from None


if __name__ == "__main__":
    main()
