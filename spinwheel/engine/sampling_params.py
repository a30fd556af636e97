"""Per-request generation settings (the OpenAI / vLLM vocabulary)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

# |length_penalty| at most: length ** length_penalty stays a finite, non-zero float for any context length (up to
# 2^31 tokens: 2^±310), so beam scores never overflow or divide by zero. Usual values are 0 to 2.
MAX_LENGTH_PENALTY = 10.0


class SamplingParamsError(ValueError):
    """An invalid setting; ``param`` names the field (the server reports it in the error object)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How one request is decoded.

    ``temperature == 0`` is greedy. ``use_beam_search`` keeps ``n`` beams and returns the ``n`` best finished
    hypotheses, following Hugging Face ``generate(num_beams=n, do_sample=False)`` (see ``beam_search.py``).
    Log-probabilities reported by ``logprobs`` / ``prompt_logprobs`` are those of the model's raw distribution
    (log-softmax of the logits before penalties, ``logit_bias``, temperature and truncation); with
    ``logprobs_mode="processed"`` those of generated tokens are of the distribution the sample was drawn from
    before truncation (after penalties, bias and temperature: an RL trainer's tempered policy). A request with
    ``prompt_logprobs`` computes its whole prompt (it reads nothing from the prefix cache, whose blocks hold K/V but
    not the logits it needs); what it computes is cached for others. ``logit_bias`` maps a token id to a value in
    [-100, 100] added to its logit before sampling (OpenAI's field): +100 all but forces the token, -100 all but
    bans it. Beam search ranks hypotheses by the raw log-probs, so it takes none of the logits processors
    (penalties, bias, truncation). ``lora`` names a LoRA adapter the engine serves (``LLMEngine.add_lora``, ``spinwheel
    serve --lora``): the request runs through it, unmerged, beside requests of other adapters in the same batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 (vLLM's spelling) = off
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
    logprobs_mode: Literal["raw", "processed"] = "raw"  # of the raw logits, or after penalties and temperature
    prompt_logprobs: int | None = None  # top-k log-probs per prompt token given its prefix (None for the first)
    logit_bias: dict[int, float] | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # HF semantics: True, False (heuristic) or "never"
    skip_special_tokens: bool = True
    lora: str | None = None  # the adapter the request runs through (registered with the engine by name); None: base

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"n must be an integer >= 1, got {self.n!r}")
        # Range checks are written so that NaN fails them (NaN compares false to everything).
        _check(
            self.temperature >= 0 and math.isfinite(self.temperature),
            "temperature",
            f"temperature must be a finite number >= 0, got {self.temperature}",
        )
        _check(0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(
            isinstance(self.top_k, int) and self.top_k >= -1,
            "top_k",
            f"top_k must be an integer >= 1, or 0 or -1 for off, got {self.top_k!r}",
        )
        _check(0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty),
            "repetition_penalty",
            f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            _check(-2 <= getattr(self, name) <= 2, name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            "max_tokens",
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, int) and value >= 0),
                name,
                f"{name} must be None or an integer >= 0, got {value!r}",
            )
        _check(
            self.logprobs_mode in ("raw", "processed"),
            "logprobs_mode",
            f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}",
        )
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        for token, bias in (self.logit_bias or {}).items():
            _check(
                isinstance(token, int) and token >= 0,
                "logit_bias",
                f"logit_bias keys must be token ids (integers >= 0), got {token!r}",
            )
            _check(-100 <= bias <= 100, "logit_bias", f"logit_bias values must be in [-100, 100], got {bias}")
        _check(
            self.lora is None or (isinstance(self.lora, str) and self.lora != ""),
            "lora",
            f"lora must be an adapter's name or None, got {self.lora!r}",
        )
        self._check_beam_search()

    def _check_beam_search(self) -> None:
        """Beam search's own settings, and the sampling settings it cannot take."""
        _check(
            -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY,
            "length_penalty",
            f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}] (beam scores are "
            f"sum of log-probs / length ** length_penalty; 0 to 2 is usual), got {self.length_penalty}",
        )
        _check(
            self.early_stopping in (True, False, "never"),
            "early_stopping",
            f"early_stopping must be True, False or 'never', got {self.early_stopping!r}",
        )
        _check(
            not self.use_beam_search or self.temperature in (0, 1.0),
            "temperature",
            "beam search is deterministic: leave temperature at its default",
        )
        if not self.use_beam_search:
            return
        used = {
            "logit_bias": bool(self.logit_bias),
            "repetition_penalty": self.repetition_penalty != 1.0,
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "top_p": self.top_p < 1,
            "top_k": self.top_k > 0,
            "min_p": self.min_p > 0,
        }
        names = [name for name, on in used.items() if on]
        _check(
            not names,
            names[0] if names else "",
            f"beam search ranks hypotheses by the model's raw log-probs: {', '.join(names)} cannot apply to it",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 and not self.use_beam_search

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(param, message)
