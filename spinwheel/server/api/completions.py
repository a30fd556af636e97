"""``POST /v1/completions``: text or token-id prompts (one or a batch), ``n`` choices per prompt (the best of
``best_of``), ``echo``, ``logprobs`` (with ``echo``, the prompt's tokens scored too, the first one null), vLLM's
``prompt_logprobs`` on each choice, vLLM's ``return_token_ids`` (``prompt_token_ids`` and ``token_ids`` on each
choice: what the engine was fed and sampled); a JSON response or a server-sent-event stream. Choice ``i * n + j``
is sample ``j`` of prompt ``i``. ``echo`` with ``max_tokens=0`` returns the prompt alone (with ``logprobs``: scored).

The log-prob entries a request asks for are bounded before it runs (``--max-logprobs-per-request``), and a large
response is built off the event loop, so that one request scoring a big batch does not hold up the others."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace

from fastapi.responses import Response
from starlette.requests import Request

from spinwheel.engine import CompletionOutput, RequestOutput, SamplingParams
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.server import generation
from spinwheel.server.api.logprobs import completion_logprobs, concat_logprobs, prompt_logprobs
from spinwheel.server.api.params import DEFAULT_MAX_TOKENS, ServedModel, keep_best, num_candidates
from spinwheel.server.api.protocol import APIError, CompletionRequest
from spinwheel.server.api.streaming import Delta, chunk_envelope, stream_response
from spinwheel.server.async_engine import AsyncEngine


@dataclass
class _Request:
    """One completions request, checked and tokenized: what its response is built from."""

    body: CompletionRequest
    texts: list[str | None]  # each prompt as sent (None for token ids)
    prompts: list[list[int]]
    params: SamplingParams
    prompt_only: bool  # echo with max_tokens=0: the engine's one generated token is dropped
    echo_lp: bool  # echo with logprobs: the prompt is scored too
    num_logprob_entries: int  # at most, in the response (what decides whether it is built off the event loop)
    rid: str = field(default_factory=lambda: f"cmpl-{secrets.token_hex(12)}")
    created: int = field(default_factory=lambda: int(time.time()))

    def drop(self, out: RequestOutput) -> RequestOutput:
        return _drop_outputs(out) if self.prompt_only else out


class Completions(generation.Endpoint):
    def __init__(
        self, model: ServedModel, tokenizer: Tokenizer, engine: AsyncEngine, on_error: Callable[[int], None]
    ) -> None:
        self.model, self.tokenizer, self.engine, self.on_error = model, tokenizer, engine, on_error

    def _tokenize(self, body: CompletionRequest) -> tuple[list[str | None], list[list[int]]]:
        """The prompts' texts (None for token-id prompts) and token ids."""
        raw = body.prompt
        if isinstance(raw, str):
            return [raw], [self.tokenizer.encode(raw)]
        if isinstance(raw[0], str):
            return list(raw), self.tokenizer.encode_batch(list(raw))  # type: ignore[arg-type]
        if isinstance(raw[0], int):
            return [None], [list(raw)]  # type: ignore[arg-type]
        return [None] * len(raw), [list(p) for p in raw]  # type: ignore[union-attr]

    async def _prepare(self, body: CompletionRequest) -> _Request:
        """Check the request, tokenize its prompts (off the event loop when large) and map it to the engine's
        parameters."""
        self.model.check_name(body.model)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        raw = body.prompt
        num_prompts = 1 if isinstance(raw, str) or isinstance(raw[0], int) else len(raw)
        self.model.check_num_sequences(num_prompts, num_candidates(body))
        size = len(raw) if isinstance(raw, str) else sum(len(p) for p in raw) if isinstance(raw[0], str) else 0
        texts, prompts = await generation.off_loop(size, self._tokenize, body)
        max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
        # OpenAI's way to score a prompt: echo it with max_tokens=0. The engine generates one token, dropped.
        prompt_only = body.echo and max_tokens == 0
        if prompt_only:
            max_tokens = 1
        for ids in prompts:
            self.model.check_prompt(ids, max_tokens, "prompt")
        # echo with logprobs scores the prompt too (as vLLM does): its engine request asks for prompt logprobs
        echo_lp = body.echo and body.logprobs is not None
        scored = max(body.prompt_logprobs or 0, body.logprobs or 0) if echo_lp else body.prompt_logprobs
        entries = _logprob_entries(body, prompts, max_tokens, echo_lp)
        self.model.check_logprobs_work(entries, "logprobs" if body.logprobs is not None else "prompt_logprobs")
        params = self.model.sampling_params(body, max_tokens, body.logprobs, prompt_logprobs=scored)
        return _Request(body, texts, prompts, params, prompt_only, echo_lp, entries)

    def _prefix(self, req: _Request, i: int) -> str:
        """The echoed text of prompt ``i`` ("" without ``echo``)."""
        if not req.body.echo:
            return ""
        text = req.texts[i]
        return text if text is not None else self.tokenizer.decode(req.prompts[i])

    def _choice(self, req: _Request, i: int, out: RequestOutput, c: CompletionOutput, d: Delta | None) -> dict:
        """Choice ``c`` of prompt ``i``: whole (``d`` None) or the delta ``d`` of a stream. The echoed prompt (and
        its logprobs, and vLLM's prompt_logprobs) come with the whole choice or its first delta."""
        body, first = req.body, d is None or d.first
        prefix = self._prefix(req, i)
        echoed = prefix if first else ""
        start_token, start_char = (0, 0) if d is None else (d.start_token, d.start_char)
        lp = None
        if body.logprobs is not None and c.logprobs is not None:
            new_ids, new_lps = c.token_ids[start_token:], c.logprobs[start_token:]
            lp = completion_logprobs(self.tokenizer, new_ids, new_lps, len(prefix) + start_char, body.logprobs)
            if req.echo_lp and first and out.prompt_logprobs is not None:
                echo = completion_logprobs(
                    self.tokenizer, req.prompts[i], out.prompt_logprobs, 0, body.logprobs, echoed=True
                )
                lp = concat_logprobs(echo, lp)
        text = echoed + (c.text if d is None else d.text)
        finish = c.finish_reason if d is None else d.finish_reason
        ch = {"index": i * body.n + c.index, "text": text, "logprobs": lp, "finish_reason": finish}
        if body.return_token_ids:  # vLLM's: the prompt's ids with the whole choice or its first delta
            if first:
                ch["prompt_token_ids"] = list(req.prompts[i])
            ch["token_ids"] = list(c.token_ids[start_token:])
        if body.prompt_logprobs is not None and first and out.prompt_logprobs is not None:
            ch["prompt_logprobs"] = prompt_logprobs(
                self.tokenizer, req.prompts[i], out.prompt_logprobs, out.prompt_logprob_ranks, body.prompt_logprobs
            )
        return ch

    async def _respond(self, req: _Request, request: Request) -> Response:
        """The whole response once every prompt's choices are done (built off the event loop when large)."""
        body = req.body
        outs = await generation.collect(self.engine, request, req.rid, req.prompts, req.params)
        outs = [req.drop(keep_best(out, body.n)) for out in outs]

        def build() -> dict:
            choices = [self._choice(req, i, out, c, None) for i, out in enumerate(outs) for c in out.outputs]
            choices.sort(key=lambda ch: ch["index"])
            return {
                "id": req.rid,
                "object": "text_completion",
                "created": req.created,
                "model": req.params.lora or self.model.name,
                "choices": choices,
                "usage": generation.usage(req.prompts, outs),
            }

        size = req.num_logprob_entries + sum(len(c.token_ids) for out in outs for c in out.outputs)
        return await generation.json_response(build, size)

    def _stream(self, req: _Request) -> Response:
        body = req.body
        latest: dict[int, RequestOutput] = {}  # each prompt's newest output: its prompt logprobs

        async def outputs() -> AsyncIterator[tuple[int, RequestOutput]]:
            async with aclosing(generation.run(self.engine, req.rid, req.prompts, req.params)) as run:
                async for i, out in run:
                    latest[i] = out = req.drop(out)
                    yield i, out

        def render(d: Delta) -> list[dict]:
            if (
                not d.text
                and not (d.first and (body.echo or body.return_token_ids))
                and d.finish_reason is None
                and d.output.logprobs is None
                and not (body.return_token_ids and d.output.token_ids[d.start_token :])
            ):
                return []
            return [self._choice(req, d.prompt_index, latest[d.prompt_index], d.output, d)]

        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return stream_response(
            outputs(),
            req.params.stop,
            render,
            chunk_envelope(req.rid, "text_completion", req.created, req.params.lora or self.model.name),
            sum(len(p) for p in req.prompts) if include_usage else None,
            self.on_error,
        )


def _logprob_entries(body: CompletionRequest, prompts: list[list[int]], max_tokens: int, echo_lp: bool) -> int:
    """The most log-prob entries the response can hold: per choice, the echoed prompt's and the output's scored
    tokens x (logprobs + 1); per choice too, vLLM's prompt_logprobs x (prompt_logprobs + 1)."""
    num_choices = body.n  # what is returned (best_of candidates are dropped before the response is built)
    prompt_tokens = sum(len(p) for p in prompts)
    entries = 0
    if body.logprobs is not None:
        entries += num_choices * len(prompts) * max_tokens * (body.logprobs + 1)
        if echo_lp:
            entries += num_choices * prompt_tokens * (body.logprobs + 1)
    if body.prompt_logprobs is not None:
        entries += num_choices * prompt_tokens * (body.prompt_logprobs + 1)
    return entries


def _drop_outputs(out: RequestOutput) -> RequestOutput:
    """``out`` with its generated tokens dropped (``max_tokens=0``: only the echoed prompt is returned); a finished
    choice ends by length, as it would have at zero tokens."""
    choices = [
        replace(
            c,
            text="",
            token_ids=[],
            cumulative_logprob=0.0,
            logprobs=None if c.logprobs is None else [],
            finish_reason="length" if c.finished else None,
            stop_reason=None,
        )
        for c in out.outputs
    ]
    return replace(out, outputs=choices)
