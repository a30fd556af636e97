"""The driver's side of a tensor-parallel engine (``EngineConfig.tensor_parallel_size = N``): vLLM's executor pattern.

The process that owns the engine is the driver, rank 0 of an N-process ``torch.distributed`` world (gloo on CPU,
NCCL when the model is on a GPU, rank r on GPU r). It spawns the N − 1 workers itself (multiprocessing's fork
server, so ``LLM(..., tensor_parallel_size=N)`` needs no launcher), hands each the full weights once through shared
memory (each worker copies only its slices), and joins them in a process group on a free local port. The scheduler,
block manager, sampler and detokenizer run on the driver only; per step the driver sends every worker the schedule's
block moves and the flat batch it prepared (:class:`~spinwheel.engine.parallel.tp_worker.Step`, one pickle through a
pipe
per worker — vLLM ships its ``ExecuteModelRequest`` the same way, through a message queue rather than a collective,
so idle workers wait on a pipe without a collective timing out), then runs the step on its own shard; the workers
run the same step on theirs; the ranks meet in the forward's all-reduces and the logits' all-gather. New full
weights (:meth:`TPExecutor.update_weights`) are checked and cut on the driver, and each worker gets only its slices
(:mod:`~spinwheel.engine.parallel.tp_update`).

Faults: the collectives wait at most ``timeout_s``; a worker that exited is noticed before each step (and when a
collective fails), and the step raises :class:`TensorParallelError` naming it; :meth:`TPExecutor.close` then stops
or kills the others. A process that already has a default process group (a ``torchrun`` job) cannot host one.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from spinwheel.engine.config import EngineConfig
from spinwheel.engine.executor import ShardedExecutor
from spinwheel.engine.parallel.tp_update import (
    Layout,
    checked_state,
    full_layout,
    load_slices,
    own_slices,
    ship,
    untied,
)
from spinwheel.engine.parallel.tp_worker import (
    Step,
    TPModelRunner,
    check_tp_degree,
    pool_sizes,
    shard_model,
    worker_main,
)
from spinwheel.engine.parallel.workers import TensorParallelError, WorkerProcesses  # noqa: F401 (the error is named from here)
from spinwheel.models.transformer import Transformer
from spinwheel.parallel.comm import Comm
from spinwheel.parallel.mesh import Axis

logger = logging.getLogger(__name__)

TP_TIMEOUT_S = 60.0  # longest wait of a collective (and of the workers' start-up)


class TPExecutor(WorkerProcesses, ShardedExecutor):
    """Spawns and drives the workers of an N-way tensor-parallel engine; ``runner`` is the driver's own rank."""

    kind, link = "tensor-parallel worker", "a collective of the tensor-parallel group"
    preload = [*WorkerProcesses.preload, "spinwheel.engine.parallel.tp_worker"]

    def __init__(
        self, model: Transformer, config: EngineConfig, max_model_len: int, timeout_s: float | None = None
    ) -> None:
        timeout_s = timeout_s or TP_TIMEOUT_S
        tp = config.tensor_parallel_size
        check_tp_degree(model.config, tp)
        super().__init__(tp, timeout_s)
        self.tp, self.model_config = tp, model.config
        self.layout: Layout | None = None  # the full model's shapes and split dims, on the first weight update
        self.update_bytes: list[int] = []  # each worker's message in the last weight update
        self.forwards = 0  # steps sent that run the model (the others only move blocks)
        backend = "nccl" if model.device.type == "cuda" else "gloo"
        runner_config = pool_sizes(config, model.config, model.dtype, max_model_len)
        state = {k: v.detach() for k, v in model.state_dict().items()}
        box = [state]  # emptied once the workers have their copy (the Process objects keep their arguments)
        for rank in range(1, tp):
            args = (rank, tp, self.init_method, backend, timeout_s, model.config, box, runner_config, max_model_len)
            self.start(rank, worker_main, args, "tp-worker")
        box.clear()
        self.join(backend)
        self.axis, self.comm = Axis("tp", tuple(range(tp)), 0, dist.group.WORLD), Comm(timeout_s)
        shard = shard_model(model.config, state, self.axis, self.comm, model.device)
        del state
        self.runner = TPModelRunner(shard, runner_config, max_model_len, self.axis, self.comm)
        self.memory = [self.runner.shard_bytes(), *self.started()]  # per rank: sharded and replicated weights, KV
        logger.info("tensor-parallel engine: %d ranks (%s), per-rank memory %s", tp, backend, self.memory)

    def send(self, step: Step) -> None:
        """Ship one step to every worker (raises :class:`TensorParallelError` if one is gone)."""
        self.send_all(step)
        self.forwards += step.inputs is not None

    def update_weights(self, model_or_state_dict: Transformer | dict[str, torch.Tensor]) -> None:
        """Load new full weights on every rank: checked here first (a bad tensor is one line and no rank changes),
        each worker sent only its slices, the driver's own loaded meanwhile; returns once every rank has them (the
        driver's runner re-installed)."""
        shard = self.runner.model
        if model_or_state_dict is shard:
            raise ValueError("update_weights: that is the engine's own shard (rank 0's slices); pass the full model")
        if self.layout is None:
            self.layout = full_layout(self.model_config, self.axis, self.comm)
        state = untied(checked_state(model_or_state_dict, self.layout), shard)
        self.failure = self.failure or self.dead()
        if self.failure is not None:
            raise self.error_class(f"{self.failure}; the engine cannot continue: close it")
        dtypes = {name: p.dtype for name, p in shard.named_parameters(remove_duplicate=False)}
        try:
            self.update_bytes = ship(
                self.conns, state, self.layout, dtypes, lambda w: Step([], [], [], None, weights=w)
            )
            load_slices(shard, own_slices(state, self.layout, self.tp, 0))
            for rank, conn in enumerate(self.conns, 1):
                if not conn.poll(self.timeout_s):
                    self.failure = f"{self.kind} {rank} did not load its weights within {self.timeout_s:.0f}s"
                    raise self.error_class(f"{self.failure}; the engine cannot continue: close it")
                conn.recv()
        except (OSError, EOFError) as e:  # a worker gone
            raise self.error(e) from e
        self.runner.install()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the workers (killing any that do not stop within ``timeout_s``) and leave the process group."""
        self.stop_workers(Step([], [], [], None, stop=True), timeout_s)
