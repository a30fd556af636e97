"""The dataset environment (a user's RL JSONL with TRL-style or (completions, answers) rewards, batch scoring) and
SFT on environment traces (the segments format: tokens, loss mask, a short run that learns, the expert command)."""

from __future__ import annotations

import json

import pytest
import torch

from spinwheel.envs import Action, load_env, step_batch
from spinwheel.envs.dataset import is_trl_style
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.rl.llm.rewards import RewardError
from spinwheel.tasks.data import DataError, read_sft_jsonl
from spinwheel.train.sft.sft import train_sft
from spinwheel.train.sft.sft_config import SFTConfig
from spinwheel.train.sft.sft_data import build_data, collate

REWARDS = """
calls = []

def trl(prompts, completions, difficulty, **kwargs):
    calls.append(dict(prompts=prompts, completions=completions, difficulty=difficulty, **kwargs))
    return [float(len(c if isinstance(c, str) else c[0]["content"])) * d for c, d in zip(completions, difficulty)]

def trl_named(prompts, completions, answer):
    calls.append(dict(answer=answer))
    return [1.0] * len(completions)

def classic(completions, answers):
    calls.append(dict(answers=answers))
    return [float(c == a) for c, a in zip(completions, answers)]

def nan(prompts, completions, **kw):
    return [float("nan")] * len(completions)
"""


@pytest.fixture
def data(tmp_path, monkeypatch):
    (tmp_path / "rewards_t23.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    chat = [{"role": "user", "content": "3+3="}]
    rows = [{"prompt": f"{i}+1=", "answer": i + 1, "difficulty": i + 1, "tag": f"t{i}"} for i in range(9)]
    rows.append({"messages": chat, "answer": "6", "difficulty": 2})
    path = tmp_path / "rl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def episodes(make, split: str, seeds) -> list:
    envs = [make(split) for _ in seeds]
    return envs, [env.reset(s) for env, s in zip(envs, seeds)]


def test_trl_style_reward_gets_the_columns_in_one_call(data):
    import rewards_t23

    assert is_trl_style(rewards_t23.trl) and not is_trl_style(rewards_t23.classic)
    make = load_env("dataset", [f"data={data}", "reward=rewards_t23:trl", "eval_fraction=0.2", "seed=1"])
    envs, observations = episodes(make, "train", range(8))
    rewards_t23.calls.clear()
    steps = step_batch(envs, [Action("ab", [])] * 8)
    (call,) = rewards_t23.calls  # the whole batch in one call
    chat = [i for i, o in enumerate(observations) if isinstance(o, list)]
    assert call["prompts"] == observations and set(call) == {"prompts", "completions", "difficulty", "answer", "tag"}
    assert [c for i, c in enumerate(call["completions"]) if i in chat] == [[{"role": "assistant", "content": "ab"}]]
    assert all(call["completions"][i] == "ab" for i in range(8) if i not in chat)
    assert [s.reward for s in steps] == [2.0 * d for d in call["difficulty"]] and all(s.done for s in steps)
    assert call["tag"][chat[0]] is None if chat else True  # a line without the field: None
    assert len(make("test").records) == 2 and len(make("train").records) == 8


def test_named_columns_and_the_classic_form(data):
    import rewards_t23

    make = load_env("dataset", [f"data={data}", "reward=rewards_t23:trl_named"])
    env = make("train")
    env.reset(0)
    rewards_t23.calls.clear()
    env.step(Action("x", []))
    assert list(rewards_t23.calls[0]) == ["answer"]  # only the fields it names, the JSONL's value as read
    make = load_env("dataset", [f"data={data}", "reward=rewards_t23:classic"])
    envs, _ = episodes(make, "train", [0, 1])
    answers = [e.example.answer for e in envs]
    steps = step_batch(envs, [Action(answers[0], []), Action("no", [])])
    assert [s.reward for s in steps] == [1.0, 0.0] and rewards_t23.calls[-1] == {"answers": answers}
    task = load_env("dataset", [f"data={data}"])("train")  # reward=task: the arithmetic task's integer match
    task.reset(2)
    assert task.step(Action(f"it is {task.example.answer}", [])).reward == 1.0


def test_bad_rewards_are_one_line_errors(data):
    env = load_env("dataset", [f"data={data}", "reward=rewards_t23:nan"])("train")
    env.reset(0)
    with pytest.raises(RewardError, match="rewards_t23:nan returned nan at index 0: a non-finite reward"):
        env.step(Action("x", []))


SEGMENTS = [("7*8=", False), ("<calc>7*8</calc>", True), ("=56\n", False), ("56", True), ("=?", False)]


def test_segments_record_tokens_and_mask(tmp_path):
    path = tmp_path / "traces.jsonl"
    row = {"segments": [{"text": t, "model": m} for t, m in SEGMENTS], "seed": 3}
    path.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    assert read_sft_jsonl(path)[0].segments == SEGMENTS
    tok = Tokenizer.char_level()
    cfg = SFTConfig(model="test", data=str(path), eval_fraction=0.5, progress=False)
    data = build_data(cfg, tok)
    (ex,) = data.train
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert ex.prompt == "7*8=" and list(ex.prompt_ids) == [tok.bos_id, *enc("7*8=")]
    # each segment on its own, EOS after the last model segment; the trailing environment segment is dropped
    assert list(ex.completion_ids) == enc("<calc>7*8</calc>") + enc("=56\n") + enc("56") + [tok.eos_id]
    assert ex.completion_mask == (1.0,) * 16 + (0.0,) * 4 + (1.0,) * 3
    batch = collate([ex], tok.pad_id)
    assert batch["loss_mask"][0].tolist() == [0.0] * 4 + list(ex.completion_mask)
    assert data.score("<calc>7*8</calc>=56\n57", "<calc>7*8</calc>") == 1.0  # held out: the first turn
    assert data.score("<calc>7*9</calc>", "<calc>7*8</calc>") == 0.0


@pytest.mark.parametrize(
    "segments, message",
    [
        ([], "field 'segments' must be a non-empty list"),
        ([{"text": "a", "model": 1}], "field 'segments[0].model' must be true or false, got int"),
        ([{"text": "a", "model": False}], "field 'segments' has no non-empty segment with \"model\": true"),
    ],
)
def test_bad_segments_lines(tmp_path, segments, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"segments": segments}) + "\n")
    with pytest.raises(DataError) as info:
        read_sft_jsonl(path)
    assert str(info.value).startswith(f"{path}:1: {message}")


def test_sft_on_calculator_expert_traces_lowers_the_loss(tmp_path):
    from spinwheel.cli import main

    traces = tmp_path / "traces.jsonl"
    args = ["envs", "expert", "--env", "calculator", "--env-arg", "left_digits=2", "right_digits=1"]
    assert main([*args, "--num", "64", "--out", str(traces)]) == 0
    first = json.loads(traces.read_text().splitlines()[0])
    assert first["reward"] == 1.0 and [s["model"] for s in first["segments"]] == [False, True, False, True]
    torch.manual_seed(0)
    cfg = SFTConfig(
        model="test", data=str(traces), out_dir=str(tmp_path / "run"), steps=20, batch_size=16, lr=1e-2,
        warmup_steps=2, eval_every=0, save_every=0, progress=False, eval_fraction=0.1, max_new_tokens=20,
        eval_examples=4, eval_engine=False,
    )  # fmt: skip
    result = train_sft(cfg)
    assert result["losses"][-1] < 0.6 * result["losses"][0]
