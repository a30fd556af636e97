"""Bounded data: every reader caps a line's bytes before parsing it, reports hostile lines (lone surrogates, deep
nesting, huge numbers) as ``path:line: ...``, and every command's data leaves out — counted, with ``path:line`` —
records that cannot fit the model's context with the completion budget."""

from __future__ import annotations

import json
import re
import tracemalloc
from pathlib import Path

import pytest

from spinwheel.models.tokenizer import Tokenizer, load_tokenizer
from spinwheel.preference.preference_data import pairs_from_jsonl
from spinwheel.rl.llm.build import load_prompts
from spinwheel.rl.llm.config import RLConfig
from spinwheel.tasks.data import (
    MAX_LINE_BYTES,
    DataError,
    read_preference_jsonl,
    read_rl_jsonl,
    read_sft_jsonl,
)
from spinwheel.train.sft.sft_config import SFTConfig
from spinwheel.train.sft.sft_data import build_data

READERS = [read_sft_jsonl, read_rl_jsonl, read_preference_jsonl]
SFT_LINE = json.dumps({"prompt": "1+1=", "completion": "2"})
RL_LINE = json.dumps({"prompt": "1+1=", "answer": 2})


def write_lines(tmp_path: Path, lines: list[str], end: str = "\n") -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + end, encoding="utf-8")
    return path


def raises_at(path: Path, line: int, message: str):
    return pytest.raises(DataError, match="^" + re.escape(f"{path}:{line}: {message}"))


# --- the byte cap on a line ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("end", ["\n", ""])  # the long line ends with a newline, or with the file
@pytest.mark.parametrize("reader", READERS)
def test_a_line_past_the_cap_is_one_error(tmp_path, reader, end):
    line = json.dumps({"prompt": "x" * 200, "completion": "y"})
    path = write_lines(tmp_path, ["", line], end)
    with raises_at(path, 2, "line longer than 100 bytes"):
        reader(path, max_line_bytes=100)


@pytest.mark.parametrize("end", ["\n", ""])
def test_a_line_of_exactly_the_cap_is_read(tmp_path, end):
    path = write_lines(tmp_path, [SFT_LINE, SFT_LINE], end)
    assert len(read_sft_jsonl(path, max_line_bytes=len(SFT_LINE))) == 2
    with raises_at(path, 1, f"line longer than {len(SFT_LINE) - 1} bytes"):
        read_sft_jsonl(path, max_line_bytes=len(SFT_LINE) - 1)


def test_a_huge_line_is_never_read_whole(tmp_path):
    """20 MB on one line: the reader stops after the cap, so it allocates a few MB at most, not the line."""
    path = tmp_path / "data.jsonl"
    path.write_text(SFT_LINE + "\n" + '{"prompt": "' + "x" * 20_000_000 + '", "completion": "2"}\n')
    tracemalloc.start()
    try:
        with raises_at(path, 2, f"line longer than {MAX_LINE_BYTES} bytes"):
            read_sft_jsonl(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * MAX_LINE_BYTES


# --- hostile lines ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "reader, line, message",
    [
        (read_sft_jsonl, '{"prompt": "\\ud800", "completion": "2"}', "field 'prompt' holds a lone surrogate"),
        (read_rl_jsonl, '{"prompt": "1+1=", "answer": "x\\udfff"}', "field 'answer' holds a lone surrogate"),
        (
            read_sft_jsonl,
            '{"messages": [{"role": "assistant", "content": "ok \\udc00"}]}',
            "field 'content' holds a lone surrogate",
        ),
        (read_preference_jsonl, '{"prompt": "p", "chosen": "\\ud800", "rejected": "b"}', "field 'chosen' holds"),
        (read_sft_jsonl, '{"prompt": ' + "[" * 10_000 + "]" * 10_000 + "}", "invalid JSON (nested too deeply"),
        (read_rl_jsonl, '{"prompt": "1+1=", "answer": ' + "1" * 5000 + "}", "invalid JSON (a number of more than"),
    ],
)
def test_hostile_lines_are_one_line_errors_with_their_location(tmp_path, reader, line, message):
    good = {read_sft_jsonl: SFT_LINE, read_rl_jsonl: RL_LINE}.get(
        reader, '{"prompt": "p", "chosen": "a", "rejected": "b"}'
    )
    path = write_lines(tmp_path, [good, line])
    with raises_at(path, 2, message) as error:
        reader(path)
    assert "\n" not in str(error.value)


def test_a_lone_surrogate_names_its_position(tmp_path):
    path = write_lines(tmp_path, ['{"prompt": "ab\\ud800", "completion": "2"}'])
    with raises_at(path, 1, "field 'prompt' holds a lone surrogate (\\ud800 at character 2); text must be valid"):
        read_sft_jsonl(path)


# --- RL prompts ---------------------------------------------------------------------------------------------------


def rl_config(tmp_path: Path, lines: list[str], **kwargs) -> RLConfig:
    return RLConfig(data=str(write_lines(tmp_path, lines)), max_new_tokens=8, **kwargs)


def test_rl_prompts_that_do_not_fit_the_context_are_skipped_and_counted(tmp_path):
    lines = [json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) for i in range(4)]
    lines[2] = json.dumps({"prompt": "9" * 600 + "+1=", "answer": 1})
    config, logged = rl_config(tmp_path, lines), []
    train, held_out = load_prompts(config, load_tokenizer("test"), max_context=256, log=logged.append)
    assert len(train) + len(held_out) == 3
    assert all(len(p.ids) + 8 <= 256 for p in train + held_out)
    assert logged == [
        f"{config.data}: skipped 1 prompts that do not fit the model's context of 256 tokens with --max-new-tokens 8: "
        f"{config.data}:3 (604 tokens)"
    ]


def test_rl_prompt_that_fills_the_context_exactly_is_kept(tmp_path):
    tok = load_tokenizer("test")
    prompt = "1" * 10 + "="
    config = rl_config(tmp_path, [json.dumps({"prompt": prompt, "answer": 1})] * 2)
    room = len(tok.encode(prompt)) + 8
    assert len(sum(load_prompts(config, tok, max_context=room), [])) == 2
    with pytest.raises(DataError, match="0 usable prompt"):
        load_prompts(config, tok, max_context=room - 1, log=lambda _: None)


def test_rl_data_of_one_line_is_an_error(tmp_path):
    config = rl_config(tmp_path, [RL_LINE])
    with pytest.raises(DataError, match=re.escape(f"{config.data}: 1 usable prompt(s); RL needs at least 2")):
        load_prompts(config, load_tokenizer("test"))


def test_rl_answers_are_integers_for_the_task_reward(tmp_path):
    lines = [RL_LINE, json.dumps({"prompt": "capital of France?", "answer": "Paris"})]
    config = rl_config(tmp_path, lines)
    with raises_at(Path(config.data), 2, "field 'answer' must be an integer for --reward task"):
        load_prompts(config, load_tokenizer("test"))
    assert len(sum(load_prompts(rl_config(tmp_path, lines, reward="mod:fn"), load_tokenizer("test")), [])) == 2
    long = [RL_LINE, json.dumps({"prompt": "1+1=", "answer": "1" * 5000})]  # a string: past int()'s limit, still fine
    assert len(sum(load_prompts(rl_config(tmp_path, long), load_tokenizer("test")), [])) == 2


# --- SFT examples and preference pairs ----------------------------------------------------------------------------


def test_sft_examples_that_do_not_fit_the_context_are_dropped_with_their_location(tmp_path):
    lines = [json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) for i in range(6)]
    lines[1] = json.dumps({"prompt": "1" * 50 + "=", "completion": "1"})  # fits --max-seq-len, not the context
    path = write_lines(tmp_path, lines)
    config = SFTConfig(data=str(path), max_seq_len=256, max_new_tokens=16, eval_fraction=0.2)
    data = build_data(config, Tokenizer.char_level(), max_context=60)
    assert data.num_dropped == 1 and len(data.train) + len(data.eval) == 5
    assert data.dropped_message.startswith("dropped 1 examples longer than --max-seq-len 256 or not fitting")
    assert data.dropped_message.endswith(f"{path}:2 (52 + 2 tokens)")
    assert build_data(config, Tokenizer.char_level()).num_dropped == 0  # without the model's context: kept


def test_preference_pairs_longer_than_the_context_are_dropped_with_their_location(tmp_path):
    lines = [json.dumps({"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": "0"}) for i in range(1, 4)]
    lines[0] = json.dumps({"prompt": "1" * 40 + "=", "chosen": "1", "rejected": "0"})
    path, logged = write_lines(tmp_path, lines), []
    tok = Tokenizer.char_level()
    pairs, dropped = pairs_from_jsonl(path, tok, add_eos=True, max_seq_len=256, max_context=30, log=logged.append)
    assert (len(pairs), dropped) == (2, 1)
    assert logged == [
        f"{path}: skipped 1 pairs that are longer than --max-seq-len 256 or the model's context of 30: "
        f"{path}:1 (44 tokens)"
    ]
    assert pairs_from_jsonl(path, tok, add_eos=True, max_seq_len=256)[1] == 0
