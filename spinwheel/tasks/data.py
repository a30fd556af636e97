"""JSONL readers for user data: SFT, RL (prompt + verifiable answer) and preference pairs.

One JSON object per line; blank lines are skipped and unknown keys are ignored. Every problem is reported
as one line in compiler style, ``path:line: what is wrong``, so a bad record in a large file can be found
and fixed without reading the reader's code:

- SFT:        ``{"prompt": str, "completion": str}`` or ``{"messages": [{"role": ..., "content": ...}, ...]}``
              (roles system / user / assistant; the last message is the assistant's reply to train on) or TRL's
              conversational ``{"prompt": [messages ending with the user's], "completion": [{"role": "assistant",
              "content": ...}]}`` (read as the ``messages`` of the two joined) or
              ``{"segments": [{"text": str, "model": bool}, ...]}`` (a multi-turn episode, e.g. an environment's
              expert trace: trained on the ``model`` segments only)
- RL:         ``{"prompt": str, "answer": str | int}`` or ``{"messages": [...], "answer": ...}`` (the conversation so
              far, ending with the user's turn; rendered with the checkpoint's chat template) or TRL's
              conversational ``{"prompt": [messages], ...}`` (read as ``messages``); the line's other
              fields are kept in ``columns`` (a TRL-style reward function receives them by name)
- preference: ``{"prompt": str, "chosen": str, "rejected": str}``

Lines are read with a byte cap (:data:`MAX_LINE_BYTES`) before anything parses them, so one huge line costs at
most that much memory; every record remembers its ``path:line`` (``where``) so a later check (a prompt that does not
fit the model's context) can name it too. Small samples of each format ship in :data:`SAMPLES_DIR`.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spinwheel.tasks.arithmetic import canonical_integer

SAMPLES_DIR = Path(__file__).parent / "samples"

ROLES: tuple[str, ...] = ("system", "user", "assistant")

# The longest data line read (bytes, newline excluded): far above any context a record must fit (1 MiB of text is
# ~250k tokens), far below what parsing and tokenizing a runaway line would take (a 50 MB line took ~20 GB).
MAX_LINE_BYTES = 1 << 20

_SFT_FORMATS = '(expected {"prompt", "completion"} or {"messages"})'


class DataError(ValueError):
    """A malformed data file; the message names the file, the line and the field."""


@dataclass
class SFTRecord:
    """One SFT example: ``prompt`` + ``completion``, a chat ``messages`` list ending with the assistant, or
    ``segments``: (text, is the model's) pieces of a multi-turn episode, at least one of them the model's."""

    prompt: str | None = None
    completion: str | None = None
    messages: list[dict[str, str]] | None = None
    where: str = field(default="", compare=False, repr=False)  # "path:line" of the record, for later messages
    segments: list[tuple[str, bool]] | None = None

    def __post_init__(self) -> None:
        if self.segments is not None:
            if self.prompt is not None or self.completion is not None or self.messages is not None:
                raise ValueError("SFTRecord takes segments alone, without prompt, completion or messages")
            if not any(model for _, model in self.segments):
                raise ValueError("SFTRecord segments need at least one model segment (the text to train on)")
        elif self.messages is None:
            if self.prompt is None or self.completion is None:
                raise ValueError("SFTRecord needs prompt and completion, or messages")
        elif self.prompt is not None or self.completion is not None:
            raise ValueError("SFTRecord takes prompt and completion, or messages, not both")
        elif not self.messages or self.messages[-1].get("role") != "assistant":
            raise ValueError("SFTRecord messages must be non-empty and end with an assistant message")


@dataclass
class RLRecord:
    """One RL prompt with the verifiable answer its completions are rewarded against."""

    prompt: str | None
    answer: str
    messages: list[dict[str, str]] | None = None  # instead of prompt: rendered with the chat template
    where: str = field(default="", compare=False, repr=False)
    # The line's other fields as read (JSON values; "answer" too, unconverted), for TRL-style reward functions.
    columns: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


@dataclass
class PreferenceRecord:
    """One preference pair: ``chosen`` is preferred over ``rejected`` as a completion of ``prompt``."""

    prompt: str
    chosen: str
    rejected: str
    where: str = field(default="", compare=False, repr=False)


def _type_name(value: Any) -> str:
    # JSON's names where Python's read oddly in a data error (NoneType, dict, str).
    return {type(None): "null", dict: "object", str: "string"}.get(type(value), type(value).__name__)


def _lines(path: Path, max_line_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(line number, raw bytes) of each line, never reading more than ``max_line_bytes`` + 1 bytes of one."""
    with path.open("rb") as f:
        for lineno in itertools.count(1):
            raw = f.readline(max_line_bytes + 1)
            if not raw:
                return
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):  # the read stopped inside the line
                raise DataError(
                    f"{path}:{lineno}: line longer than {max_line_bytes} bytes (the cap on one data line, "
                    "MAX_LINE_BYTES / max_line_bytes); shorten or split the record"
                )
            yield lineno, raw


def _parse(where: str, raw: bytes, first: bool) -> Any:
    """One line's JSON value (None for a blank line), or a :class:`DataError` naming ``where``."""
    try:
        # utf-8-sig on the first line drops the byte-order mark some Windows editors write.
        line = raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not line.strip():
        return None
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise DataError(f"{where}: invalid JSON (nested too deeply to read)") from None
    except ValueError:  # an integer past Python's digit limit for int(str)
        limit = sys.get_int_max_str_digits()
        raise DataError(f"{where}: invalid JSON (a number of more than {limit} digits; write it as a string)") from None


def _read_objects(
    path: str | os.PathLike[str], max_line_bytes: int = MAX_LINE_BYTES
) -> list[tuple[str, dict[str, Any]]]:
    """(location prefix ``path:line``, object) for each non-blank line of a JSONL file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}" if not path.exists() else f"not a file: {path}")
    rows = []
    # Binary read, decoded per line, so an encoding error is reported with its line number as well.
    for lineno, raw in _lines(path, max_line_bytes):
        where = f"{path}:{lineno}"
        obj = _parse(where, raw, first=lineno == 1)
        if obj is None:
            continue
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object, got {_type_name(obj)}")
        rows.append((where, obj))
    if not rows:
        raise DataError(f"{path}: no records (the file is empty or blank)")
    return rows


def _text(where: str, key: str, value: str) -> str:
    """``value`` when it is valid Unicode; JSON's ``\\ud800`` escapes decode to lone surrogates no encoder takes."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(
            f"{where}: field '{key}' holds a lone surrogate (\\u{ord(value[e.start]):04x} at character {e.start}); "
            "text must be valid Unicode"
        ) from None
    return value


def _string(where: str, obj: dict[str, Any], key: str, expected: str) -> str:
    if key not in obj:
        raise DataError(f"{where}: missing field '{key}' {expected}")
    value = obj[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{key}' must be a string, got {_type_name(value)}")
    return _text(where, key, value)


def _objects(where: str, key: str, value: Any, keys: str) -> list[tuple[str, dict[str, Any]]]:
    """``(name, item)`` of field ``key``, a non-empty list of objects with ``keys``; anything else a DataError."""
    if not isinstance(value, list) or not value:
        got = "an empty list" if isinstance(value, list) else _type_name(value)
        raise DataError(f"{where}: field '{key}' must be a non-empty list of {keys}, got {got}")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise DataError(f"{where}: field '{key}[{i}]' must be an object, got {_type_name(item)}")
    return [(f"{key}[{i}]", item) for i, item in enumerate(value)]


def _messages(
    where: str, value: Any, last_role: str | None = "assistant", key: str = "messages"
) -> list[dict[str, str]]:
    """Field ``key``'s chat messages; the last one's role must be ``last_role`` (None: any)."""
    messages = []
    for name, message in _objects(where, key, value, '{"role", "content"}'):
        role = _string(where, message, "role", f"in '{name}'")
        content = _string(where, message, "content", f"in '{name}'")
        if role not in ROLES:
            raise DataError(f"{where}: field '{name}.role' must be one of {', '.join(ROLES)}, got {role!r}")
        messages.append({"role": role, "content": content})
    if last_role is not None and messages[-1]["role"] != last_role:
        why = "the reply to train on" if last_role == "assistant" else "the turn the policy answers"
        raise DataError(
            f"{where}: field '{key}[{len(messages) - 1}].role' must be {last_role!r} "
            f"(the last message is {why}), got {messages[-1]['role']!r}"
        )
    return messages


def _segments(where: str, obj: dict[str, Any]) -> list[tuple[str, bool]]:
    others = [key for key in ("prompt", "completion", "messages") if key in obj]
    if others:
        formats = "(prompt and completion, messages, or segments)"
        raise DataError(f"{where}: field '{others[0]}' given together with 'segments'; use one format {formats}")
    segments = []
    for name, segment in _objects(where, "segments", obj["segments"], '{"text", "model"}'):
        text = _string(where, segment, "text", f"in '{name}'")
        model = segment.get("model")
        if not isinstance(model, bool):
            raise DataError(f"{where}: field '{name}.model' must be true or false, got {_type_name(model)}")
        segments.append((text, model))
    if not any(model and text for text, model in segments):
        raise DataError(
            f"{where}: field 'segments' has no non-empty segment with \"model\": true (nothing to train on)"
        )
    return segments


def read_sft_jsonl(path: str | os.PathLike[str], max_line_bytes: int = MAX_LINE_BYTES) -> list[SFTRecord]:
    """SFT records from ``{"prompt", "completion"}``, ``{"messages"}`` or ``{"segments"}`` lines (may be mixed)."""
    records = []
    for where, obj in _read_objects(path, max_line_bytes):
        if "segments" in obj:
            records.append(SFTRecord(segments=_segments(where, obj), where=where))
        elif "messages" in obj:
            both = [key for key in ("prompt", "completion") if key in obj]
            if both:
                raise DataError(
                    f"{where}: field '{both[0]}' given together with 'messages'; use one format {_SFT_FORMATS}"
                )
            records.append(SFTRecord(messages=_messages(where, obj["messages"]), where=where))
        elif isinstance(obj.get("prompt"), list):
            records.append(SFTRecord(messages=_conversation(where, obj), where=where))
        else:
            prompt = _string(where, obj, "prompt", _SFT_FORMATS)
            completion = _string(where, obj, "completion", _SFT_FORMATS)
            records.append(SFTRecord(prompt=prompt, completion=completion, where=where))
    return records


def _conversation(where: str, obj: dict[str, Any]) -> list[dict[str, str]]:
    """TRL's conversational prompt-completion line as one conversation: ``prompt`` messages (ending with the user's
    turn) then ``completion``, the assistant's reply as a one-message list."""
    prompt = _messages(where, obj["prompt"], last_role="user", key="prompt")
    if "completion" not in obj:
        raise DataError(f"{where}: missing field 'completion' {_SFT_FORMATS}")
    completion = obj["completion"]
    if not isinstance(completion, list):
        raise DataError(
            f"{where}: field 'completion' must be a list of messages when 'prompt' is one (TRL's conversational "
            f'form: [{{"role": "assistant", "content": ...}}]), got {_type_name(completion)}'
        )
    completion = _messages(where, completion, key="completion")
    if len(completion) != 1:
        raise DataError(f"{where}: field 'completion' must hold one assistant message, got {len(completion)}")
    return prompt + completion


def read_rl_jsonl(
    path: str | os.PathLike[str], max_line_bytes: int = MAX_LINE_BYTES, require_answer: bool = True
) -> list[RLRecord]:
    """RL records from ``{"prompt", "answer"}`` or ``{"messages", "answer"}`` lines (the messages end with the
    user's turn); an integer answer is kept as its decimal text. The other fields of each line are kept in
    ``columns``. ``require_answer=False`` (a reward that reads other columns): a line without a text or integer
    answer gets ``""``."""
    expected = '(expected {"prompt", "answer"} or {"messages", "answer"})'
    records = []
    for where, obj in _read_objects(path, max_line_bytes):
        messages = None
        if "messages" in obj:
            if "prompt" in obj:
                raise DataError(f"{where}: field 'prompt' given together with 'messages'; use one format {expected}")
            messages, prompt = _messages(where, obj["messages"], last_role="user"), None
        elif isinstance(obj.get("prompt"), list):  # TRL's conversational form: the prompt is the messages
            messages, prompt = _messages(where, obj["prompt"], last_role="user", key="prompt"), None
        else:
            prompt = _string(where, obj, "prompt", expected)
        if "answer" not in obj and require_answer:
            raise DataError(f"{where}: missing field 'answer' {expected}")
        answer = obj.get("answer", "")
        # bool is an int subclass in Python, but `true` is no answer to a prompt.
        if isinstance(answer, int) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str) and not require_answer:
            answer = ""  # a column the reward reads as it is (kept in columns), not the text answer
        if not isinstance(answer, str):
            raise DataError(f"{where}: field 'answer' must be a string or an integer, got {_type_name(answer)}")
        columns = {k: v for k, v in obj.items() if k not in ("prompt", "messages")}
        answer = _text(where, "answer", answer)
        records.append(RLRecord(prompt=prompt, answer=answer, messages=messages, where=where, columns=columns))
    return records


def read_preference_jsonl(path: str | os.PathLike[str], max_line_bytes: int = MAX_LINE_BYTES) -> list[PreferenceRecord]:
    """Preference pairs from ``{"prompt", "chosen", "rejected"}`` lines."""
    expected = '(expected {"prompt", "chosen", "rejected"})'
    records = []
    for where, obj in _read_objects(path, max_line_bytes):
        prompt, chosen, rejected = (_string(where, obj, key, expected) for key in ("prompt", "chosen", "rejected"))
        for key, value in (("chosen", chosen), ("rejected", rejected)):
            if not value.strip():
                raise DataError(f"{where}: field '{key}' is empty (a preference pair needs two completions)")
        if chosen == rejected:
            raise DataError(f"{where}: fields 'chosen' and 'rejected' are the same text (the pair prefers nothing)")
        records.append(PreferenceRecord(prompt=prompt, chosen=chosen, rejected=rejected, where=where))
    return records


def check_integer_answers(records: list[RLRecord]) -> None:
    """The built-in reward compares integers: a :class:`DataError` at the first answer that is not one."""
    for r in records:
        try:
            canonical_integer(r.answer)
        except ValueError:
            shown = r.answer if len(r.answer) <= 40 else r.answer[:40] + f"... ({len(r.answer)} characters)"
            raise DataError(
                f"{r.where}: field 'answer' must be an integer for --reward task (exact match of the final integer), "
                f"got {shown!r}; give --reward module:function for other answers"
            ) from None


def describe_skipped(locations: list[str], what: str, why: str, num_shown: int = 5) -> str:
    """One line counting the records left out and naming where the first ``num_shown`` are (``path:line``)."""
    shown = ", ".join(locations[:num_shown]) + (
        f" and {len(locations) - num_shown} more" if len(locations) > num_shown else ""
    )
    return f"skipped {len(locations)} {what} that {why}: {shown}"


def write_jsonl(path: str | os.PathLike[str], rows: Iterable[dict[str, Any]]) -> None:
    """Write one JSON object per line (UTF-8, non-ASCII kept as is), replacing ``path``."""
    with Path(path).open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
