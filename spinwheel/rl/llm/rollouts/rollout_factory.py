"""The one factory of the run's :class:`~spinwheel.rl.llm.rollouts.protocol.Rollouts`, by the run's options.

* ``--engine-tp N`` (under torchrun): one tensor-parallel engine over every N ranks, resharded into after each
  update (:class:`~spinwheel.rl.llm.rollouts.engine_tp.EngineTP` as the synchronous loop's layout);
* ``--rollout-ranks R``: ranks of their own generate; this trainer's engine only evaluates
  (:class:`~spinwheel.rl.llm.rollouts.rollout_ranks.RemoteRollouts`);
* ``--max-staleness K``: the producer ahead of the trainer, on an engine with a copy of the weights (the trainer
  updates its own in place while the engine samples); evaluation gets an engine of its own on the trainer's
  weights (:func:`~spinwheel.rl.llm.rollouts.async_rollouts.make_producer`);
* otherwise the synchronous loop on an engine that generates with the trainer's weights
  (:class:`~spinwheel.rl.llm.rollouts.protocol.SyncRollouts`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spinwheel.engine import LLM
from spinwheel.rl.llm.agents.agent_run import AgentSource
from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm.rollouts import async_rollouts
from spinwheel.rl.llm.rollouts.engine_tp import EngineTP
from spinwheel.rl.llm.rollouts.episode_source import EpisodeSource
from spinwheel.rl.llm.rollouts.protocol import Rollouts, SyncRollouts, module_mb
from spinwheel.rl.llm.rollouts.rollout_ranks import Placement, RemoteRollouts
from spinwheel.rl.llm.run_envs import run_environments
from spinwheel.train.learners import Learner


def make_rollouts(
    config: RLConfig,
    learner: Learner,
    tokenizer: Any,
    options: dict[str, Any],
    source: EpisodeSource,
    placement: Placement | None,
    first: int,
    end: int,
) -> Rollouts:
    """The run's rollouts (module docstring): ``options`` the engine's, ``source`` the run's episodes, ``first`` and
    ``end`` the run's steps."""
    is_main, shares = learner.is_main, getattr(learner, "shares_weights", True)
    if config.engine.tensor_parallel_size > 1:  # the shards are a copy (a LoRA run's rank 0 may share)
        tp = EngineTP(learner, tokenizer, options, config.parallel.timeout_s)
        rollouts: Any = SyncRollouts(source, tp.llm, tp.sync, layout=tp, is_main=is_main)
        rollouts.engine_copy_mb = module_mb(tp.shard)
        return rollouts
    model = learner.engine_model
    assert model is not None
    if config.max_staleness is not None and placement is None:
        return async_rollouts.make_producer(config, source, model, tokenizer, options, first, end)
    llm = LLM(model, tokenizer, **options)
    sync = lambda: sync_engine(learner, llm)  # noqa: E731
    if placement is not None:  # the rollout ranks play; this rank's engine only evaluates
        counts = config.max_staleness is not None
        context = options["max_model_len"]
        rollouts = RemoteRollouts(placement, model, first, end, sync, context, source, llm, counts)
    else:
        rollouts = SyncRollouts(source, llm, sync, is_main=is_main)
    rollouts.engine_copy_mb = 0.0 if shares and config.max_staleness is None else module_mb(llm.engine.model)
    return rollouts


def make_source(
    config: RLConfig, tokenizer: Any, context: int, say: Callable[[str], None], dims, should_stop
) -> tuple[EpisodeSource, bool]:
    """(the run's episode source: a black-box agent's runs with ``--agent``, else the run's environments; whether its
    reward is the built-in exact match)."""
    if config.agent is not None:
        return AgentSource(config, dims, should_stop), False
    make_env, builtin = run_environments(config, tokenizer, context, say)
    return EpisodeSource(config, make_env, dims, should_stop), builtin


def sync_engine(learner: Learner, llm: LLM) -> None:
    """The engine over the trainer's weights takes them after an update (a collective where the layout shards them)."""
    learner.sync_engine_model()
    llm.update_weights(learner.engine_model)  # ZeRO-1/2 write through flat buckets: repack explicitly
