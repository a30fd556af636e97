"""``POST /v1/chat/completions``: messages rendered with the checkpoint's chat template (:mod:`.chat_template`),
``n`` choices (the best of ``best_of``), ``logprobs`` / ``top_logprobs``, vLLM's ``prompt_logprobs``
(non-streaming) and ``return_token_ids`` (``prompt_token_ids`` on the response — on a stream, on each choice's first
chunk — and ``token_ids`` on each choice or chunk: what the engine was fed and sampled, never re-tokenised); a JSON
response or a server-sent-event stream whose first chunk per choice carries the assistant role. Many
messages or long ones are rendered off the event loop, and a large response is built there too."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi.responses import Response
from starlette.requests import Request

from spinwheel.engine import SamplingParams
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.server import generation
from spinwheel.server.api.logprobs import chat_logprobs, prompt_logprobs
from spinwheel.server.api.params import ServedModel, keep_best, num_candidates
from spinwheel.server.api.protocol import APIError, ChatCompletionRequest
from spinwheel.server.api.streaming import Delta, chunk_envelope, stream_response
from spinwheel.server.async_engine import AsyncEngine
from spinwheel.server.chat_template import MESSAGE_COST_CHARS, ChatRenderer, render_chat

__all__ = ["ChatCompletions", "render_chat"]


@dataclass
class _Request:
    """One chat request, checked and rendered: what its response is built from."""

    body: ChatCompletionRequest
    ids: list[int]  # the rendered prompt
    params: SamplingParams
    top_k: int  # top_logprobs (0 without)
    num_logprob_entries: int  # at most, in the response
    rid: str = field(default_factory=lambda: f"chatcmpl-{secrets.token_hex(12)}")
    created: int = field(default_factory=lambda: int(time.time()))


class ChatCompletions(generation.Endpoint):
    def __init__(
        self,
        model: ServedModel,
        tokenizer: Tokenizer,
        engine: AsyncEngine,
        on_error: Callable[[int], None],
        renderer: ChatRenderer | None = None,
    ) -> None:
        self.model, self.tokenizer, self.engine, self.on_error = model, tokenizer, engine, on_error
        self.renderer = renderer or ChatRenderer(tokenizer)

    async def _prepare(self, body: ChatCompletionRequest) -> _Request:
        self.model.check_name(body.model)
        self.model.check_num_sequences(1, num_candidates(body))
        size = sum(len(m.text()) + MESSAGE_COST_CHARS for m in body.messages)
        ids = await generation.off_loop(size, self.renderer, body.messages, body.add_generation_prompt)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = self.model.check_prompt(ids, requested, "messages")
        top_k = body.top_logprobs or 0
        if top_k and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        entries = body.n * max_tokens * (top_k + 1) if body.logprobs else 0
        if body.prompt_logprobs is not None:
            entries += len(ids) * (body.prompt_logprobs + 1)
        self.model.check_logprobs_work(entries, "top_logprobs" if body.logprobs else "prompt_logprobs")
        names = {"logprobs": "top_logprobs"}
        if body.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        params = self.model.sampling_params(
            body, max_tokens, top_k if body.logprobs else None, names, prompt_logprobs=body.prompt_logprobs
        )
        return _Request(body, ids, params, top_k, entries)

    async def _respond(self, req: _Request, request: Request) -> Response:
        """The whole response once every choice is done (built off the event loop when large)."""
        body = req.body
        (out,) = await generation.collect(self.engine, request, req.rid, [req.ids], req.params)
        out = keep_best(out, body.n)

        def build() -> dict:
            choices = [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": chat_logprobs(self.tokenizer, c.token_ids, c.logprobs, req.top_k)
                    if body.logprobs and c.logprobs is not None
                    else None,
                    "finish_reason": c.finish_reason,
                    **({"token_ids": list(c.token_ids)} if body.return_token_ids else {}),
                }
                for c in out.outputs
            ]
            response = {
                "id": req.rid,
                "object": "chat.completion",
                "created": req.created,
                "model": req.params.lora or self.model.name,
                "choices": choices,
                "usage": generation.usage([req.ids], [out]),
            }
            if body.return_token_ids:
                response["prompt_token_ids"] = list(req.ids)
            if body.prompt_logprobs is not None and out.prompt_logprobs is not None:
                response["prompt_logprobs"] = prompt_logprobs(
                    self.tokenizer, req.ids, out.prompt_logprobs, out.prompt_logprob_ranks, body.prompt_logprobs
                )
            return response

        size = req.num_logprob_entries + sum(len(c.token_ids) for c in out.outputs)
        return await generation.json_response(build, size)

    def _render_delta(self, req: _Request, d: Delta) -> list[dict]:
        """A stream's chunk objects for delta ``d``: the assistant role first, then the new content."""
        c, want_lp, want_ids = d.output, req.body.logprobs, req.body.return_token_ids
        chunks = []
        if d.first:
            role = {"role": "assistant", "content": ""}
            first = {"index": c.index, "delta": role, "logprobs": None, "finish_reason": None}
            chunks.append({**first, "prompt_token_ids": list(req.ids)} if want_ids else first)
        new_tokens = c.token_ids[d.start_token :]
        if not d.text and d.finish_reason is None and not ((want_lp or want_ids) and new_tokens):
            return chunks
        lp = (
            chat_logprobs(self.tokenizer, new_tokens, c.logprobs[d.start_token :], req.top_k)
            if want_lp and c.logprobs is not None
            else None
        )
        delta = {"content": d.text} if d.text else {}
        chunk = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason}
        chunks.append({**chunk, "token_ids": list(new_tokens)} if want_ids else chunk)
        return chunks

    def _stream(self, req: _Request) -> Response:
        body = req.body
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return stream_response(
            generation.run(self.engine, req.rid, [req.ids], req.params),
            req.params.stop,
            lambda d: self._render_delta(req, d),
            chunk_envelope(req.rid, "chat.completion.chunk", req.created, req.params.lora or self.model.name),
            len(req.ids) if include_usage else None,
            self.on_error,
        )
