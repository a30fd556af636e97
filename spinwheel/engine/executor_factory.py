"""The one place the engine's :class:`~spinwheel.engine.executor.Executor` is picked from its config: by the
tensor- and pipeline-parallel degrees (vLLM v1's ``Executor.get_class``)."""

from __future__ import annotations

from spinwheel.engine.config import EngineConfig
from spinwheel.engine.executor import Executor, InProcessExecutor
from spinwheel.engine.parallel.pp_executor import PPExecutor
from spinwheel.engine.parallel.tp_executor import TPExecutor
from spinwheel.engine.parallel.tp_pp import TPPPExecutor
from spinwheel.models.transformer import Transformer

# (tensor_parallel_size > 1, pipeline_parallel_size > 1) -> the executor of that layout
EXECUTORS: dict[tuple[bool, bool], type[Executor]] = {
    (False, False): InProcessExecutor,
    (True, False): TPExecutor,
    (False, True): PPExecutor,
    (True, True): TPPPExecutor,
}


def make_executor(model: Transformer, config: EngineConfig, max_model_len: int) -> Executor:
    """The executor ``config`` asks for, over ``model`` (the whole model: a parallel one cuts its ranks' parts)."""
    layout = (config.tensor_parallel_size > 1, config.pipeline_parallel_size > 1)
    return EXECUTORS[layout](model, config, max_model_len)  # type: ignore[call-arg]
