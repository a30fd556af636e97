"""``spinwheel grpo | rloo | reinforce-pp --agent module:function``: the RL run on a black-box agent's episodes.

With ``--agent`` the run's episodes come from an agent written against the OpenAI API
(:mod:`~spinwheel.rl.llm.agents.agent_proxy`: the current policy served on a local base URL, every call's tokens
recorded
as the engine sampled them) instead of environments; everything else is the RL loop's (the algorithm, held-out
evaluation, logging, checkpoints, resume). ``--agent-tasks module:function`` gives ``task(seed, split) -> dict`` (by
default the function ``task`` of the agent's module): step s draws ``prompts_per_step`` task seeds as for a
procedural environment, each run ``group_size`` times; held-out evaluation runs test-split tasks 0..N-1 once each,
greedy. The runner sets the task's ``temperature`` key (the agent should sample at it; ``mismatch_max`` shows one
that does not). An agent run that raises, passes ``--agent-timeout-s`` or returns a non-finite reward fails its
episode, which is counted and left out of the loss (a step whose runs mostly fail stops the run in one line).

One process, synchronous loop, the group-baseline algorithms (the agent's reward is one number per run): other
layouts and algorithms are refused at start in one line.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from spinwheel.parallel.mesh import ParallelDims
from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm.rewards import RewardError
from spinwheel.rl.llm.rollout import dp_share
from spinwheel.rl.llm.rollouts.episode_source import EpisodeSource


class AgentTasks:
    """The agent and its task function (``--agent``, ``--agent-tasks``); :meth:`play` runs a share of a step."""

    def __init__(self, config: RLConfig) -> None:
        from spinwheel.rl.llm.agents.agent_proxy import AgentConfig, load_agent

        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError("--agent runs in one process for now: run it without torchrun")
        self.agent = load_agent(config.agent)
        self.spec = config.agent_tasks or f"{config.agent.rpartition(':')[0]}:task"
        try:
            self.make_task = load_agent(self.spec)
        except ValueError as e:
            if config.agent_tasks is None:
                raise ValueError(
                    f"--agent {config.agent!r}: its module has no function task(seed, split); give --agent-tasks "
                    "module:function"
                ) from None
            raise ValueError(str(e).replace("--agent", "--agent-tasks", 1)) from None
        self.run_config = AgentConfig(timeout_s=config.agent_timeout_s)

    def tasks(self, seeds: Sequence[int], split: str, temperature: float) -> list[dict]:
        """The tasks of ``seeds`` with the temperature to sample at; a task function that fails stops the step."""
        out = []
        for seed in seeds:
            try:
                task = self.make_task(seed, split)
            except Exception as e:  # noqa: BLE001 - the user's function: one line
                what = f"raised {type(e).__name__}: {e}"
                raise RewardError(f"--agent-tasks {self.spec}: task({seed}, {split!r}) {what}") from None
            if not isinstance(task, dict):
                raise RewardError(f"--agent-tasks {self.spec}: task({seed}, {split!r}) returned {type(task).__name__}, "
                                  "not a dict")  # fmt: skip
            out.append({**task, "temperature": temperature})
        return out

    def play(
        self,
        llm: Any,
        seeds: Sequence[int],
        step: int,
        seed: int,
        group_size: int,
        temperature: float,
        split: str,
        should_stop: Callable[[], bool] | None,
    ) -> list:
        """``group_size`` agent runs on each seed's task (group-major), on ``llm``'s engine."""
        from spinwheel.rl.llm.agents.agent_proxy import play_agent_episodes

        tasks = self.tasks(seeds, split, temperature)
        return play_agent_episodes(llm, self.agent, tasks, group_size, seed, step, self.run_config, should_stop)


class AgentSource(EpisodeSource):
    """The run's episode source under ``--agent``: each group is ``group_size`` runs of the agent on one task
    (procedural tasks: ``num_train`` None), played by :class:`AgentTasks` instead of environments; the step's
    seeds, its failure rules and held-out evaluation are
    :class:`~spinwheel.rl.llm.rollouts.episode_source.EpisodeSource`'s."""

    def __init__(
        self, config: RLConfig, dims: ParallelDims | None, should_stop: Callable[[], bool] | None = None
    ) -> None:
        self.tasks = AgentTasks(config)
        super().__init__(config, None, dims, should_stop)

    def num_tasks(self, split: str) -> int | None:
        return None

    def max_model_len(self, context: int) -> int:
        return min(self.config.max_episode_tokens or context, context)

    def figures(self, episodes: list) -> dict[str, float]:
        from spinwheel.rl.llm.agents.agent_proxy import agent_metrics

        return agent_metrics(episodes)  # model calls per run, runs whose calls did not chain

    def groups(self, llm: Any, seeds: list[int], step: int, dims: Any, should_stop=None, figures=None, **kw) -> list:
        """This rank's share of the groups: the agent's runs on the tasks of its share of ``seeds``."""
        c, (first, count) = self.config, dp_share(len(seeds), dims)
        t = c.temperature if kw.get("temperature") is None else kw["temperature"]
        g, split = kw.get("group_size") or c.group_size, kw.get("split", "train")
        return self.tasks.play(llm, seeds[first : first + count], step, c.seed, g, t, split, should_stop)
