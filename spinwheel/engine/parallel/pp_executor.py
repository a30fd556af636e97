"""The driver's side of a pipeline-parallel engine (``EngineConfig.pipeline_parallel_size = P``), and the stages'.

The process that owns the engine is the driver: rank 0 of a P-process ``torch.distributed`` world (gloo; with the
model on a GPU, stage r runs on GPU r and the transfers go through host memory; not run on a GPU yet) and stage 0
(:mod:`~spinwheel.engine.parallel.pp_stage`). It spawns the P − 1 other stages itself, as
:class:`~spinwheel.engine.parallel.tp_executor.TPExecutor` spawns its workers (the fork server; each stage gets only
its own
tensors, through shared memory). Per engine iteration (:meth:`PPExecutor.launch`) the driver pipes the block moves
and the flat batch it prepared to every stage (:class:`~spinwheel.engine.parallel.tp_worker.Step`), runs its own layers
and
sends the hidden states on (``isend``: it does not wait); stage s receives from s − 1, runs its layers and sends to
s + 1; the last stage sends the picked rows' logits back, which :meth:`PPExecutor.collect` receives. Every stage
handles the iterations in the order they were launched, so several may be in flight at once:
:class:`~spinwheel.engine.parallel.pp_engine.PPEngine` keeps P of them (one per micro-batch) so the stages stay busy.

Faults: every receive waits at most ``timeout_s``; a stage that exited is noticed before each launch (and when a
transfer fails), and the engine raises :class:`PipelineParallelError` naming it (a
:class:`~spinwheel.engine.parallel.tp_executor.TensorParallelError`, so whatever handles a lost tensor-parallel worker,
such as
``spinwheel serve``'s engine process, handles a lost stage alike); :meth:`PPExecutor.close` stops or kills the others.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import pickle
from collections import deque

import torch
import torch.distributed as dist

from spinwheel.engine.config import EngineConfig
from spinwheel.engine.executor import PipelinedExecutor, Weights
from spinwheel.engine.model_runner import ModelRunner, StepInputs, StepLogits
from spinwheel.engine.parallel.pp_lora import checked_update, load_stage_weights, stage_part
from spinwheel.engine.parallel.pp_stage import (
    StageModel,
    StageRunner,
    check_pp_degree,
    full_state,
    stage_layers,
    stage_pool_config,
    stage_state,
)
from spinwheel.engine.parallel.tp_worker import Step, to_device
from spinwheel.engine.parallel.workers import TensorParallelError, WorkerProcesses, driver_steps, join_engine_group
from spinwheel.models.transformer import Transformer
from spinwheel.parallel.comm import Handle

logger = logging.getLogger(__name__)

PP_TIMEOUT_S = 60.0  # longest wait of a transfer between stages (and of the stages' start-up)
_HIDDEN, _LOGITS = 1, 2  # message tags


class PipelineParallelError(TensorParallelError):
    """A pipeline stage is gone or a transfer failed: the engine cannot step any more (close it)."""


class PPExecutor(WorkerProcesses, PipelinedExecutor):
    """Spawns and drives the stages of a P-stage pipeline; ``runner`` is the driver's own stage (stage 0)."""

    kind, link, error_class = "pipeline stage", "a transfer between pipeline stages", PipelineParallelError
    engine, degree = "pipeline-parallel engine", "pipeline_parallel_size"
    preload = [*WorkerProcesses.preload, "spinwheel.engine.parallel.pp_executor"]

    def __init__(
        self, model: Transformer, config: EngineConfig, max_model_len: int, timeout_s: float | None = None
    ) -> None:
        timeout_s = timeout_s or PP_TIMEOUT_S
        pp = config.pipeline_parallel_size
        check_pp_degree(model.config, pp)
        super().__init__(pp, timeout_s)
        self._sends: deque[tuple[Handle, torch.Tensor]] = deque()  # hidden states sent to stage 1, in flight
        self._pending: deque[StepInputs] = deque()  # iterations launched whose logits have not come back
        self.pp, self.model_config = pp, model.config
        self.tp, self.next_rank, self.last_rank = 1, 1, pp - 1  # one rank per stage (tp_pp: T per stage)
        self.forwards = 0  # iterations launched that run the model
        self.most_in_flight = 0  # the most iterations ever in flight at once
        # gloo even on GPUs: its sends progress in the background, so iterations in flight in both directions
        # between two stages cannot deadlock the way NCCL's in-order point-to-point operations can
        backend, device_type = "gloo", model.device.type
        runner_config = stage_pool_config(config, model.config, model.dtype, max_model_len)
        state = full_state(model)
        for stage in range(1, pp):
            box = [stage_state(state, model.config, pp, stage)]  # emptied once the stage has its copy
            init = self.init_method
            args = (stage, pp, init, device_type, timeout_s, model.config, box, runner_config, max_model_len)
            self.start(stage, stage_main, args, "pp-stage")
            box.clear()
        self.join(backend)
        first = StageModel(model.config, pp, 0, stage_state(state, model.config, pp, 0))
        del state
        self.runner = StageRunner(first, runner_config, max_model_len)
        self.vocab = model.lm_head.out_features
        self.memory = [self.runner.memory(), *self.started()]  # per stage: layer and edge weights, KV cache (bytes)
        logger.info("pipeline-parallel engine: %d stages (%s), per-stage memory %s", pp, backend, self.memory)

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def launch(self, out) -> bool:
        """Start one engine iteration (a :class:`~spinwheel.engine.scheduler_output.SchedulerOutput`): every stage
        gets its block moves and batch, stage 0 runs and sends its hidden states on. True when a forward is now in
        flight (its logits come from :meth:`collect`, in launch order); False when the iteration only moved blocks
        (or did nothing)."""
        moves = (out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy)
        inputs = self.runner.prepare_inputs(out.scheduled, out.block_tables) if out.scheduled else None
        if inputs is None and not any(moves):
            return False
        cpu = to_device(inputs, torch.device("cpu")) if self.runner.model.device.type != "cpu" else inputs
        step = Step(*moves, cpu)  # type: ignore[arg-type]
        self.send(step)
        self.runner.move(step)
        if inputs is None:
            return False
        hidden = self.first_stage(inputs)
        try:
            self._sends.append((Handle(dist.isend(hidden, self.next_rank, tag=_HIDDEN), self.timeout), hidden))
        except (RuntimeError, TimeoutError) as e:
            raise self.error(e) from e
        self._pending.append(inputs)
        self.forwards += 1
        self.most_in_flight = max(self.most_in_flight, len(self._pending))
        return True

    def first_stage(self, inputs: StepInputs) -> torch.Tensor:
        """Stage 0's layers (the driver's) over the iteration's batch: the hidden states to send on, on the CPU."""
        return self.runner.stage_forward(inputs).contiguous().cpu()  # a no-op on CPU

    def send(self, step: Step, weights: list[dict[str, torch.Tensor]] | None = None) -> None:
        """Send ``step`` to every stage, with its part of the adapters added since the last message and its part of
        ``weights`` (per rank: rank r's is ``weights[r]``; rank r holds stage r // tp), if any
        (:mod:`~spinwheel.engine.parallel.pp_lora`)."""
        shipments = self.runner.loras.take_pending()  # type: ignore[attr-defined]
        if not shipments and weights is None:
            return self.send_all(step)
        if self.failure is None:
            self.failure = self.dead()
        if self.failure is not None:
            raise self.error_class(f"{self.failure}; the engine cannot continue: close it")
        try:
            for rank, conn in enumerate(self.conns, 1):
                layers = stage_layers(self.model_config.num_hidden_layers, self.pp, rank // self.tp)
                part = [stage_part(s, layers) for s in shipments]
                message = dataclasses.replace(step, adapters=part, weights=None if weights is None else weights[rank])
                conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError as e:
            raise self.error(e) from e

    def update_weights(self, model_or_state_dict: Weights) -> None:
        """Load new weights, checked against the whole model first
        (:func:`~spinwheel.engine.parallel.pp_lora.checked_update`):
        the driver's part here at once, every other rank's through its pipe, after the iterations in flight."""
        state = checked_update(model_or_state_dict, self.runner.loras.full_model())  # type: ignore[attr-defined]
        parts = self.weight_parts(state)
        copies = [{k: _compact(v) for k, v in part.items()} for part in parts[1:]]
        self.send(Step([], [], [], None), weights=[parts[0], *copies])
        load_stage_weights(self.runner, parts[0])

    def weight_parts(self, state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Every rank's part of the whole model's tensors ``state``, in rank order: its stage's."""
        return [stage_state(state, self.model_config, self.pp, s) for s in range(self.pp)]

    def collect(self) -> StepLogits:
        """The logits of the oldest iteration in flight, from the last stage."""
        inputs = self._pending.popleft()
        logits = torch.empty(len(inputs.picks), self.vocab, dtype=torch.float32)
        try:
            if logits.shape[0]:
                Handle(dist.irecv(logits, self.last_rank, tag=_LOGITS), self.timeout).wait()
            while len(self._sends) > len(self._pending):  # this iteration's hidden states have left
                self._sends.popleft()[0].wait()
        except (RuntimeError, TimeoutError) as e:
            raise self.error(e) from e
        return StepLogits(logits.to(self.runner.model.device), inputs.sample_rows, inputs.prompt_rows)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the stages (killing any that do not stop within ``timeout_s``) and leave the process group."""
        self.stop_workers(Step([], [], [], None, stop=True), timeout_s)
        self._sends.clear()
        self._pending.clear()


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU with a storage of its own (pickling a view would send its whole storage)."""
    t = t.detach().cpu()
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def stage_main(
    stage: int,
    pp: int,
    init_method: str,
    device_type: str,
    timeout_s: float,
    conn,
    model_config,
    box,
    engine_config,
    max_model_len: int,
) -> None:
    """A stage process: join the group, build this stage's model (its own copy of its tensors) and runner, then
    run each iteration the driver sends until ``stop`` or until the driver is gone (its end of the pipe closed)."""
    flush = engine_config.flush_denormal
    device = join_engine_group(stage, pp, init_method, "gloo", device_type == "cuda", timeout_s, flush, conn)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        state = {k: v.to(device, copy=True) for k, v in box.pop().items()}
        runner = StageRunner(StageModel(model_config, pp, stage, state), engine_config, max_model_len)
        del state
        conn.send(runner.memory())
        _run_stage(conn, runner, stage, pp, timeout)
    finally:
        dist.destroy_process_group()


def _run_stage(
    conn, runner: ModelRunner, stage: int, pp: int, timeout: datetime.timedelta, tp: int = 1, tp_rank: int = 0
) -> None:
    """A stage's iterations: receive from the previous stage's rank ``tp_rank`` (stage 0 embeds the tokens), run,
    send to the next stage's (the last stage's TP rank 0 sends the gathered logits to the driver)."""
    sends: deque[tuple[Handle, torch.Tensor]] = deque()
    rank = stage * tp + tp_rank
    width = runner.model.config.hidden_size
    for step in driver_steps(conn):
        runner.receive(step)  # type: ignore[attr-defined]
        runner.move(step)  # type: ignore[attr-defined]
        inputs = step.inputs
        if inputs is None:
            continue
        device = runner.model.device
        inputs = to_device(inputs, device) if device.type != "cpu" else inputs
        hidden = None
        if stage > 0:
            hidden = torch.empty(inputs.input_ids.shape[0], width, dtype=runner.model.dtype)
            Handle(dist.irecv(hidden, rank - tp, tag=_HIDDEN), timeout).wait()
            hidden = hidden.to(device)
        out = runner.stage_forward(inputs, hidden)  # type: ignore[attr-defined]
        if stage == pp - 1:
            out, dst, tag = runner.select_rows(out, inputs).logits.contiguous(), 0, _LOGITS
            if not out.shape[0] or tp_rank:
                continue  # no row completes (the driver expects nothing), or TP rank 0 sends them
        else:
            out, dst, tag = out.contiguous(), rank + tp, _HIDDEN
        out = out.cpu()  # a no-op on CPU
        sends.append((Handle(dist.isend(out, dst, tag=tag), timeout), out))
        while len(sends) > pp:
            sends.popleft()[0].wait()
