"""Server-sent events for both endpoints: the engine's cumulative outputs become per-choice deltas, the endpoint
renders each delta as its chunk objects, and the stream ends with an optional usage chunk and ``data: [DONE]``.

Text once sent is never taken back: while an output runs, the last characters that could still turn out to start
a stop string (and an incomplete UTF-8 character, decoded as U+FFFD) are held back until the next delta.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from spinwheel.engine import CompletionOutput, RequestOutput
from spinwheel.server.api.protocol import APIError, internal_error

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


@dataclass
class Delta:
    """What one output (choice) of a request added since its previous delta."""

    prompt_index: int
    output: CompletionOutput  # cumulative, as the engine reports it
    text: str  # the new text
    start_token: int  # output.token_ids[start_token:] are new since the previous delta
    start_char: int  # ``text`` begins at output.text[start_char]
    finish_reason: str | None  # set on the output's last delta only
    first: bool  # the output's first delta


@dataclass
class _Sent:
    chars: int = 0
    tokens: int = 0
    finished: bool = False


def _new_text(c: CompletionOutput, sent: _Sent, stop: list[str]) -> tuple[str, int]:
    """New text of an output since the last delta, and the position sent up to with it."""
    end = len(c.text)
    if not c.finished:
        hold = max((len(s) for s in stop), default=1) - 1
        end = max(sent.chars, end - hold)
        while end > sent.chars and c.text[end - 1] == "\ufffd":
            end -= 1
    return c.text[sent.chars : end], end


async def deltas(outputs: AsyncIterator[tuple[int, RequestOutput]], stop: list[str]) -> AsyncIterator[Delta]:
    """One :class:`Delta` per unfinished choice of every (prompt index, cumulative output) from ``outputs``: a
    choice that finished early gets no more deltas while its siblings run on."""
    sent: dict[tuple[int, int], _Sent] = {}
    async with aclosing(outputs):  # closed with this generator: the engine requests are aborted at once
        async for i, out in outputs:
            for c in out.outputs:
                first = (i, c.index) not in sent
                st = sent.setdefault((i, c.index), _Sent())
                if st.finished:
                    continue  # its last delta went out; the others' outputs still carry it
                text, end = _new_text(c, st, stop)
                finish = c.finish_reason if c.finished and not st.finished else None
                yield Delta(i, c, text, st.tokens, st.chars, finish, first)
                st.chars, st.tokens = end, len(c.token_ids)
                st.finished = st.finished or c.finished


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def stream_response(
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    stop: list[str],
    render: Callable[[Delta], list[dict]],
    envelope: Callable[..., dict],
    usage_prompt_tokens: int | None,
    on_error: Callable[[int], None],
) -> StreamingResponse:
    """The SSE response of one request. ``render`` turns a delta into the choice objects to send (one chunk each;
    none to skip it); ``envelope(choices, **extra)`` wraps choices into the endpoint's chunk object. With
    ``usage_prompt_tokens`` set (the client asked for ``stream_options.include_usage``) a last chunk without
    choices carries the token counts. A failure after the 200 went out becomes an error event before
    ``[DONE]``, counted by ``on_error(status)``; an unexpected one is logged and reported as a 500 error object."""

    async def events() -> AsyncIterator[str]:
        completion_tokens = 0
        try:
            async with aclosing(deltas(outputs, stop)) as stream:
                async for d in stream:
                    for choice in render(d):
                        yield sse(envelope([choice]))
                    if d.finish_reason is not None:
                        completion_tokens += len(d.output.token_ids)
            if usage_prompt_tokens is not None:
                yield sse(
                    envelope(
                        [],
                        usage={
                            "prompt_tokens": usage_prompt_tokens,
                            "completion_tokens": completion_tokens,
                            "total_tokens": usage_prompt_tokens + completion_tokens,
                        },
                    )
                )
        except APIError as e:
            on_error(e.status)
            yield sse(e.body())
        except Exception as e:  # noqa: BLE001 - the catch-all: the client gets an error object, the log the trace
            logger.exception("streaming a response failed")
            on_error(500)
            yield sse(internal_error(e).body())
        yield DONE

    return StreamingResponse(events(), media_type="text/event-stream")


def chunk_envelope(request_id: str, object_name: str, created: int, model: str) -> Callable[..., dict]:
    def envelope(choices: list[dict], **extra: Any) -> dict:
        return {
            "id": request_id,
            "object": object_name,
            "created": created,
            "model": model,
            "choices": choices,
            **extra,
        }

    return envelope
