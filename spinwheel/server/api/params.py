"""From a parsed request body to what the engine runs: the one place where API fields become
:class:`~spinwheel.engine.SamplingParams`, and where the rules that need the model are checked (the served model's
name, token ids inside the vocabulary, prompt plus ``max_tokens`` inside the context).

Value ranges (``n >= 1``, ``top_p`` in (0, 1], ``logit_bias`` in [-100, 100], ...) are :class:`SamplingParams`' own;
its ``ValueError`` becomes a 400 here, so a rule is written once and gives the same message offline and over HTTP.

``best_of`` and beam search follow vLLM's OpenAI server: the engine runs ``best_of`` samples (or beams; default
``n``) and :func:`keep_best` returns the ``n`` with the highest cumulative log-prob (beam search: score), best
first. Neither streams (which of the candidates is returned is known only at the end). What is not served —
``response_format`` other than text, tool calling — is refused with a 400 rather than silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spinwheel.engine import RequestOutput, SamplingParams
from spinwheel.engine.sampling_params import SamplingParamsError
from spinwheel.server.api.protocol import APIError, ChatCompletionRequest, CompletionRequest, shown

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class ServedModel:
    """What a request is checked against: the name clients send, the vocabulary, the context length and the most
    sequences (prompts x n) one request may start."""

    name: str
    vocab_size: int
    max_model_len: int
    max_sequences_per_request: int = 1024
    max_logprobs_per_request: int = 1_000_000
    loras: tuple[str, ...] = ()  # LoRA adapters served beside the base (``serve --lora NAME=DIR``), by name

    def check_name(self, model: str) -> str | None:
        """The LoRA adapter the request's ``model`` picks (None: the base model); a 404 for a name not served."""
        if model == self.name:
            return None
        if model in self.loras:
            return model
        adapters = " and the LoRA adapters " + ", ".join(f"'{n}'" for n in self.loras) if self.loras else ""
        raise APIError(
            404,
            f"the model '{shown(model)}' does not exist; this server serves '{self.name}'{adapters}",
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

    def check_logprobs_work(self, num_entries: int, param: str) -> None:
        """A 400 before generation when the request's log-prob entries (scored tokens x (top-k + 1), summed over its
        prompts and choices) exceed the limit: each costs response bytes and event-loop time to build."""
        if num_entries > self.max_logprobs_per_request:
            raise APIError(
                400,
                f"this request asks for up to {num_entries} log-prob entries (scored tokens x (top-k + 1) over all "
                f"prompts and choices); this server allows at most {self.max_logprobs_per_request} per request "
                f"(spinwheel serve --max-logprobs-per-request): lower {param}, max_tokens, n or the number of prompts",
                param=param,
                code="too_many_logprobs",
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

    def logit_bias(self, body: CompletionRequest | ChatCompletionRequest) -> dict[int, float] | None:
        """OpenAI's ``{"token id": bias}`` with integer keys inside the vocabulary (the values' range is checked by
        :class:`SamplingParams`)."""
        if not body.logit_bias:
            return None
        bias: dict[int, float] = {}
        for key, value in body.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                message = f"logit_bias keys must be token ids, got {shown(key)!r}"
                raise APIError(400, message, param="logit_bias") from None
            bias[token] = value
        self.check_token_ids(list(bias), "logit_bias", what="logit_bias token id")
        return bias

    def sampling_params(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        max_tokens: int,
        logprobs: int | None,
        field_names: dict[str, str] | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The engine's settings for ``body``: ``n`` is the number of candidates (``best_of``, default ``n``).
        ``max_tokens``, ``logprobs`` and ``prompt_logprobs`` come resolved from the endpoint (their names and
        defaults differ between completions and chat; ``field_names`` maps a SamplingParams field to the request
        field an error should name)."""
        check_supported(body)
        if body.use_beam_search and logprobs is not None:
            raise APIError(400, "logprobs are not reported for beam search", param="logprobs")
        self.check_token_ids(body.stop_token_ids or [], "stop_token_ids", what="stop token id")
        logit_bias = self.logit_bias(body)
        try:
            return SamplingParams(
                n=num_candidates(body),
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=min(body.top_k, self.vocab_size),  # larger than the vocabulary means all of it
                min_p=body.min_p,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                seed=body.seed,
                stop=body.stop,
                include_stop_str_in_output=body.include_stop_str_in_output,
                logprobs_mode=body.logprobs_mode,
                stop_token_ids=body.stop_token_ids or [],
                max_tokens=max_tokens,
                min_tokens=body.min_tokens,
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=logit_bias,
                use_beam_search=body.use_beam_search,
                length_penalty=body.length_penalty,
                early_stopping=body.early_stopping,
                lora=self.check_name(body.model),
            )
        except SamplingParamsError as e:
            raise APIError(400, str(e), param=(field_names or {}).get(e.param, e.param)) from None


def num_candidates(body: CompletionRequest | ChatCompletionRequest) -> int:
    """How many sequences the engine runs per prompt: ``best_of`` (samples or beams), ``n`` when not given."""
    return body.n if body.best_of is None else body.best_of


def check_supported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """A 400 for fields whose meaning this server cannot honour, and for ``best_of`` that contradicts ``n`` or
    ``stream``."""
    fmt = body.response_format
    if fmt is not None and fmt.get("type") != "text":
        raise APIError(
            400,
            f"response_format {fmt.get('type')!r} is not supported: this server generates plain text only "
            "(leave response_format out or use {'type': 'text'})",
            param="response_format",
        )
    if isinstance(body, ChatCompletionRequest):
        for tools, choice in (("tools", "tool_choice"), ("functions", "function_call")):
            if getattr(body, choice) not in (None, "none") or (getattr(body, tools) and getattr(body, choice) is None):
                raise APIError(
                    400,
                    f"tool calling is not supported: leave {tools} out, or set {choice} to 'none'",
                    param=choice if getattr(body, choice) is not None else tools,
                )
    if body.best_of is not None and body.best_of < body.n:
        raise APIError(400, f"best_of ({body.best_of}) must be >= n ({body.n})", param="best_of")
    if body.stream and num_candidates(body) > body.n:
        raise APIError(400, "best_of > n cannot stream: the best candidates are known only at the end", param="best_of")
    if body.stream and body.use_beam_search:
        raise APIError(400, "beam search cannot stream: the best beams are known only at the end", param="stream")


def keep_best(out: RequestOutput, n: int) -> RequestOutput:
    """The ``n`` best of the request's candidates, best first and indexed ``0..n-1``: by cumulative log-prob (beam
    search: length-penalised score, already in that order). With ``n`` candidates (no ``best_of``), ``out``."""
    if len(out.outputs) <= n:
        return out
    ranked = sorted(out.outputs, key=lambda c: -(c.score if c.score is not None else c.cumulative_logprob))
    return replace(out, outputs=[replace(c, index=i) for i, c in enumerate(ranked[:n])])
