"""The engine's one seam to the model: an :class:`Executor` runs each scheduled step on the model (vLLM v1's
``Executor``).

The engine (:class:`~spinwheel.engine.llm_engine.LLMEngine`) schedules, samples and detokenizes; everything that
touches the weights or the KV cache goes through its executor: ``execute_model`` (one step's block moves and forward
-> the picked rows' logits), ``update_weights`` (new weights from a trainer), ``add_lora`` (serve an adapter by name)
and ``close``. ``runner`` is this process's :class:`~spinwheel.engine.model_runner.ModelRunner` (the whole model, or
rank 0's part of it): the engine reads the KV pool's size and the adapters' registry from it.

The implementations, one per layout, picked from the config by
:func:`~spinwheel.engine.executor_factory.make_executor`:

========================================  =================================================================
:class:`InProcessExecutor`                the whole model in this process
:class:`~spinwheel.engine.parallel.tp_executor.TPExecutor`    N tensor-parallel ranks, N − 1 of them spawned workers
:class:`~spinwheel.engine.parallel.pp_executor.PPExecutor`    P pipeline stages, spawned (:class:`PipelinedExecutor`)
:class:`~spinwheel.engine.parallel.tp_pp.TPPPExecutor`        P stages × T ranks, spawned (:class:`PipelinedExecutor`)
``EngineTPExecutor`` (``rl/llm/rollouts/engine_tp.py``)       N tensor-parallel ranks that are a torchrun job's own
========================================  =================================================================

The tensor-parallel ones share :class:`ShardedExecutor`: the driver's runner holds rank 0's shard, and each step
is shipped to the other ranks (``send``: a pipe per spawned worker, or a broadcast to torchrun's ranks) before it
runs here. A caller with an executor of its own (the RL loop's) passes a factory to the engine instead.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from spinwheel.engine.config import EngineConfig
from spinwheel.engine.model_runner import ModelRunner, StepLogits
from spinwheel.engine.parallel.tp_update import checked_state
from spinwheel.engine.parallel.tp_worker import Step, TPModelRunner, to_device
from spinwheel.engine.scheduler_output import SchedulerOutput
from spinwheel.models.transformer import Transformer

Weights = Transformer | dict[str, torch.Tensor]


class Executor(ABC):
    """Runs the engine's steps on the model, wherever its parts live; ``runner`` is this process's part."""

    runner: ModelRunner

    @abstractmethod
    def execute_model(self, out: SchedulerOutput) -> StepLogits | None:
        """Perform the step's block moves and run the model over its scheduled tokens: the logits of the rows the
        engine samples or scores (None when the step runs no forward)."""

    @abstractmethod
    def update_weights(self, model_or_state_dict: Weights) -> None:
        """Load new weights (a model or a state dict, checked whole first: a bad tensor is one line and nothing
        changes) on every rank; returns once they are in place for the next step."""

    def add_lora(self, name: str, path: str | os.PathLike) -> None:
        """Serve the PEFT adapter in ``path`` as ``name`` on every rank (from the next step on the others)."""
        self.runner.loras.add(name, path)

    def close(self) -> None:  # noqa: B027 - a default: an executor that started nothing has nothing to stop
        """Release what the executor started (worker processes, process groups); nothing for one process."""


ExecutorFactory = Callable[[Transformer, EngineConfig, int], Executor]  # (model, config, max_model_len)


class InProcessExecutor(Executor):
    """The whole model in this process, on one device."""

    def __init__(self, model: Transformer, config: EngineConfig, max_model_len: int) -> None:
        self.runner = ModelRunner(model, config, max_model_len)

    def execute_model(self, out: SchedulerOutput) -> StepLogits | None:
        return self.runner.run(out)

    def update_weights(self, model_or_state_dict: Weights) -> None:
        """Copy the new weights into the served model in place (the served model itself: nothing to copy, it was
        changed in place) and re-install the runner (repacks the CPU path's weights)."""
        model = self.runner.model
        if model_or_state_dict is not model:  # checked whole first: a bad tensor is one line, nothing loaded
            state = checked_state(model_or_state_dict, {k: (t.shape, None) for k, t in model.state_dict().items()})
            with torch.no_grad():
                model.load_state_dict(state, strict=False)
        self.runner.install()


class ShardedExecutor(Executor):
    """A tensor-parallel executor's driver: ``runner`` holds rank 0's shard, and every step goes to the other ranks
    (``send``, with the adapters added since the last one) before it runs here; the ranks meet in the forward's
    all-reduces and the logits' all-gather. ``error`` turns a failed collective into the error naming a lost rank."""

    runner: TPModelRunner

    @abstractmethod
    def send(self, step: Step) -> None:
        """Ship one step to every other rank."""

    @abstractmethod
    def error(self, exc: BaseException) -> RuntimeError:
        """The error a failed step raises."""

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> StepLogits | None:
        runner = self.runner
        moves = (out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy)
        inputs = runner.prepare_inputs(out.scheduled, out.block_tables) if out.scheduled else None
        if inputs is None and not any(moves):
            return None
        cpu = to_device(inputs, torch.device("cpu")) if runner.model.device.type != "cpu" else inputs
        self.send(Step(*moves, cpu, adapters=runner.loras.take_pending()))  # type: ignore[arg-type]
        try:
            return runner.execute(Step(*moves, inputs))  # type: ignore[arg-type]
        except (RuntimeError, TimeoutError) as e:  # a collective with a peer gone
            raise self.error(e) from e


class PipelinedExecutor(Executor):
    """An executor with several steps in flight (pipeline stages): ``launch`` starts one, ``collect`` returns the
    oldest one's logits; :class:`~spinwheel.engine.parallel.pp_engine.PPEngine` keeps one per micro-batch in flight."""

    @abstractmethod
    def launch(self, out: SchedulerOutput) -> bool:
        """Start the step; True when a forward is now in flight (its logits come from :meth:`collect`)."""

    @abstractmethod
    def collect(self) -> StepLogits:
        """The logits of the oldest step in flight."""

    def execute_model(self, out: SchedulerOutput) -> StepLogits | None:
        """One step through the whole pipeline (its logits; call it with no other step in flight)."""
        return self.collect() if self.launch(out) else None
