"""``POST /v1/chat/completions``: messages rendered with the checkpoint's chat template, ``n`` choices (the best
of ``best_of``), ``logprobs`` / ``top_logprobs``, vLLM's ``prompt_logprobs`` (non-streaming); a JSON response or a
server-sent-event stream whose first chunk per choice carries the assistant role."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from spinwheel.models.tokenizer import Tokenizer, TokenizerError
from spinwheel.server import generation
from spinwheel.server.async_engine import AsyncEngine
from spinwheel.server.logprobs import chat_logprobs, prompt_logprobs
from spinwheel.server.params import ServedModel, keep_best, num_candidates
from spinwheel.server.protocol import APIError, ChatCompletionRequest, ChatMessage
from spinwheel.server.streaming import Delta, chunk_envelope, stream_response


def render_chat(
    tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool, add_special_tokens: bool = False
) -> list[int]:
    """A conversation's prompt token ids: the chat template writes the special tokens itself."""
    turns = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt)
    except TokenizerError as e:
        raise APIError(400, str(e), param="messages") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


class ChatCompletions:
    def __init__(
        self, model: ServedModel, tokenizer: Tokenizer, engine: AsyncEngine, on_error: Callable[[int], None]
    ) -> None:
        self.model, self.tokenizer, self.engine, self.on_error = model, tokenizer, engine, on_error

    async def __call__(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.model.check_name(body.model)
        self.model.check_num_sequences(1, num_candidates(body))
        size = sum(len(m.text()) for m in body.messages)
        ids = await generation.off_loop(size, render_chat, self.tokenizer, body.messages, body.add_generation_prompt)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = self.model.check_prompt(ids, requested, "messages")
        want_lp = body.logprobs
        top_k = body.top_logprobs or 0
        if top_k and not want_lp:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        names = {"logprobs": "top_logprobs"}
        if body.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        params = self.model.sampling_params(
            body, max_tokens, top_k if want_lp else None, names, prompt_logprobs=body.prompt_logprobs
        )
        rid = f"chatcmpl-{secrets.token_hex(12)}"
        created = int(time.time())

        if not body.stream:
            (out,) = await generation.collect(self.engine, request, rid, [ids], params)
            out = keep_best(out, body.n)
            choices = [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": chat_logprobs(self.tokenizer, c.token_ids, c.logprobs, top_k)
                    if want_lp and c.logprobs is not None
                    else None,
                    "finish_reason": c.finish_reason,
                }
                for c in out.outputs
            ]
            response = {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": self.model.name,
                "choices": choices,
                "usage": generation.usage([ids], [out]),
            }
            if body.prompt_logprobs is not None and out.prompt_logprobs is not None:
                response["prompt_logprobs"] = prompt_logprobs(
                    self.tokenizer, ids, out.prompt_logprobs, out.prompt_logprob_ranks, body.prompt_logprobs
                )
            return JSONResponse(response)

        def render(d: Delta) -> list[dict]:
            c = d.output
            chunks = []
            if d.first:
                chunks.append(
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
            new_tokens = c.token_ids[d.start_token :]
            if not d.text and d.finish_reason is None and not (want_lp and new_tokens):
                return chunks
            lp = (
                chat_logprobs(self.tokenizer, new_tokens, c.logprobs[d.start_token :], top_k)
                if want_lp and c.logprobs is not None
                else None
            )
            chunks.append(
                {
                    "index": c.index,
                    "delta": {"content": d.text} if d.text else {},
                    "logprobs": lp,
                    "finish_reason": d.finish_reason,
                }
            )
            return chunks

        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return stream_response(
            generation.run(self.engine, rid, [ids], params),
            params.stop,
            render,
            chunk_envelope(rid, "chat.completion.chunk", created, self.model.name),
            len(ids) if include_usage else None,
            self.on_error,
        )
