"""The engine's cumulative outputs as per-step deltas, for the pipe between the engine process and the server.

:class:`~spinwheel.engine.RequestOutput` is cumulative: after ``t`` steps a request's output holds all ``t`` tokens,
their text and logprobs. Pickling it whole every step would cost O(t) per request per step, O(t^2) over a
generation. So the engine side (:class:`DeltaEncoder`) remembers what it last sent of each request and sends only
what changed: for a string or list field, how much of the previous value still holds (``keep``) and what follows it
(``tail``); any other field only when it differs. The server side (:class:`DeltaDecoder`) rebuilds the same
cumulative outputs. Like vLLM V1's ``EngineCoreOutput`` (new token ids per request per step), but generic over the
dataclasses' fields, so a field added to the outputs crosses the boundary without a change here.

Wire form of one request's delta: ``(request_id, fields, choices)``; ``fields`` maps :class:`RequestOutput`
fields (``outputs`` excepted) to a value or a :class:`Tail`; ``choices`` holds one such dict per
:class:`CompletionOutput`, by position.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from spinwheel.engine import CompletionOutput, RequestOutput

_UNSET = object()

Delta = tuple[str, dict[str, Any], list[dict[str, Any]]]


class Tail(NamedTuple):
    """A string or list that keeps the first ``keep`` items of the previous value and continues with ``tail``."""

    keep: int
    tail: Any


def _diff(new: dict[str, Any], sent: dict[str, Any], skip: str = "") -> dict[str, Any]:
    """The fields of ``new`` (an output's ``__dict__``; ``skip`` excepted) that differ from ``sent`` (what the
    other side holds), updating ``sent``."""
    delta: dict[str, Any] = {}
    for name, value in new.items():
        old = sent.get(name, _UNSET)
        if value is old or name == skip:
            continue
        kind = type(value)
        if (kind is str or kind is list) and type(old) is kind:
            n = len(old)  # type: ignore[arg-type]
            # list equality checks identity first, so a shallow copy of a list of dicts compares in pointer time
            if value.startswith(old) if kind is str else len(value) >= n and value[:n] == old:
                if len(value) == n:
                    continue
                delta[name] = Tail(n, value[n:])
            else:
                delta[name] = value
        elif old is not _UNSET and old == value:
            continue
        else:
            delta[name] = value
        # the engine may grow its lists in place after this step (logprobs): remember a copy of what was sent
        sent[name] = list(value) if kind is list else dict(value) if kind is dict else value
    return delta


def _apply(delta: dict[str, Any], current: dict[str, Any]) -> None:
    for name, value in delta.items():
        if isinstance(value, Tail):
            old = current[name]
            current[name] = (old if value.keep == len(old) else old[: value.keep]) + value.tail
        else:
            current[name] = value


class DeltaEncoder:
    """Engine side: each step's outputs -> deltas against what was sent before. A request's state is dropped with
    its finished output (or by :meth:`forget`, for a request that failed without one)."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {}

    def encode(self, out: RequestOutput) -> Delta:
        fields, choices = self._sent.setdefault(out.request_id, ({}, []))
        request = _diff(vars(out), fields, skip="outputs")
        del choices[len(out.outputs) :]
        while len(choices) < len(out.outputs):
            choices.append({})
        deltas = [_diff(vars(c), sent) for c, sent in zip(out.outputs, choices)]
        if out.finished:
            del self._sent[out.request_id]
        return out.request_id, request, deltas

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._sent)


class DeltaDecoder:
    """Server side: deltas -> the cumulative :class:`RequestOutput` objects the engine produced (new objects each
    step, so a handler still reading the previous one is never changed under it)."""

    def __init__(self) -> None:
        self._current: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {}

    def decode(self, delta: Delta) -> RequestOutput:
        request_id, request, deltas = delta
        fields, choices = self._current.setdefault(request_id, ({}, []))
        _apply(request, fields)
        del choices[len(deltas) :]
        while len(choices) < len(deltas):
            choices.append({})
        for d, current in zip(deltas, choices):
            _apply(d, current)
        out = RequestOutput(**fields, outputs=[CompletionOutput(**c) for c in choices])
        if out.finished:
            del self._current[request_id]
        return out

    def forget(self, request_id: str) -> None:
        self._current.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._current)
