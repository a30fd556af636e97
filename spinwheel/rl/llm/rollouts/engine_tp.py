"""``--engine-tp N`` under torchrun: the RL run's engine is tensor-parallel across the training ranks themselves.

Without it every rank gathers the full model into an engine copy of its own after each update. With it a world
of M·N ranks holds M engines of N shards each: engine g is ranks [g·N, (g+1)·N) (under a trainer ``--tp N``: its
tensor-parallel groups), and its rank g·N + r holds engine shard r (1/N of every weight matrix and of every KV
block, :mod:`~spinwheel.engine.parallel.tp_worker`'s split), filled after each update by resharding the trainer's layout
(:class:`~spinwheel.engine.parallel.tp_reshard.Resharder`: own TP slices copied, or ZeRO-3/FSDP units gathered over the
trainer's dp group bucket by bucket and sliced), so no rank ever holds the whole model.

The step loop: each engine's first rank is its driver — it runs the scheduler, the sampler, the environments and
the rewards for its engine's share of the step's groups (the data-parallel share of
:func:`~spinwheel.rl.llm.rollout.dp_share` over the M engines, each group seeded by its global index as in one
process, so the rollouts equal one process's), and ships each engine step to its engine's other ranks through a
broadcast on the engine's gloo control group (:class:`EngineTPExecutor`, the engine's executor: a
:class:`~spinwheel.engine.executor.ShardedExecutor` as :class:`~spinwheel.engine.parallel.tp_executor.TPExecutor` is,
with
torchrun's ranks instead of spawned workers); those ranks serve the steps (forward on their shard, the
all-reduces, the logits' all-gather) until the driver says the episodes are done. The drivers then gather their
episodes (a gloo group of the M drivers) and broadcast them within their engines: every rank trains on all of
them as before. Evaluation runs on engine 0 alone (the other engines' ranks go on). Every wait has the run's
collective timeout (``--timeout-s``).

With ``--lora-rank`` (under DDP, ZeRO-1/2 or ``--tp N``; the fully sharded layouts are refused for LoRA by
:func:`~spinwheel.train.lora_run.check_one_process`) the shards get the frozen base once, at the start, and the
policy's adapters are one adapter slot of every engine rank (:mod:`~spinwheel.engine.multi_lora`) that every request,
rollouts and evaluation alike, runs through; each update moves the adapters alone (:class:`PolicyAdapter`,
``sync_bytes`` logged). Rank 0 keeps the trainer's model (DDP, ZeRO-1/2) or a copy (``--tp N``) to write the PEFT
adapter at saves, as a LoRA run without ``--engine-tp`` does.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from spinwheel.engine import LLM
from spinwheel.engine.config import EngineConfig
from spinwheel.engine.executor import ShardedExecutor
from spinwheel.engine.multi_lora import AdapterRegistry
from spinwheel.engine.parallel.tp_executor import TensorParallelError
from spinwheel.engine.parallel.tp_reshard import Resharder, empty_shard, model_bytes
from spinwheel.engine.parallel.tp_worker import Step, TPModelRunner, check_checkpoint_tp_degree, pool_sizes
from spinwheel.parallel.comm import Comm
from spinwheel.parallel.mesh import Axis, ParallelDims
from spinwheel.rl.llm.rollouts.weight_sync import state_bytes

logger = logging.getLogger(__name__)
T = TypeVar("T")

SUPPORTED = "DDP, --zero 1/2/3, --fsdp or --hsdp over any dp, or --tp N (× any dp; no --pp)"


def check_engine_tp(config, dims: ParallelDims | None) -> int:
    """The RL engine's tensor-parallel degree N (1: off); refuses in one line, before any weight is loaded, what
    ``--engine-tp`` does not do: one process, N not dividing the world size, layouts it cannot reshard from
    (pipeline stages, a trainer TP degree other than N or TP groups other than the engines'), a model whose heads,
    KV heads, MLP width or vocabulary N does not divide."""
    n = config.engine.tensor_parallel_size
    if n == 1:
        return 1
    if config.rollout_ranks:
        raise ValueError(f"--engine-tp {n} and --rollout-ranks are alternatives: the engine on every rank, or apart")
    if (pp := config.engine.pipeline_parallel_size) > 1:
        raise ValueError(
            f"--engine-tp {n}: the RL engines are tensor-parallel only; drop --engine-pipeline-parallel-size {pp}"
        )
    if dims is None:
        raise ValueError(
            f"--engine-tp {n} splits the RL engine over torchrun's ranks: launch with `spinwheel launch "
            f"--nproc-per-node {n} ...` (in one process, drop it)"
        )
    if dims.world_size % n:
        raise ValueError(
            f"--engine-tp {n} must divide the number of torchrun ranks ({dims.world_size}): each engine is {n} "
            f"ranks; launch a multiple of {n} ranks or pick a divisor"
        )
    if dims.pp > 1 or dims.tp not in (1, n):
        raise ValueError(
            f"--engine-tp {n} reshards from {SUPPORTED.replace('N', str(n))}; got dp {dims.dp}, tp {dims.tp}, "
            f"pp {dims.pp}"
        )
    if dims.tp > 1 and dims._groups_along(("tp",)) != engine_groups(n, dims.world_size):
        raise ValueError(f"--engine-tp {n}: the trainer's TP groups are not the engines' consecutive ranks")
    check_checkpoint_tp_degree(config.model, n)  # heads, KV heads, MLP width, vocabulary
    return n


def engine_groups(n: int, world_size: int) -> list[list[int]]:
    """The engines' ranks: engine g is ranks [g·n, (g+1)·n)."""
    return [list(range(g * n, (g + 1) * n)) for g in range(world_size // n)]


def engine_share(groups: list[list[int]], index: int, drivers_group) -> ParallelDims:
    """The M engines as the data-parallel axis :func:`~spinwheel.rl.llm.rollout.dp_share` splits the step's groups
    over (engine ``index``'s share: the one dp rank ``index`` of M would play)."""
    m, drivers = len(groups), tuple(g[0] for g in groups)
    return ParallelDims(
        dp_shard=m, world_size=m, rank=index, axes={"dp": Axis("engines", drivers, index, drivers_group)}
    )


class EngineTP:
    """One rank's part of its engine (of the run's M tensor-parallel engines): its shard, the resharder that fills
    it from the trainer, and on the engine's driver the :class:`~spinwheel.engine.LLM` whose executor
    (:class:`EngineTPExecutor`, passed in) drives the others.
    ``learner``: the run's :class:`~spinwheel.train.learners.ParallelLearner`, built without an engine copy;
    ``engines``: the M engines as a dp axis (``play_share``'s ``dims``: this engine's share of a step)."""

    def __init__(self, learner, tokenizer, engine_options: dict[str, Any], timeout_s: float) -> None:
        config, pm = EngineConfig(**engine_options), learner.trainer.pm
        n, self.rank = config.tensor_parallel_size, dist.get_rank()
        first = next(pm.module.parameters())
        device, dtype = first.device, first.dtype
        self.make_groups(n, datetime.timedelta(seconds=timeout_s), "nccl" if device.type == "cuda" else "gloo")
        self.comm = Comm(timeout_s)
        self.full_config = pm.stage.config
        self.shard, shard_dims = empty_shard(self.full_config, self.axis, self.comm, device, dtype)
        self.resharder = Resharder(pm, self.shard, shard_dims, self.axis)  # LoRA: the frozen base alone
        self.adapter = PolicyAdapter(learner.trainer) if lora_layer_names(pm.stage) else None
        self.figures: dict[str, float] = {}
        self.llm: LLM | None = None
        self.runner: TPModelRunner | None = None
        self.resharder.sync()  # the trainer's weights (under LoRA the base: resharded this once)
        self.shard_mb = model_bytes(self.shard) / 2**20
        if self.is_driver:
            self.llm = LLM(self.shard, tokenizer, functools.partial(EngineTPExecutor, self), **engine_options)
        else:
            self.runner = self.shard_runner(self.shard, config, engine_options["max_model_len"])
        if self.adapter is not None:
            self.sync()  # the policy's adapters as the engine's default slot: every request runs through them

    def make_groups(self, n: int, timeout: datetime.timedelta, backend: str) -> None:
        """Every engine's gloo control group and TP group (every rank creates every group, in the same order), the
        drivers' gloo group (the episodes' gather) and a world gloo group (the per-rank figures)."""
        world = dist.get_world_size()
        groups = engine_groups(n, world)
        self.index = self.rank // n  # this rank's engine
        for ranks in groups:
            control = dist.new_group(ranks, timeout=timeout, backend="gloo")  # the driver's step broadcasts
            group = dist.new_group(ranks, timeout=timeout, backend=backend)
            if self.rank in ranks:
                self.control, self.axis = control, Axis("engine_tp", tuple(ranks), ranks.index(self.rank), group)
        self.driver = self.axis.ranks[0]
        self.is_driver = self.rank == self.driver
        drivers = [ranks[0] for ranks in groups]
        self.drivers = dist.new_group(drivers, timeout=timeout, backend="gloo") if len(groups) > 1 else None
        self.world = dist.new_group(list(range(world)), timeout=timeout, backend="gloo")
        self.engines = engine_share(groups, self.index, self.drivers)

    def shard_runner(self, model, config: EngineConfig, max_model_len: int) -> TPModelRunner:
        """This rank's runner over its shard; the pool has as many blocks as one device's (each 1/N of the size),
        the same on every rank."""
        sized = pool_sizes(config, self.full_config, model.dtype, max_model_len)
        return TPModelRunner(model, sized, max_model_len, self.axis, self.comm)

    # -- the step loop ------------------------------------------------------------------------------------------
    def serve(self) -> None:
        """On an engine's other ranks: run the driver's engine steps on this shard until it says stop."""
        assert self.runner is not None
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=self.driver, group=self.control)
            step = box[0]
            if step.stop:
                return
            self.runner.execute(step)

    def serve_evaluation(self) -> None:
        """Evaluation runs on engine 0 (its driver is the run's main rank): its other ranks serve it, the other
        engines' ranks go on at once."""
        if self.index == 0:
            self.serve()

    @contextlib.contextmanager
    def driving(self) -> Iterator[None]:
        """On a driver: the block plays on its engine; at its end (or its error) the engine's other ranks stop
        serving."""
        try:
            yield
        finally:
            dist.broadcast_object_list([Step([], [], [], None, stop=True)], src=self.driver, group=self.control)

    def play(self, fn: Callable[[], list[T]]) -> list[T]:
        """``fn()`` played on this rank's engine by its driver while the others serve its steps; [] on the others.
        ``fn`` plays the engine's share of the step: ``play_share(..., dims=self.engines)``."""
        if not self.is_driver:
            self.serve()
            return []
        with self.driving():
            return fn()

    def share(self, mine: list[T]) -> list[list[T]]:
        """Every engine's episodes on every rank, in engine order (as :func:`~spinwheel.rl.llm.rollout.gather_dp`
        returns them): gathered over the drivers, then broadcast within each engine."""
        parts: list[Any] = [mine]
        if self.is_driver and self.drivers is not None:
            parts = [None] * len(self.engines.dp_axis.ranks)
            dist.all_gather_object(parts, mine, group=self.drivers)
        box: list[Any] = [parts if self.is_driver else None]
        dist.broadcast_object_list(box, src=self.driver, group=self.control)
        return box[0]

    # -- weight sync --------------------------------------------------------------------------------------------
    @property
    def registry(self) -> AdapterRegistry:
        """This rank's adapters (over its shard)."""
        runner = self.llm.engine.runner if self.llm is not None else self.runner
        return runner.loras  # type: ignore[union-attr]

    def sync(self) -> None:
        """Reshard the trainer's new weights into every rank's engine shard (collective) and record every rank's
        time and peak temporary bytes (``figures``: ``engine_sync_s`` and ``engine_sync_peak_mb`` the largest,
        ``/rank{r}`` each rank's); the drivers' prefix caches are dropped. Under LoRA the adapters alone:
        :class:`PolicyAdapter` (``sync_bytes``: the adapters' bytes every rank received)."""
        start = time.perf_counter()
        peak = 0
        if self.adapter is not None:
            self.figures["sync_bytes"] = float(self.adapter.sync(self.registry))
        else:
            peak = self.resharder.sync()
        if self.llm is not None:
            self.llm.engine.update_weights(self.llm.engine.model)  # in place already: drops the prefix cache
        seconds = time.perf_counter() - start
        ranks = torch.zeros(2, dist.get_world_size(), dtype=torch.float64)
        ranks[:, self.rank] = torch.tensor([seconds, peak / 2**20], dtype=torch.float64)
        dist.all_reduce(ranks, group=self.world)
        times, peaks = ranks.tolist()
        self.figures.update({"engine_sync_s": max(times), "engine_sync_peak_mb": max(peaks)})
        self.figures.update({f"engine_sync_s/rank{r}": t for r, t in enumerate(times)})
        self.figures.update({f"engine_sync_peak_mb/rank{r}": b for r, b in enumerate(peaks)})


class EngineTPExecutor(ShardedExecutor):
    """The executor of an engine's driver (``host``: its :class:`EngineTP`): its runner over the driver's shard, each
    step broadcast on the engine's control group to its other ranks, which are the run's own (:meth:`EngineTP.serve`:
    nothing to start or stop). Weights reach the shards by resharding (:meth:`EngineTP.sync`), not through here."""

    def __init__(self, host: EngineTP, model, config: EngineConfig, max_model_len: int) -> None:
        if config.pipeline_parallel_size > 1:
            raise ValueError(
                "--engine-tp runs the RL engine in torchrun's ranks, without stages: leave its PP degree at 1"
            )
        self.host = host
        self.runner = host.shard_runner(model, config, max_model_len)

    def send(self, step: Step) -> None:
        """Ship one engine step to the other ranks (they run it on their shards as this rank runs it on its own)."""
        try:
            dist.broadcast_object_list([step], src=self.host.driver, group=self.host.control)
        except RuntimeError as e:
            raise self.error(e) from e

    def error(self, exc: BaseException) -> TensorParallelError:
        return TensorParallelError(f"a collective of the RL engine's tensor-parallel group failed ({exc})")

    def update_weights(self, model_or_state_dict) -> None:
        """The shard itself (resharded in place): re-install the runner; anything else is refused."""
        if model_or_state_dict is not self.runner.model:
            raise NotImplementedError("update_weights on the RL loop's engine shards: the loop reshards into them")
        self.runner.install()


def lora_layer_names(model: torch.nn.Module) -> list[str]:
    """The projections of ``model`` (a trainer's stage: plain or tensor-parallel) that carry LoRA factors."""
    return [name for name, m in model.named_modules() if isinstance(getattr(m, "lora_A", None), torch.nn.Linear)]


class PolicyAdapter:
    """The policy's LoRA adapters as one adapter slot of every engine rank (:mod:`~spinwheel.engine.multi_lora`), the
    slot requests that name no adapter run through; the engine shard keeps the frozen base. :meth:`sync` writes this
    rank's slice of the current adapters into the slot in place. The first sync installs it from the full factors
    (:meth:`~spinwheel.parallel.trainer.ParallelTrainer.full_state_dict` of the trained parameters alone: DDP /
    ZeRO-1/2 hold them whole, a trainer ``--tp N`` all-gathers its split ones, once); after each update a
    data-parallel trainer's ranks cut their engine rank's slice of their whole factors, and a trainer ``--tp N``'s
    ranks copy their own, which are that slice already (:mod:`~spinwheel.parallel.tensor_lora` splits each factor as
    the engine does): no collective. Every rank of an engine is a rank of this torchrun job, so each writes its own
    slice locally rather than through the driver's step broadcast: nothing is pickled, and no rank waits on another."""

    name = "policy"

    def __init__(self, trainer) -> None:
        self.trainer, self.stage = trainer, trainer.pm.stage
        self.scaling = {n: float(self.stage.get_submodule(n).scaling) for n in lora_layer_names(self.stage)}
        self.sliced = trainer.pm.dims.tp > 1  # the trainer's factors are this rank's engine slices already
        self.bytes = 0  # the adapters' (every rank's factors together): what an update changes

    def full_factors(self) -> dict[str, tuple[torch.Tensor, ...]]:
        """Every adapted projection's full (A, s·B), as an adapter read from disk (collective)."""
        full = self.trainer.full_state_dict(trained_only=True)
        extra = sorted(k for k in full if k.rpartition(".lora_")[0] not in self.scaling)
        if extra:
            raise ValueError(f"--engine-tp with --lora-rank serves the adapters alone; {extra[0]} trains too")
        self.bytes = state_bytes(full)
        return {
            n: (full[f"{n}.lora_A.weight"], full[f"{n}.lora_B.weight"].float() * s) for n, s in self.scaling.items()
        }

    def own_factors(self) -> dict[str, tuple[torch.Tensor, ...]]:
        """This rank's trainer factors (A, s·B) by projection: whole under data parallelism, its slices under TP."""
        layers = {n: self.stage.get_submodule(n) for n in self.scaling}
        return {
            n: (m.lora_A.weight.detach(), m.lora_B.weight.detach().float() * self.scaling[n]) for n, m in layers.items()
        }

    def sync(self, registry: AdapterRegistry) -> int:
        """This rank's slot holds the policy's current adapters; returns the adapters' bytes."""
        if self.name in registry.slots:
            registry.update(self.name, self.own_factors(), sliced=self.sliced)
        else:
            registry.install(self.name, "(the RL policy's adapters)", self.full_factors())
            registry.default = self.name
        return self.bytes
