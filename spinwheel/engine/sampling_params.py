"""Per-request generation settings (the OpenAI / vLLM vocabulary)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How one request is decoded.

    ``temperature == 0`` is greedy. ``use_beam_search`` keeps ``n`` beams and returns the ``n`` best finished
    hypotheses, following Hugging Face ``generate(num_beams=n, do_sample=False)`` (see ``beam_search.py``).
    Log-probabilities reported by ``logprobs`` / ``prompt_logprobs`` are those of the model's raw distribution
    (log-softmax of the logits before penalties, temperature and truncation).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF/CTRL: seen tokens (prompt + output): positive logits / p, negative * p
    presence_penalty: float = 0.0  # OpenAI: subtract once for every output token seen
    frequency_penalty: float = 0.0  # OpenAI: subtract per occurrence in the output
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k log-probs per generated token (the sampled token is always included)
    prompt_logprobs: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # HF semantics: True, False (heuristic) or "never"
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be None or an integer >= 0, got {value!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if self.use_beam_search and (self.temperature != 0 and self.temperature != 1.0):
            raise ValueError("beam search is deterministic: leave temperature at its default")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 and not self.use_beam_search

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
