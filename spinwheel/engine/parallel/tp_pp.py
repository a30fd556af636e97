"""Tensor and pipeline parallelism together (``tensor_parallel_size = T`` and ``pipeline_parallel_size = P``): P
pipeline stages, each a T-rank tensor-parallel group (vLLM's layout for a model larger than one node).

One ``torch.distributed`` world of T·P ranks laid out as :class:`~spinwheel.parallel.mesh.ParallelDims`' grid does
(pipeline outermost, TP innermost): rank ``s·T + t`` is TP rank t of stage s; the driver (rank 0) is stage 0's TP
rank 0 and spawns the T·P − 1 others (:class:`~spinwheel.engine.parallel.workers.WorkerProcesses`). Every rank builds
its
stage's :class:`~spinwheel.engine.parallel.pp_stage.StageModel` from its stage's tensors only, then splits it
Megatron's way
(:func:`~spinwheel.parallel.tensor.apply_tensor_parallel`, as one TP rank does: heads, MLP width and vocabulary),
so it holds L/P layers × 1/T of each, and 1/(P·T) of every KV block.

Everything else is the pipeline engine's (:class:`~spinwheel.engine.parallel.pp_engine.PPEngine`: P micro-batches in
flight,
the driver schedules and samples) with three changes. Each rank's step (the block moves and the flat batch, with
its stage's adapters and its slices of an update) comes through its own pipe, so a stage's T ranks run it together
and meet in its all-reduces (one process group per stage). Between stages, TP rank t of stage s sends its hidden
states to TP rank t of stage s + 1: after a stage's last row-parallel all-reduce every rank of it holds the same
(N, C), so each next rank gets exactly its input without a broadcast within the next stage (T copies cross, of a
tensor the size of one layer's activation). The last stage gathers its vocabulary slices of the logits within its
group (:meth:`~spinwheel.engine.parallel.tp_worker.TPModelRunner.select_rows`) and its TP rank 0 sends them to the
driver.

LoRA adapters: the driver reads and checks them against the whole model and ships each rank its stage's layers'
factors (:mod:`~spinwheel.engine.parallel.pp_lora`), which the rank slices like the layer they adapt (its registry's
:class:`~spinwheel.engine.multi_lora.Shard` names its stage's layers and its TP axis). ``update_weights``: checked
against the whole model (the pipeline engine's check), then each rank is sent its stage's tensors cut to its TP
slices (:mod:`~spinwheel.engine.parallel.tp_update`'s layout), in the order of its pipe. A lost rank:
:class:`~spinwheel.engine.parallel.pp_executor.PipelineParallelError` (a
:class:`~spinwheel.engine.parallel.workers.TensorParallelError`) naming its stage and TP rank. On GPUs (not run on one
yet)
rank r runs on GPU r, the stages' groups are NCCL's and the hand-overs go through host memory over gloo, as the
pipeline engine's.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections import deque

import torch
import torch.distributed as dist

from spinwheel.engine.config import EngineConfig
from spinwheel.engine.model_runner import StepInputs
from spinwheel.engine.multi_lora import AdapterRegistry, Shard
from spinwheel.engine.parallel.pp_executor import PP_TIMEOUT_S, PPExecutor, _run_stage
from spinwheel.engine.parallel.pp_stage import (
    StageModel,
    StageRunner,
    check_pp_degree,
    full_state,
    stage_layers,
    stage_pool_config,
    stage_state,
)
from spinwheel.engine.parallel.tp_update import Layout, full_layout, own_slices
from spinwheel.engine.parallel.tp_worker import TPModelRunner, check_tp_degree
from spinwheel.engine.parallel.workers import WorkerProcesses, join_engine_group
from spinwheel.models.config import ModelConfig
from spinwheel.models.transformer import Transformer
from spinwheel.parallel.comm import Comm
from spinwheel.parallel.mesh import Axis
from spinwheel.parallel.tensor import apply_tensor_parallel

logger = logging.getLogger(__name__)


def stage_groups(tp: int, pp: int, backend: str, timeout_s: float) -> list:
    """One process group per stage (its T ranks); every rank creates every group, in the same order."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return [dist.new_group(list(range(s * tp, (s + 1) * tp)), timeout=timeout, backend=backend) for s in range(pp)]


def tp_axis(rank: int, tp: int, groups: list) -> Axis:
    """Rank ``rank``'s TP axis: its stage's ranks, its index among them, its stage's group."""
    stage, t = divmod(rank, tp)
    return Axis("tp", tuple(range(stage * tp, (stage + 1) * tp)), t, groups[stage])


def shard_stage(
    config: ModelConfig, pp: int, stage: int, state: dict[str, torch.Tensor], axis: Axis, comm: Comm, device
) -> StageModel:
    """Stage ``stage``'s model (built from its tensors ``state``, by reference) split over ``axis``: this rank copies
    only its slices, then moves to ``device``. Its config counts its layers and its heads (what sizes the KV
    cache)."""
    model = StageModel(config, pp, stage, state)
    apply_tensor_parallel(model, axis, comm)
    model.to(device)
    n, local = axis.size, model.config
    model.config = dataclasses.replace(
        local,
        num_attention_heads=local.num_attention_heads // n,
        num_key_value_heads=local.num_key_value_heads // n,  # type: ignore[operator]
        head_dim=local.head_dim,
    )
    return model


class TPStageRunner(StageRunner):
    """A :class:`StageRunner` over a TP-split stage: the last stage's logits gathered over its TP group."""

    select_rows = TPModelRunner.select_rows

    def __init__(self, model: StageModel, config: EngineConfig, max_model_len: int, axis: Axis, comm: Comm) -> None:
        super().__init__(model, dataclasses.replace(config, cpu_packed_weights=False), max_model_len)
        self.axis, self.comm = axis, comm
        layers = stage_layers(model.full_config.num_hidden_layers, model.pp, model.stage)
        self.loras = AdapterRegistry(model, Shard(model.full_config, layers, axis))  # type: ignore[arg-type]


class TPPPExecutor(PPExecutor):
    """Spawns and drives the T·P − 1 other ranks; ``runner`` is the driver's own (stage 0, TP rank 0)."""

    kind, link = "worker", "a collective or transfer of the tensor- and pipeline-parallel engine"
    engine, degree = "tensor- and pipeline-parallel engine", "tensor_parallel_size × pipeline_parallel_size"
    preload = [*WorkerProcesses.preload, "spinwheel.engine.parallel.tp_pp"]

    def __init__(
        self, model: Transformer, config: EngineConfig, max_model_len: int, timeout_s: float | None = None
    ) -> None:
        timeout_s = timeout_s or PP_TIMEOUT_S
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        check_pp_degree(model.config, pp)
        check_tp_degree(model.config, tp)
        WorkerProcesses.__init__(self, tp * pp, timeout_s)
        self._sends, self._pending = deque(), deque()
        self.tp, self.pp, self.model_config = tp, pp, model.config
        self.next_rank, self.last_rank = tp, (pp - 1) * tp  # stage 1's TP rank 0; the last stage's
        self.forwards = self.most_in_flight = 0
        self.layout: Layout | None = None  # the full model's shapes and split dims, on the first weight update
        device_type = model.device.type
        group_backend = "nccl" if device_type == "cuda" else "gloo"
        runner_config = stage_pool_config(config, model.config, model.dtype, max_model_len)
        state = full_state(model)
        parts = [stage_state(state, model.config, pp, s) for s in range(pp)]
        for rank in range(1, tp * pp):
            box = [parts[rank // tp]]  # emptied once the rank has its copy
            args = (rank, tp, pp, self.init_method, device_type, timeout_s, model.config, box, runner_config)
            self.start(rank, rank_main, (*args, max_model_len), "tppp-rank")
            box.clear()
        del parts[1:]
        self.join("gloo")
        try:
            groups = stage_groups(tp, pp, group_backend, timeout_s)
        except Exception as e:  # a rank gone before the groups exist
            error = self.error(e)
            self.close()
            raise error from e
        self.axis, self.comm = tp_axis(0, tp, groups), Comm(timeout_s)
        first = shard_stage(model.config, pp, 0, parts.pop(), self.axis, self.comm, model.device)
        del state
        self.runner = TPStageRunner(first, runner_config, max_model_len, self.axis, self.comm)
        self.vocab = model.lm_head.out_features
        self.memory = [self.runner.memory(), *self.started()]  # per rank: layer and edge weights, KV cache (bytes)
        logger.info("tensor×pipeline-parallel engine: %d stages × %d TP ranks, per-rank memory %s", pp, tp, self.memory)

    def first_stage(self, inputs: StepInputs) -> torch.Tensor:
        """:meth:`PPExecutor.first_stage`; a collective of stage 0's forward that fails names the lost rank."""
        try:
            return super().first_stage(inputs)
        except (RuntimeError, TimeoutError) as e:  # a collective with a peer gone
            raise self.error(e) from e

    def dead(self) -> str | None:
        """Which rank exited, if one did, by its stage and TP rank: one killed by a signal first (its peers then
        fail their collectives and exit with an error of their own)."""
        ranks = sorted(range(1, len(self.procs) + 1), key=lambda r: (self.procs[r - 1].exitcode or 0) >= 0)
        for rank in ranks:
            proc = self.procs[rank - 1]
            if proc.exitcode is not None:
                stage, t = divmod(rank, self.tp)
                return (
                    f"worker {rank} (pipeline stage {stage}, tensor-parallel rank {t}; pid {proc.pid}) exited with "
                    f"code {proc.exitcode}"
                )
        return None

    def weight_parts(self, state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Every rank's part of the whole model's tensors ``state``: its stage's tensors cut to its TP slices
        (views here; copied for the pipes)."""
        if self.layout is None:
            self.layout = full_layout(self.model_config, self.axis, self.comm)
        parts = []
        for rank in range(self.world):
            stage, t = divmod(rank, self.tp)
            layout = stage_state(self.layout, self.model_config, self.pp, stage)  # type: ignore[arg-type]
            parts.append(own_slices(stage_state(state, self.model_config, self.pp, stage), layout, self.tp, t))
        return parts


def rank_main(
    rank: int,
    tp: int,
    pp: int,
    init_method: str,
    device_type: str,
    conn,
    timeout_s: float,
    model_config: ModelConfig,
    box: list,
    engine_config: EngineConfig,
    max_model_len: int,
) -> None:
    """A rank other than the driver: join the world and the stages' groups, build its stage's TP shard and runner,
    then run each iteration the driver sends until ``stop`` or until the driver is gone."""
    world, flush = tp * pp, engine_config.flush_denormal
    device = join_engine_group(rank, world, init_method, "gloo", device_type == "cuda", timeout_s, flush, conn)
    try:
        groups = stage_groups(tp, pp, "nccl" if device_type == "cuda" else "gloo", timeout_s)
        axis, comm, stage = tp_axis(rank, tp, groups), Comm(timeout_s), rank // tp
        model = shard_stage(model_config, pp, stage, box.pop(), axis, comm, device)
        runner = TPStageRunner(model, engine_config, max_model_len, axis, comm)
        conn.send(runner.memory())
        _run_stage(conn, runner, stage, pp, datetime.timedelta(seconds=timeout_s), tp, axis.rank)
    finally:
        dist.destroy_process_group()
