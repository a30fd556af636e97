"""The step DPO and reward-model training share, on the run harness: the step's pairs (a pure function of the seed
and the step, as SFT's batches are, so resuming needs no sampler state) → the trainer batch → one optimizer step
of the pair loss. Also the learners it runs on and a chunked forward over many pairs.

Batches hold ``2·batch_size`` interleaved rows (see :mod:`.preference_data`); every data-parallel shard and
micro-batch must hold whole pairs, so ``batch_size`` must be divisible by dp × microbatches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from spinwheel.engine import LLM
from spinwheel.models.transformer import Transformer
from spinwheel.parallel.comm import metrics_since
from spinwheel.parallel.mesh import ParallelDims
from spinwheel.parallel.trainer import Batch, LossFn
from spinwheel.preference.pref_config import PreferenceConfig
from spinwheel.preference.preference_data import PreferencePair, SampledGroups, sample_groups
from spinwheel.rl.llm.rollout import Prompt
from spinwheel.tasks.arithmetic import reward as task_reward
from spinwheel.train.learners import Learner, LocalLearner, OptimConfig, ParallelLearner, distributed_world
from spinwheel.train.optim import lr_at
from spinwheel.train.run import Run
from spinwheel.train.sft.sft_data import batch_indices

BuildBatch = Callable[[Sequence[PreferencePair]], Batch]  # pairs -> trainer batch of 2·len(pairs) rows
Evaluate = Callable[[int], dict[str, Any] | None]  # step -> held-out figures (logged by the callee)


def make_learner(
    model: Transformer,
    config: PreferenceConfig,
    dims: ParallelDims | None,
    *,
    frozen: bool = False,
    engine_copy: str = "main",
) -> Learner:
    """The single-process reference without ``dims``, else the parallel trainer (one learner per rank);
    ``frozen``: no optimizer (a reference model, forward only)."""
    optim = None if frozen else OptimConfig(config.lr, config.weight_decay, config.grad_clip)
    if dims is None:
        return LocalLearner(model, optim)
    return ParallelLearner(model, optim, config.parallel, dims, engine_copy="none" if frozen else engine_copy)


def run_pair_command(
    config: PreferenceConfig, desc: str, train: Callable[[Any, Run, ParallelDims | None], dict[str, Any]]
) -> dict[str, Any]:
    """Join the torchrun world (when launched by it), check the layout, open the run on the harness and call
    ``train(config, run, dims)`` unless the run is already finished. What DPO and reward models start with."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    with distributed_world(config.device, config.parallel) as distributed:
        dims = check_layout(config, distributed)
        with Run(config, distributed, desc) as run:
            if run.finished():
                return run.finished_result()
            run.announce_resume()
            return train(config, run, dims)


def check_layout(config: PreferenceConfig, distributed: bool) -> ParallelDims | None:
    """The layout's dims under torchrun (None in one process), with the pair-batch divisibility checked."""
    dims = config.parallel.make_dims()  # a readable error for e.g. --tp 2 without torchrun
    config.parallel.check_batch(config.batch_size, dims.dp, what="--batch-size (pairs)")
    return dims if distributed else None


def sample_policy(
    llm: LLM, prompts: list[Prompt], config: PreferenceConfig, dims: ParallelDims | None
) -> SampledGroups:
    """The policy's ``config.group_size`` samples of each task prompt on ``llm`` (the RL rollout sampler at step 0,
    with the run's seed and sampling options), scored by the task reward."""
    c = config
    return sample_groups(
        llm, prompts, c.group_size, c.max_new_tokens, c.temperature, c.top_p, c.seed, task_reward, dims
    )


def forward_rows(
    learner: Learner,
    pairs: Sequence[PreferencePair],
    build: BuildBatch,
    reduce: Callable[[dict[str, torch.Tensor], Batch], torch.Tensor],
    chunk: int,
) -> torch.Tensor:
    """``reduce(outputs, batch)`` -> (2p,) per-row figures of a forward over ``pairs`` in chunks of ``chunk`` pairs,
    concatenated (2P,). The last chunk is topped up with copies of its last pair so every forward has the same
    number of rows (what the layout divides); their rows are dropped. Collective under torchrun."""
    out = []
    for start in range(0, len(pairs), chunk):
        part = list(pairs[start : start + chunk])
        batch = build(part + [part[-1]] * (chunk - len(part)))
        out.append(reduce(learner.forward(batch), batch)[: 2 * len(part)].cpu())
    return torch.cat(out) if out else torch.zeros(0)


class PairJob:
    """One optimizer step of a pair loss on the step's pairs (a pure function of the seed and the step), for the
    harness (:class:`~spinwheel.train.run.Run`); DPO and reward models supply the learner, the pairs, the batch
    builder, the loss, the evaluation and the checkpoint's extra state."""

    def __init__(
        self,
        config: PreferenceConfig,
        run: Run,
        learner: Learner,
        pairs: Sequence[PreferencePair],
        build: BuildBatch,
        loss_fn: LossFn,
        evaluate: Evaluate,
        save: Callable[[Path, dict[str, Any]], None],
    ) -> None:
        self.config, self.run, self.learner, self.pairs = config, run, learner, pairs
        self.build, self.loss_fn, self.evaluate, self.save = build, loss_fn, evaluate, save
        self.t0, self.num_steps = time.perf_counter(), 0

    def step(self, step: int) -> dict[str, Any]:
        c, learner = self.config, self.learner
        batch = self.build([self.pairs[i] for i in batch_indices(step, c.batch_size, len(self.pairs), c.seed)])
        lr = lr_at(step, c.lr, c.warmup_steps, c.steps, c.min_lr_ratio)
        comm_before = learner.comm_metrics()
        out = learner.train_step(batch, self.loss_fn, lr)
        self.num_steps += 1
        return {
            **out.stats,
            "loss": out.loss,
            "lr": lr,
            "grad_norm": out.grad_norm,
            "pairs_per_s": self.num_steps * c.batch_size / (time.perf_counter() - self.t0),
            **metrics_since(learner.comm_metrics(), comm_before),  # the step's collectives (torchrun)
        }


def pair_postfix(record: dict[str, Any]) -> dict[str, str]:
    return {"loss": f"{record['loss']:.4f}", "acc": f"{record.get('accuracy', 0.0):.2f}"}
