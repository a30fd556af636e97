"""The environments of an RL run: ``--env`` (:mod:`spinwheel.envs`), or — without it — one-step episodes over the
run's prompts (the built-in task's splits or ``--data``, as :func:`~spinwheel.rl.llm.build.load_prompts` reads and
filters them) scored by the run's reward (``--reward`` task or ``module:function``, TRL-style too, or
``--reward-model``), so every RL command plays episodes on one rollout path and a single-turn run samples and scores
exactly what it did before environments existed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from spinwheel.envs import Env, EnvFactory, load_env
from spinwheel.envs.chat import resolve_chat
from spinwheel.envs.dataset import record_rewards
from spinwheel.parallel.mesh import ParallelDims
from spinwheel.rl.llm.build import load_prompts
from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm.episode_tokens import Episode
from spinwheel.rl.llm.episodes import EpisodeConfig, EpisodeGroup, run_episodes
from spinwheel.rl.llm.prompts_env import PromptsEnv, Scorer
from spinwheel.rl.llm.rewards import load_reward_fn, score
from spinwheel.rl.llm.rollout import dp_share


def run_scorer(config: RLConfig) -> tuple[Scorer, bool]:
    """The run's reward as a scorer of (prompts, completions), and whether it is the built-in exact match."""
    if config.reward_model is not None:
        from spinwheel.preference.reward_model import reward_model_fn

        rm = reward_model_fn(config.reward_model, device=config.device)

        def by_model(prompts, texts, timeout_s=None, should_stop=None) -> torch.Tensor:
            fn = lambda completions, contexts: rm(contexts, completions)  # noqa: E731
            return score(fn, texts, [p.text for p in prompts], "reward-model", timeout_s=timeout_s)

        return by_model, False
    fn = load_reward_fn(config.reward)

    def by_function(prompts, texts, timeout_s=None, should_stop=None) -> torch.Tensor:
        if prompts and all(p.record is not None for p in prompts):  # --data lines: TRL-style calls get the columns
            records = [p.record for p in prompts]
            return record_rewards(fn, records, texts, timeout_s=timeout_s, should_stop=should_stop)
        answers = [p.answer for p in prompts]
        return score(fn, texts, answers, "reward", timeout_s=timeout_s, should_stop=should_stop)

    return by_function, config.reward == "task"


def run_environments(
    config: RLConfig, tokenizer, context: int, log: Callable[[str], None]
) -> tuple[Callable[[str], Env], bool]:
    """(a factory of the run's environments by split, whether the reward is the built-in exact match)."""
    chat = resolve_chat(config.chat, tokenizer, config.system_prompt)  # a bad --chat fails before anything runs
    if config.env is not None:
        factory: EnvFactory = load_env(config.env, config.env_arg, config.answer_extraction)
        return factory, False
    scorer, builtin = run_scorer(config)
    train, held_out = load_prompts(config, tokenizer, context, log=log, chat=chat)
    splits = {"train": train, "test": held_out}
    return (lambda split: PromptsEnv(splits[split], scorer, split)), builtin


def play_share(
    llm,
    make_env: Callable[[str], Env],
    seeds: Sequence[int],
    step: int,
    config: RLConfig,
    dims: ParallelDims | None,
    should_stop: Callable[[], bool] | None = None,
    figures: dict[str, float] | None = None,
    *,
    split: str = "train",
    group_size: int | None = None,
    temperature: float | None = None,
    token_versions: Callable[[str, int, int], list[int]] | None = None,
) -> list[Episode]:
    """This data-parallel rank's share of the step's groups (environment ``seeds[k]`` is group k, G episodes each),
    played on ``llm``'s engine; gather them with :func:`~spinwheel.rl.llm.rollout.gather_dp`."""
    first, count = dp_share(len(seeds), dims)
    g = group_size or config.group_size
    groups = [EpisodeGroup([make_env(split) for _ in range(g)], seeds[k], k) for k in range(first, first + count)]
    episode_config = EpisodeConfig(
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature if temperature is None else temperature,
        top_p=config.top_p,
        max_turns=config.max_turns,
        max_total_tokens=config.max_episode_tokens,
        env_timeout_s=config.env_timeout_s,
        batch_timeout_s=config.reward_timeout_s,
        chat=resolve_chat(config.chat, llm.engine.tokenizer, config.system_prompt),
    )
    return run_episodes(llm.engine, groups, episode_config, config.seed, step, should_stop, figures, token_versions)
