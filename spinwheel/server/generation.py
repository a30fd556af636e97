"""One HTTP request fanned out to engine requests (one per prompt; the engine forks ``n`` samples itself) and their
outputs merged back, with the engine's failures turned into API errors and every unfinished request aborted when
the caller leaves early; and :func:`off_loop` for the request's own CPU work (tokenizing a large body)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from spinwheel.engine import RequestOutput, SamplingParams
from spinwheel.engine.isolation import INTERNAL_ERROR
from spinwheel.server.api.protocol import APIError
from spinwheel.server.async_engine import AsyncEngine, EngineDeadError, EngineStepError

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
INLINE_WORK = 2048  # characters (or token ids) tokenized on the event loop itself: ~3 ms with the built-in tokenizer

T = TypeVar("T")


class Endpoint:
    """An OpenAI generation route: the request is checked and mapped to the engine's parameters (``_prepare``),
    then answered whole (``_respond``) or streamed as server-sent events (``_stream``)."""

    async def __call__(self, body: Any, request: Request) -> Response:
        req = await self._prepare(body)
        if not body.stream:
            return await self._respond(req, request)
        return self._stream(req)

    async def _prepare(self, body: Any) -> Any:
        raise NotImplementedError

    async def _respond(self, req: Any, request: Request) -> Response:
        raise NotImplementedError

    def _stream(self, req: Any) -> Response:
        raise NotImplementedError


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a worker thread when its input is large (``size`` characters or token ids), so that one
    big body does not stall every other connection; inline when small, where the thread hop would cost more. The
    HF tokenizers release the GIL while they work, so the event loop keeps running meanwhile."""
    if size <= INLINE_WORK:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


async def json_response(build: Callable[[], Any], size: int) -> Response:
    """The JSON response of what ``build()`` returns, built and serialised off the event loop when ``size`` (tokens
    and log-prob entries in it) is large: a response of many log-probs takes seconds to build, and every other
    connection would wait that long. Serialised as Starlette's ``JSONResponse`` does."""

    def dumps(obj: Any) -> str:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))

    def render() -> bytes:
        # one choice at a time: a single json.dumps of a big response holds the GIL, and so the event loop, until done
        fields = [
            f"{dumps(key)}:" + ("[" + ",".join(map(dumps, value)) + "]" if key == "choices" else dumps(value))
            for key, value in build().items()
        ]
        return ("{" + ",".join(fields) + "}").encode()

    return Response(await off_loop(size, render), media_type="application/json")


def _api_error(e: BaseException) -> BaseException:
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), type="server_error")
    if isinstance(e, EngineStepError):
        return APIError(500, str(e), type="server_error")
    return e


async def run(
    engine: AsyncEngine, request_id: str, prompts: list[list[int]], params: SamplingParams
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Run one engine request per prompt concurrently; yield (prompt index, cumulative output) as they come.
    Leaving early aborts every unfinished request.

    The merge queue holds one item: while the caller does not take outputs (its client reads slowly), each
    prompt's reader waits with one output in hand and the engine's mailbox keeps only the latest, so a request
    holds O(prompts) outputs at most."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=1)
    done: set[int] = set()

    async def pump(i: int) -> None:
        try:
            async for out in engine.generate(f"{request_id}-{i}", prompts[i], params):
                await queue.put((i, out))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # handed to the caller, which raises it
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(prompts))]
    try:
        while len(done) < len(prompts):
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise _api_error(item)
            if item.finished:
                done.add(i)
                if item.error:  # the engine refused the request (400), or failed on it alone (500)
                    if item.error.startswith(INTERNAL_ERROR):
                        raise APIError(500, item.error, type="server_error")
                    raise APIError(400, item.error)
            yield i, item
    finally:
        for i, t in enumerate(tasks):
            if not t.done():
                t.cancel()
            if i not in done:
                engine.abort(f"{request_id}-{i}")


async def collect(
    engine: AsyncEngine, request: Request, request_id: str, prompts: list[list[int]], params: SamplingParams
) -> list[RequestOutput]:
    """Final outputs of every prompt; a client that goes away meanwhile aborts them."""
    final: dict[int, RequestOutput] = {}

    async def consume() -> None:
        async for i, out in run(engine, request_id, prompts, params):
            if out.finished:
                final[i] = out

    task = asyncio.ensure_future(consume())
    while True:
        finished, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if finished:
            task.result()
            return [final[i] for i in range(len(prompts))]
        if await request.is_disconnected():
            task.cancel()
            raise APIError(499, "client disconnected")


def usage(prompts: list[list[int]], outs: list[RequestOutput]) -> dict[str, int]:
    """The response's token counts: every prompt once, every choice's generated tokens."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for out in outs for c in out.outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
