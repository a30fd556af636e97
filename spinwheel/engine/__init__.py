"""Serving engine: Orca iteration-level scheduling over a PagedAttention KV cache, with an offline ``LLM`` API and
an ``LLMEngine`` a server drives step by step."""

from spinwheel.engine.config import EngineConfig
from spinwheel.engine.llm import LLM
from spinwheel.engine.llm_engine import EngineStats, LLMEngine
from spinwheel.engine.outputs import CompletionOutput, RequestOutput
from spinwheel.engine.sampling_params import SamplingParams
from spinwheel.engine.sequence import SequenceStatus

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "EngineStats",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "SequenceStatus",
]
