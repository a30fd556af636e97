"""``--engine-tp N`` under torchrun: the RL run's engine is tensor-parallel across the training ranks themselves.

Without it every rank gathers the full model into an engine copy of its own after each update. With it the N
ranks (the whole world, for now) hold one engine between them: rank r holds engine shard r (1/N of every weight
matrix and of every KV block, :mod:`~spinwheel.engine.tp_worker`'s split), filled after each update by resharding
the trainer's layout (:class:`~spinwheel.engine.tp_reshard.Resharder`: own TP slices copied, or ZeRO-3/FSDP units
gathered one at a time and sliced), so no rank ever holds the whole model.

The step loop: rank 0 is the driver — it runs the scheduler, the sampler, the environments and the rewards for
*all* of the step's groups (seeded per group as in one process, so the rollouts equal one process's), and ships
each engine step to the others through a broadcast on a gloo control group (the pattern of
:class:`~spinwheel.engine.tp_executor.TPExecutor`, with torchrun's ranks instead of spawned workers); the other
ranks serve those steps (forward on their shard, the all-reduces, the logits' all-gather) until rank 0 says the
episodes are done, then every rank receives the episodes by broadcast and trains on them as before. Evaluation
runs the same way. Every wait has the run's collective timeout (``--timeout-s``).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from spinwheel.engine import LLM
from spinwheel.engine.config import EngineConfig
from spinwheel.engine.tp_executor import TensorParallelError
from spinwheel.engine.tp_reshard import Resharder, empty_shard, model_bytes
from spinwheel.engine.tp_worker import Step, TPModelRunner, check_checkpoint_tp_degree, pool_sizes
from spinwheel.parallel.comm import Comm
from spinwheel.parallel.mesh import Axis, ParallelDims

logger = logging.getLogger(__name__)
T = TypeVar("T")

SUPPORTED = "DDP, --zero 1/2/3, --fsdp or --hsdp over dp N, or --tp N (no --pp)"


def check_engine_tp(config, dims: ParallelDims | None) -> int:
    """The RL engine's tensor-parallel degree N (1: off); refuses in one line, before any weight is loaded, what
    ``--engine-tp`` does not do: one process, N other than the world size, layouts it cannot reshard from, a model
    whose heads, KV heads, MLP width or vocabulary N does not divide."""
    n = config.engine.tensor_parallel_size
    if n == 1:
        return 1
    if config.rollout_ranks:
        raise ValueError(f"--engine-tp {n} and --rollout-ranks are alternatives: the engine on every rank, or apart")
    if dims is None:
        raise ValueError(
            f"--engine-tp {n} splits the RL engine over torchrun's ranks: launch with `spinwheel launch "
            f"--nproc-per-node {n} ...` (in one process, drop it)"
        )
    if n != dims.world_size:
        raise ValueError(f"--engine-tp {n} must equal the number of torchrun ranks ({dims.world_size}) for now")
    if dims.pp > 1 or (dims.tp, dims.dp) not in ((n, 1), (1, n)):
        raise ValueError(
            f"--engine-tp {n} reshards from {SUPPORTED.replace('N', str(n))}; got dp {dims.dp}, tp {dims.tp}, "
            f"pp {dims.pp}"
        )
    if config.lora_rank:
        raise ValueError("--engine-tp with --lora-rank: the tensor-parallel engine serves no adapters yet")
    check_checkpoint_tp_degree(config.model, n)  # heads, KV heads, MLP width, vocabulary
    return n


class EngineTP:
    """One rank's part of the run's tensor-parallel engine: its shard, the resharder that fills it from the
    trainer, and on rank 0 the :class:`~spinwheel.engine.LLM` whose runner drives the others (it is this
    object's ``make_runner`` that the engine calls, through the shard's ``tp_host``). ``learner``: the run's
    :class:`~spinwheel.train.learners.ParallelLearner`, built without an engine copy."""

    def __init__(self, learner, tokenizer, engine_options: dict[str, Any], timeout_s: float) -> None:
        config, pm = EngineConfig(**engine_options), learner.trainer.pm
        n, self.rank = config.tensor_parallel_size, dist.get_rank()
        first = next(pm.module.parameters())
        device, dtype = first.device, first.dtype
        timeout = datetime.timedelta(seconds=timeout_s)
        ranks = list(range(n))
        self.control = dist.new_group(ranks, timeout=timeout, backend="gloo")  # the driver's step broadcasts
        group = dist.new_group(ranks, timeout=timeout, backend="nccl" if device.type == "cuda" else "gloo")
        self.axis, self.comm = Axis("engine_tp", tuple(ranks), self.rank, group), Comm(timeout_s)
        self.full_config = pm.stage.config
        self.shard, shard_dims = empty_shard(self.full_config, self.axis, self.comm, device, dtype)
        self.resharder = Resharder(pm, self.shard, shard_dims, self.axis)
        self.figures: dict[str, float] = {}
        self.llm: LLM | None = None
        self.runner: TPModelRunner | None = None
        self.sync()
        self.shard_mb = model_bytes(self.shard) / 2**20
        self.shard.tp_host = self  # the engine builds its runner through make_runner (tp_executor's hook)
        if self.rank == 0:
            self.llm = LLM(self.shard, tokenizer, **engine_options)
        else:
            self.runner, _ = self.make_runner(self.shard, config, engine_options["max_model_len"], driver=False)

    def make_runner(self, model, config: EngineConfig, max_model_len: int, driver: bool = True):
        """(this rank's runner over its shard, the executor: this object on the driver, else None); the pool has as
        many blocks as one device's (each 1/N of the size), the same on every rank."""
        sized = pool_sizes(config, self.full_config, model.dtype, max_model_len)
        executor = self if driver else None
        return TPModelRunner(model, sized, max_model_len, self.axis, self.comm, executor=executor), executor

    # -- the driver's side of a step (TPModelRunner calls these) ------------------------------------------------
    def send(self, step: Step) -> None:
        """Ship one engine step to the other ranks (they run it on their shards as this rank runs it on its own)."""
        try:
            dist.broadcast_object_list([step], src=0, group=self.control)
        except RuntimeError as e:
            raise self.error(e) from e

    def error(self, exc: BaseException) -> TensorParallelError:
        return TensorParallelError(f"a collective of the RL engine's tensor-parallel group failed ({exc})")

    def close(self) -> None:
        """Nothing to stop: the other ranks are the run's own (they leave their serving loop at each stop)."""

    # -- the step loop ------------------------------------------------------------------------------------------
    def serve(self) -> None:
        """On the other ranks: run the driver's engine steps on this shard until it says stop."""
        assert self.runner is not None
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=self.control)
            step = box[0]
            if step.stop:
                return
            self.runner.execute(step)

    @contextlib.contextmanager
    def driving(self) -> Iterator[None]:
        """On rank 0: the block plays on the engine; at its end (or its error) the other ranks stop serving."""
        try:
            yield
        finally:
            dist.broadcast_object_list([Step([], [], [], None, stop=True)], src=0, group=self.control)

    def play(self, fn: Callable[[], list[T]]) -> list[T]:
        """``fn()`` played on the engine by rank 0 while the others serve its steps; [] on the other ranks."""
        if self.rank != 0:
            self.serve()
            return []
        with self.driving():
            return fn()

    def share(self, mine: list[T]) -> list[list[T]]:
        """Rank 0's episodes on every rank (as :func:`~spinwheel.rl.llm.rollout.gather_dp` returns them)."""
        box: list[Any] = [mine if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return [box[0]]

    # -- weight sync --------------------------------------------------------------------------------------------
    def sync(self) -> None:
        """Reshard the trainer's new weights into every rank's engine shard (collective) and record the time and
        each rank's peak temporary bytes (``figures``); the driver's prefix cache is dropped."""
        start = time.perf_counter()
        peak = self.resharder.sync()
        if self.rank == 0 and self.llm is not None:
            self.llm.engine.update_weights(self.llm.engine.model)  # in place already: drops the prefix cache
        seconds = time.perf_counter() - start
        peaks = torch.zeros(self.axis.size, dtype=torch.float64)
        peaks[self.rank] = peak
        dist.all_reduce(peaks, group=self.control)
        self.figures = {"engine_sync_s": seconds, "engine_sync_peak_mb": float(peaks.max()) / 2**20}
        self.figures.update({f"engine_sync_peak_mb/rank{r}": float(b) / 2**20 for r, b in enumerate(peaks)})
