"""OpenAI API request bodies (the subset spinwheel serves) and OpenAI-style errors.

Fields follow the OpenAI reference for ``/v1/completions`` and ``/v1/chat/completions``; unknown fields are accepted
and ignored, as OpenAI's own server does with newer client fields. Bad input becomes a 400 with
``{"error": {"message", "type", "param", "code"}}`` before it reaches the engine. Each rule lives in one place:

- here, the wire: each field's JSON type, required fields, text that is valid Unicode (JSON can spell a lone
  surrogate such as ``"\\ud800"``, which no tokenizer or UTF-8 encoder takes), and the server's caps on what one
  request may ask for (``n <= MAX_N``, ``logprobs <= MAX_LOGPROBS``, at most ``MAX_STOP`` non-empty stop strings,
  at most ``MAX_MESSAGES`` chat messages, and OpenAI's own bounds ``temperature <= 2``,
  ``repetition_penalty <= 10``, a seed in ``[0, 2**63)``);
- :class:`~spinwheel.engine.SamplingParams`, what a value means to the decoder (``n >= 1``, ``temperature >= 0``,
  ``top_p`` in (0, 1], ``max_tokens >= 1``, ...), the same rules for offline callers;
- ``params.py``, what needs the model: token ids inside the vocabulary, prompt plus ``max_tokens`` inside the
  context.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator
from pydantic_core import PydanticCustomError

MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP = 16
# Chat messages in one request at most. Validating a message costs ~20 us on the event loop (pydantic holds the GIL
# throughout, so a worker thread would not free the loop): 30,000 of them stalled every connection 0.5 s. The cap
# is checked as the list is read, so a longer list costs nothing.
MAX_MESSAGES = 4096


MAX_ERROR_CHARS = 1000  # an error's message (and param) at most: what a client sent is never echoed whole


def shown(value: object, limit: int = 100) -> str:
    """A value the client sent, as an error message quotes it: its first ``limit`` characters, then "…"."""
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "…"


class APIError(Exception):
    """An error answered with an OpenAI-style body and an HTTP status; a message or param longer than
    :data:`MAX_ERROR_CHARS` (one that quotes the request: a validation error's path through its keys) is cut there."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        message = shown(message, MAX_ERROR_CHARS)
        param = None if param is None else shown(param, MAX_ERROR_CHARS)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def internal_error(e: BaseException) -> APIError:
    """What a client is told about a failure nobody anticipated (the server logs the traceback)."""
    return APIError(
        500,
        f"internal server error ({type(e).__name__}); the server log has the details",
        type="server_error",
        code="internal_error",
    )


def invalid_text_path(data: Any) -> str | None:
    """Where in parsed JSON a string (value or key) is not valid Unicode, as ``"messages.0.content"``; None when
    all are. The common case costs one C-speed serialisation; only a body that fails it is walked."""
    try:
        json.dumps(data, ensure_ascii=False, skipkeys=True, default=str).encode("utf-8")
        return None
    except UnicodeEncodeError:
        pass
    stack: list[tuple[str, Any]] = [("", data)]  # iterative: JSON may nest deeper than Python's recursion limit
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((f"{path}.{k}" if path else str(k), k))
                stack.append((f"{path}.{k}" if path else str(k), v))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), v) for i, v in enumerate(value))
    return None


class _Body(BaseModel):
    """A request body: unknown fields accepted (and ignored), every string valid Unicode."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        path = invalid_text_path(data)
        if path is not None:
            # the path, not the text: an error message must never quote what cannot be encoded
            raise PydanticCustomError(
                "invalid_unicode",
                "{param}: text is not valid Unicode (a lone surrogate)",
                {"param": path.encode("ascii", "backslashreplace").decode()},
            )
        return data


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _SamplingFields(_Body):
    """Fields shared by both endpoints."""

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
    best_of: StrictInt | None = Field(None, ge=1, le=MAX_N)
    logit_bias: dict[StrictStr, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM extension
    use_beam_search: StrictBool = False  # vLLM extension: best_of (or n) beams, the n best returned
    length_penalty: float = 1.0  # vLLM extension (beam search)
    early_stopping: StrictBool | Literal["never"] = False  # vLLM extension (beam search)
    response_format: dict[str, Any] | None = None  # only {"type": "text"} is served
    include_stop_str_in_output: StrictBool = False  # vLLM extension: the stop string stays in the text
    # vLLM extension: the prompt's and each choice's token ids in the response (what the engine was fed and sampled)
    return_token_ids: StrictBool = False
    # spinwheel extension (vLLM's engine-wide --logprobs-mode, per request): "processed" reports the log-probs of
    # the distribution the tokens were drawn from (after temperature, top-p, penalties) — what an RL trainer needs
    logprobs_mode: Literal["raw", "processed"] = "raw"

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


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[ContentPart] | None = None

    def text(self) -> str:
        """Plain text content (the text parts of a content list joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(400, "only text content parts are supported", param="messages")
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, le=MAX_LOGPROBS)
    max_completion_tokens: StrictInt | None = None
    add_generation_prompt: StrictBool = True  # vLLM extension
    tools: list[Any] | None = None  # tool calling is not served: only an absent or "none" tool_choice
    tool_choice: StrictStr | dict[str, Any] | None = None
    functions: list[Any] | None = None  # the deprecated spelling of tools
    function_call: StrictStr | dict[str, Any] | None = None


class TokenizeRequest(_Body):
    """``POST /tokenize`` (vLLM's): a ``prompt``, or chat ``messages`` rendered as ``/v1/chat/completions``
    renders them. ``add_special_tokens`` defaults to true for a prompt and false for messages (the template writes
    its own), as in vLLM."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Body):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model: StrictStr | None = None
    tokens: list[StrictInt]
