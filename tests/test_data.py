"""JSONL readers: records read back as written, each malformed line reported as ``path:line: ...``, samples read."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from spinwheel.tasks import (
    SAMPLES_DIR,
    DataError,
    PreferenceRecord,
    RLRecord,
    SFTRecord,
    read_preference_jsonl,
    read_rl_jsonl,
    read_sft_jsonl,
    reward,
    write_jsonl,
)

READERS = {"sft": read_sft_jsonl, "rl": read_rl_jsonl, "preferences": read_preference_jsonl}


def write_lines(tmp_path: Path, lines: list[str], name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def raises_at(path: Path, line: int, message: str):
    """Expect a DataError whose message is exactly ``path:line: message``."""
    return pytest.raises(DataError, match="^" + re.escape(f"{path}:{line}: {message}") + "$")


# --- reading valid files --------------------------------------------------------------------------------------


def test_sft_reads_both_formats_and_skips_blank_lines(tmp_path):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4", "name": "bot"},
    ]
    path = write_lines(
        tmp_path,
        [
            json.dumps({"prompt": "1+1=", "completion": "2", "source": "unit test"}),
            "",
            "   ",
            json.dumps({"messages": chat}),
        ],
    )
    assert read_sft_jsonl(path) == [
        SFTRecord(prompt="1+1=", completion="2"),
        # Extra keys are ignored, also inside messages.
        SFTRecord(
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "2+2="},
                {"role": "assistant", "content": "4"},
            ]
        ),
    ]


def test_rl_converts_integer_answers_to_text(tmp_path):
    path = write_lines(
        tmp_path,
        [
            json.dumps({"prompt": "3-15=", "answer": -12}),
            json.dumps({"prompt": "1+1=", "answer": "2", "difficulty": 1}),
        ],
    )
    assert read_rl_jsonl(path) == [RLRecord("3-15=", "-12"), RLRecord("1+1=", "2")]


def test_rl_reads_messages_lines(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    path = write_lines(
        tmp_path, [json.dumps({"messages": chat, "answer": 4}), json.dumps({"prompt": "1+1=", "answer": "2"})]
    )
    assert read_rl_jsonl(path) == [RLRecord(None, "4", messages=chat), RLRecord("1+1=", "2")]


def test_preferences_read(tmp_path):
    path = write_lines(tmp_path, [json.dumps({"prompt": "7*8=", "chosen": "56", "rejected": "54"})])
    assert read_preference_jsonl(path) == [PreferenceRecord("7*8=", "56", "54")]


def test_write_jsonl_round_trips_unicode(tmp_path):
    rows = [{"prompt": "½+½=", "answer": "1"}, {"prompt": "2+2=", "answer": 4}]
    path = tmp_path / "out.jsonl"
    write_jsonl(path, rows)
    assert path.read_text(encoding="utf-8").splitlines()[0] == '{"prompt": "½+½=", "answer": "1"}'
    assert read_rl_jsonl(path) == [RLRecord("½+½=", "1"), RLRecord("2+2=", "4")]


def test_leading_byte_order_mark_is_ignored(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "1+1=", "answer": 2}\n')
    assert read_rl_jsonl(path) == [RLRecord("1+1=", "2")]


def test_reader_accepts_str_paths(tmp_path):
    path = write_lines(tmp_path, [json.dumps({"prompt": "1+1=", "answer": 2})])
    assert read_rl_jsonl(str(path)) == [RLRecord("1+1=", "2")]


# --- malformed files ---------------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="data file not found: .*nope.jsonl"):
        read_sft_jsonl(tmp_path / "nope.jsonl")


def test_directory_is_not_a_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a file"):
        read_sft_jsonl(tmp_path)


@pytest.mark.parametrize("reader", READERS.values())
@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path, reader, content):
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=f"^{re.escape(str(path))}: no records"):
        reader(path)


def test_invalid_json(tmp_path):
    good = json.dumps({"prompt": "1+1=", "completion": "2"})
    path = write_lines(tmp_path, [good, "", good, good, good, good, '{"prompt": "1+1=" "completion": "2"}'])
    with raises_at(path, 7, "invalid JSON (Expecting ',' delimiter at column 19)"):
        read_sft_jsonl(path)


def test_invalid_utf8(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match=f"^{re.escape(str(path))}:2: not valid UTF-8"):
        read_rl_jsonl(path)


@pytest.mark.parametrize(
    "line, message",
    [
        ("[1, 2]", "expected a JSON object, got list"),
        ('"text"', "expected a JSON object, got string"),
        ('{"completion": "2"}', """missing field 'prompt' (expected {"prompt", "completion"} or {"messages"})"""),
        ('{"prompt": "1+1="}', """missing field 'completion' (expected {"prompt", "completion"} or {"messages"})"""),
        ('{"prompt": "1+1=", "completion": 2}', "field 'completion' must be a string, got int"),
        ('{"prompt": null, "completion": "2"}', "field 'prompt' must be a string, got null"),
        (
            '{"prompt": "1+1=", "messages": []}',
            """field 'prompt' given together with 'messages'; use one format (expected {"prompt", "completion"} or """
            """{"messages"})""",
        ),
        ('{"messages": []}', """field 'messages' must be a non-empty list of {"role", "content"}, got an empty list"""),
        (
            '{"messages": {"role": "user"}}',
            """field 'messages' must be a non-empty list of {"role", "content"}, got object""",
        ),
        ('{"messages": ["hi"]}', "field 'messages[0]' must be an object, got string"),
        ('{"messages": [{"content": "2"}]}', "missing field 'role' in 'messages[0]'"),
        (
            '{"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant"}]}',
            "missing field 'content' in 'messages[1]'",
        ),
        ('{"messages": [{"role": "assistant", "content": 2}]}', "field 'content' must be a string, got int"),
        (
            '{"messages": [{"role": "bot", "content": "2"}]}',
            "field 'messages[0].role' must be one of system, user, assistant, got 'bot'",
        ),
        (
            '{"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "1+1="}]}',
            "field 'messages[1].role' must be 'assistant' (the last message is the reply to train on), got 'user'",
        ),
    ],
)
def test_sft_malformed_line(tmp_path, line, message):
    path = write_lines(tmp_path, [json.dumps({"prompt": "1+1=", "completion": "2"}), "", line])
    with raises_at(path, 3, message):
        read_sft_jsonl(path)


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"answer": "2"}', """missing field 'prompt' (expected {"prompt", "answer"} or {"messages", "answer"})"""),
        ('{"prompt": "1+1="}', """missing field 'answer' (expected {"prompt", "answer"} or {"messages", "answer"})"""),
        (
            '{"messages": [{"role": "user", "content": "1+1="}], "prompt": "1+1=", "answer": "2"}',
            "field 'prompt' given together with 'messages'; use one format "
            '(expected {"prompt", "answer"} or {"messages", "answer"})',
        ),
        (
            '{"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}], "answer": "2"}',
            "field 'messages[1].role' must be 'user' (the last message is the turn the policy answers), "
            "got 'assistant'",
        ),
        (
            '{"messages": [], "answer": "2"}',
            """field 'messages' must be a non-empty list of {"role", "content"}, got an empty list""",
        ),
        ('{"prompt": 11, "answer": "2"}', "field 'prompt' must be a string, got int"),
        ('{"prompt": "1/2=", "answer": 0.5}', "field 'answer' must be a string or an integer, got float"),
        ('{"prompt": "1=1?", "answer": true}', "field 'answer' must be a string or an integer, got bool"),
        ('{"prompt": "1+1=", "answer": [2]}', "field 'answer' must be a string or an integer, got list"),
    ],
)
def test_rl_malformed_line(tmp_path, line, message):
    path = write_lines(tmp_path, [json.dumps({"prompt": "1+1=", "answer": 2}), line])
    with raises_at(path, 2, message):
        read_rl_jsonl(path)


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"chosen": "2", "rejected": "3"}', """missing field 'prompt' (expected {"prompt", "chosen", "rejected"})"""),
        (
            '{"prompt": "1+1=", "rejected": "3"}',
            """missing field 'chosen' (expected {"prompt", "chosen", "rejected"})""",
        ),
        (
            '{"prompt": "1+1=", "chosen": "2"}',
            """missing field 'rejected' (expected {"prompt", "chosen", "rejected"})""",
        ),
        ('{"prompt": "1+1=", "chosen": "2", "rejected": 3}', "field 'rejected' must be a string, got int"),
    ],
)
def test_preference_malformed_line(tmp_path, line, message):
    path = write_lines(tmp_path, [line])
    with raises_at(path, 1, message):
        read_preference_jsonl(path)


def test_data_error_is_a_value_error_on_one_line(tmp_path):
    path = write_lines(tmp_path, ['{"prompt": "1+1=", "completion": 2}'])
    with pytest.raises(ValueError) as info:
        read_sft_jsonl(path)
    assert isinstance(info.value, DataError) and "\n" not in str(info.value)


def test_sft_record_validates_its_own_shape():
    with pytest.raises(ValueError, match="prompt and completion, or messages"):
        SFTRecord(prompt="1+1=")
    with pytest.raises(ValueError, match="not both"):
        SFTRecord(prompt="1+1=", completion="2", messages=[{"role": "assistant", "content": "2"}])
    with pytest.raises(ValueError, match="end with an assistant message"):
        SFTRecord(messages=[{"role": "user", "content": "1+1="}])


# --- shipped samples ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", READERS)
def test_sample_files_read(name):
    records = READERS[name](SAMPLES_DIR / f"{name}.jsonl")
    assert 5 <= len(records) <= 10


def test_sample_answers_are_correct():
    # Arithmetic-flavoured samples: the arithmetic reward agrees with each answer, completion and chosen reply.
    for r in read_rl_jsonl(SAMPLES_DIR / "rl.jsonl"):
        assert r.answer == str(eval(r.prompt[:-1])), r  # noqa: S307
    for p in read_preference_jsonl(SAMPLES_DIR / "preferences.jsonl"):
        answer = str(eval(p.prompt[:-1]))  # noqa: S307
        assert reward(p.chosen, answer) == 1.0 and reward(p.rejected, answer) == 0.0, p
    sft = read_sft_jsonl(SAMPLES_DIR / "sft.jsonl")
    plain = [r for r in sft if r.messages is None]
    assert plain and all(r.completion == str(eval(r.prompt[:-1])) for r in plain)  # noqa: S307
    assert any(r.messages is not None for r in sft)
