"""The run's episode source: a step's episodes, played on an engine the caller gives, over the run's environments
(``--env``), its prompts and reward, or a black-box agent's runs (``--agent``:
:mod:`~spinwheel.rl.llm.agents.agent_run`).
Every :class:`~spinwheel.rl.llm.rollouts.protocol.Rollouts` implementation plays through it; a layout says which share
of a
step a rank plays and how the shares are exchanged (:class:`DataRanks`, or the ``--engine-tp`` engines of
:class:`~spinwheel.rl.llm.rollouts.engine_tp.EngineTP`, which have the same three methods). :func:`step_seeds` is the
environments' seeds of a step, the same on every rank (rollout ranks too) and in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from spinwheel.envs import Env, EnvError
from spinwheel.parallel.mesh import ParallelDims
from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm.episode_tokens import Episode
from spinwheel.rl.llm.episodes import EpisodesInterrupted
from spinwheel.rl.llm.rewards import RewardError, RewardInterrupted
from spinwheel.rl.llm.rollout import gather_dp, sample_seed
from spinwheel.rl.llm.run_envs import PromptsEnv, play_share
from spinwheel.train.interrupt import any_rank
from spinwheel.train.run import StepFailed
from spinwheel.train.sft.sft_data import batch_indices

T = TypeVar("T")


def step_seeds(config: RLConfig, num_train: int | None, step: int) -> list[int]:
    """The seeds of step ``step``'s environments: with a fixed set of ``num_train`` tasks, epochs of a seeded order
    (as the prompts were drawn); procedural environments (``None``), a fresh seed per environment."""
    if num_train:
        return batch_indices(step, config.prompts_per_step, num_train, config.seed)
    return [sample_seed(config.seed, step, k) for k in range(config.prompts_per_step)]


class DataRanks:
    """The layout without ``--engine-tp``: each data-parallel rank (``dims``; None: one process) plays its share of
    the step's groups on its own engine, and every rank gets every share."""

    figures: dict[str, float] = {}

    def __init__(self, dims: ParallelDims | None) -> None:
        self.engines = dims

    def play(self, fn: Callable[[], list[T]]) -> list[T]:
        return fn()

    def share(self, mine: list[T]) -> list[list[T]]:
        return gather_dp(mine, self.engines)

    def serve_evaluation(self) -> None:
        pass


class EpisodeSource:
    """The run's episodes (module docstring) over environments: ``make_env`` their factory by split, ``dims`` the
    trainer's data-parallel grid (None: one process), ``should_stop`` a Ctrl-C seen by the run. ``num_train`` /
    ``num_eval``: the number of training / held-out tasks (None: procedural)."""

    def __init__(
        self,
        config: RLConfig,
        make_env: Callable[[str], Env] | None,
        dims: ParallelDims | None,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        self.config, self.make_env, self.dims, self.should_stop = config, make_env, dims, should_stop
        self.num_train, self.num_eval = self.num_tasks("train"), self.num_tasks("test")

    def num_tasks(self, split: str) -> int | None:
        assert self.make_env is not None
        return getattr(self.make_env(split), "num_tasks", None)

    def max_model_len(self, context: int) -> int:
        """The engine's context: one-step episodes over prompts need the longest prompt and its completion (as
        before environments: the same KV pool); other environments the episode's limit."""
        c, env = self.config, self.make_env("train")  # type: ignore[misc]
        if isinstance(env, PromptsEnv):
            prompts = [*env.prompts, *self.make_env("test").prompts]  # type: ignore[attr-defined, misc]
            return min(max(len(p.ids) for p in prompts) + c.max_new_tokens + 1, context)
        return min(c.max_episode_tokens or context, context)

    def figures(self, episodes: list[Episode]) -> dict[str, float]:
        """The source's own figures of a step's episodes (beside :func:`~.episode_tokens.episode_metrics`)."""
        return {}

    def groups(self, llm: Any, seeds: list[int], step: int, dims: Any, should_stop=None, figures=None, **kw) -> list:
        """This rank's share (of ``dims``) of the groups of environments ``seeds``, played on ``llm``
        (:func:`~spinwheel.rl.llm.run_envs.play_share`; ``kw``: its split, group size, temperature, token
        versions)."""
        return play_share(llm, self.make_env, seeds, step, self.config, dims, should_stop, figures, **kw)  # type: ignore[arg-type]

    def play(self, step: int, llm: Any, token_versions: Any = None, layout: Any = None) -> tuple[list[Episode], float]:
        """The step's episodes, every rank's, and the seconds this rank spent in reward calls, played on ``llm``
        (``token_versions``: the producer's record of the version that sampled each token). A reward function that
        fails (or a Ctrl-C while it runs) fails the step on every rank together, before any weight changed (the
        harness saves the steps before it); so does a step whose episodes mostly fail."""
        c, figures, error = self.config, {}, None
        layout = layout or DataRanks(self.dims)
        seeds = step_seeds(c, self.num_train, step)  # the same on every rank (rollout ranks too)
        try:
            share = lambda dims: self.groups(  # noqa: E731
                llm, seeds, step, dims, self.should_stop, figures, token_versions=token_versions
            )
            mine = layout.play(lambda: share(layout.engines))
        except (RewardError, RewardInterrupted, EpisodesInterrupted) as e:
            error = e
        distributed = self.dims is not None
        if any_rank(isinstance(error, KeyboardInterrupt), distributed):  # a Ctrl-C seen by any rank stops every rank
            raise StepFailed(error if isinstance(error, KeyboardInterrupt) else EpisodesInterrupted("stopped"))
        if any_rank(error is not None, distributed):
            raise StepFailed(error or RewardError("the reward failed on another rank (that rank's log says why)"))
        episodes = [e for part in layout.share(mine) for e in part]
        failed = [e for e in episodes if e.failed]
        if 2 * len(failed) > len(episodes):
            where = c.env or c.agent or "the run's prompts"
            raise StepFailed(
                EnvError(f"{len(failed)} of {len(episodes)} episodes of {where} failed: {failed[0].error}")
            )
        return episodes, figures.get("batch_step_s", 0.0)

    def held_out(self, llm: Any, num: int, layout: Any = None) -> list[Episode]:
        """Greedy episodes of test-split tasks ``0 .. num − 1``, one each, on this rank's ``llm`` alone (under
        ``--engine-tp`` its engine's other ranks serve it)."""
        layout = layout or DataRanks(None)
        play = lambda: self.groups(llm, list(range(num)), -1, None, split="test", group_size=1, temperature=0.0)  # noqa: E731
        return layout.play(play)
