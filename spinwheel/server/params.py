"""From a parsed request body to what the engine runs: the one place where API fields become
:class:`~spinwheel.engine.SamplingParams`, and where the rules that need the model are checked (the served model's
name, token ids inside the vocabulary, prompt plus ``max_tokens`` inside the context).

Value ranges (``n >= 1``, ``top_p`` in (0, 1], ...) are :class:`SamplingParams`' own; its ``ValueError`` becomes a
400 here, so a rule is written once and gives the same message offline and over HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass

from spinwheel.engine import SamplingParams
from spinwheel.engine.sampling_params import SamplingParamsError
from spinwheel.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class ServedModel:
    """What a request is checked against: the name clients send, the vocabulary, the context length and the most
    sequences (prompts x n) one request may start."""

    name: str
    vocab_size: int
    max_model_len: int
    max_sequences_per_request: int = 1024

    def check_name(self, model: str) -> None:
        if model != self.name:
            raise APIError(
                404,
                f"the model '{model}' does not exist; this server serves '{self.name}'",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )

    def check_num_sequences(self, num_prompts: int, n: int) -> None:
        """Checked before anything is tokenized, so that an oversized batch costs the server nothing."""
        if num_prompts * n > self.max_sequences_per_request:
            raise APIError(
                400,
                f"this request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} "
                f"sequences; this server allows at most {self.max_sequences_per_request} per request "
                f"(spinwheel serve --max-sequences-per-request)",
                param="prompt" if num_prompts > 1 else "n",
                code="too_many_sequences",
            )

    def check_token_ids(self, ids: list[int], param: str, what: str = "token id") -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"{what} {bad} is outside the vocabulary (0..{self.vocab_size - 1})", param=param)

    def check_prompt(self, ids: list[int], max_tokens: int | None, param: str) -> int:
        """Validate a prompt's token ids and its context length; returns the effective max_tokens (what is left of
        the context when the request gives none)."""
        self.check_token_ids(ids, param)
        limit = self.max_model_len
        if len(ids) >= limit:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens, but this model's context length is {limit} "
                f"tokens (prompt plus at least one generated token must fit)",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise APIError(
                400,
                f"this model's maximum context length is {limit} tokens, but {len(ids)} prompt "
                f"tokens plus max_tokens={max_tokens} makes {len(ids) + max_tokens}; lower "
                f"max_tokens or shorten the prompt",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    def sampling_params(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        max_tokens: int,
        logprobs: int | None,
        field_names: dict[str, str] | None = None,
    ) -> SamplingParams:
        """The engine's settings for ``body``. ``max_tokens`` and ``logprobs`` come resolved from the endpoint
        (their names and defaults differ between completions and chat; ``field_names`` maps a SamplingParams
        field to the request field an error should name)."""
        self.check_token_ids(body.stop_token_ids or [], "stop_token_ids", what="stop token id")
        try:
            return SamplingParams(
                n=body.n,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=min(body.top_k, self.vocab_size),  # larger than the vocabulary means all of it
                min_p=body.min_p,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                seed=body.seed,
                stop=body.stop,
                stop_token_ids=body.stop_token_ids or [],
                max_tokens=max_tokens,
                min_tokens=body.min_tokens,
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
            )
        except SamplingParamsError as e:
            raise APIError(400, str(e), param=(field_names or {}).get(e.param, e.param)) from None
