"""One-step episodes over prepared prompts (:class:`PromptsEnv`): the RL run's episodes without ``--env``
(:mod:`~spinwheel.rl.llm.run_envs`), and the samples preference data is built from — DPO's self-generated pairs and
the reward model's policy mistakes (:func:`play_prompts`) — so every sampler of a policy plays episodes through
:func:`~spinwheel.rl.llm.episodes.run_episodes`, with the seeds of :func:`~spinwheel.rl.llm.rollout.sample_seed`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from spinwheel.envs import OneStepEnv
from spinwheel.parallel.mesh import ParallelDims
from spinwheel.rl.llm.episode_tokens import Episode, EpisodeConfig
from spinwheel.rl.llm.episodes import EpisodeGroup, run_episodes
from spinwheel.rl.llm.rollout import Prompt, dp_share, gather_dp

Scorer = Callable[..., torch.Tensor]  # (prompts, completions, timeout_s=, should_stop=) -> (B,) rewards


class PromptsEnv(OneStepEnv):
    """One step over prepared prompts: ``reset(seed)`` is prompt ``seed % len(prompts)`` (its chat messages, or its
    raw text: under ``--chat`` the episode renders it as the user's turn, as ``load_prompts`` counted its tokens),
    ``step`` scores the answer with the run's scorer — for all episodes of a step in one call."""

    name: ClassVar[str] = "prompts"

    def __init__(self, prompts: Sequence[Prompt], scorer: Scorer, split: str = "train") -> None:
        super().__init__(split)
        self.prompts, self.scorer = prompts, scorer
        self.num_tasks = len(prompts)
        self.prompt: Prompt | None = None

    def reset(self, seed: int) -> Any:
        self.prompt = self.prompts[seed % len(self.prompts)]
        messages = getattr(self.prompt.record, "messages", None)
        return copy.deepcopy(messages) if messages is not None else self.prompt.text

    @classmethod
    def score_batch(cls, envs, texts, *, timeout_s=None, should_stop=None) -> list[float]:
        prompts = [env.prompt for env in envs]
        return envs[0].scorer(prompts, texts, timeout_s=timeout_s, should_stop=should_stop).tolist()

    def info(self, reward: float) -> dict[str, float]:
        return {}


def play_prompts(
    llm: Any,
    prompts: Sequence[Prompt],
    config: EpisodeConfig,
    seed: int,
    step: int,
    group_size: int,
    dims: ParallelDims | None = None,
) -> list[Episode]:
    """``group_size`` one-step episodes of every prompt (prompt k is environment k of step ``step``: the RL
    rollout's seeds), unscored; under torchrun each data-parallel rank plays its contiguous share and every rank
    gets every share. An episode that fails (the engine's error) fails the call."""
    unscored = lambda prompts, texts, **kw: torch.zeros(len(texts))  # noqa: E731
    first, count = dp_share(len(prompts), dims)
    groups = [
        EpisodeGroup([PromptsEnv(prompts, unscored) for _ in range(group_size)], k, k)
        for k in range(first, first + count)
    ]
    mine = run_episodes(llm.engine, groups, config, seed, step)
    episodes = [e for part in gather_dp(mine, dims) for e in part]
    for i, e in enumerate(episodes):
        if e.failed:
            raise ValueError(f"rollout of prompt {prompts[i // group_size].text!r} failed: {e.error}")
    return episodes
