"""OpenAI API request bodies (the subset spinwheel serves) and OpenAI-style errors.

Fields follow the OpenAI reference for ``/v1/completions`` and ``/v1/chat/completions``; unknown fields are accepted
and ignored, as OpenAI's own server does with newer client fields. Bad input becomes a 400 with
``{"error": {"message", "type", "param", "code"}}`` before it reaches the engine. Each rule lives in one place:

- here, the wire: each field's JSON type, required fields, and the server's caps on what one request may ask for
  (``n <= MAX_N``, ``logprobs <= MAX_LOGPROBS``, at most ``MAX_STOP`` non-empty stop strings, and OpenAI's own
  bounds ``temperature <= 2``, ``repetition_penalty <= 10``, a seed in ``[0, 2**63)``);
- :class:`~spinwheel.engine.SamplingParams`, what a value means to the decoder (``n >= 1``, ``temperature >= 0``,
  ``top_p`` in (0, 1], ``max_tokens >= 1``, ...), the same rules for offline callers;
- ``params.py``, what needs the model: token ids inside the vocabulary, prompt plus ``max_tokens`` inside the
  context.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP = 16


class APIError(Exception):
    """An error answered with an OpenAI-style body and an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr
    n: StrictInt = Field(1, le=MAX_N)
    max_tokens: StrictInt | None = None
    temperature: float = Field(1.0, le=2.0)
    top_p: float = 1.0
    top_k: StrictInt = 0  # vLLM extension; 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = Field(1.0, le=10.0)  # vLLM extension
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(None, le=MAX_LOGPROBS)
    echo: StrictBool = False
    suffix: StrictStr | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        if isinstance(v, list) and isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("token-id prompts must not be empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """Plain text content (the text parts of a content list joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, le=MAX_LOGPROBS)
    max_completion_tokens: StrictInt | None = None
    add_generation_prompt: StrictBool = True  # vLLM extension
