"""What the engine hands back: per request, its outputs so far (cumulative, so a streaming server takes deltas)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[dict[int, float]] | None = None  # per token {token_id: logprob}, when requested
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    score: float | None = None  # beam search: length-penalised score

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None  # why a request finished with "error"
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first token and finish times (monotonic)
    prompt_logprob_ranks: list[int | None] | None = None  # each prompt token's rank in its distribution (1 = top)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float  # fraction of device blocks held by sequences
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_cache_hit_rate: float
    num_prompt_tokens: int  # computed prompt tokens (prefix-cache hits excluded)
    num_generated_tokens: int
    generation_tokens_per_s: float  # over the last few seconds of steps


@dataclass
class StepInfo:
    num_decode_tokens: int
    num_prefill_tokens: int
    num_preempted: int
