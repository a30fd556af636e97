"""``spinwheel demo --agent`` (issue 23's agent story) with tiny step counts: what it prints (three stages, held-out
success before/after, the tool share of the correct episodes, two transcripts) and writes (``<out-dir>/agent/``
only; the main demo's directories beside it are left alone); the tool-shy expert's traces replay through
``calculator``."""

import re

from spinwheel import agent_demo, demo
from spinwheel.agent_demo import ToolShyCalculator
from spinwheel.cli import main
from spinwheel.envs.calculator import CalculatorEnv
from spinwheel.envs.expert import expert_rows


def test_agent_demo_prints_the_story_and_writes_only_agent(tmp_path, capsys):
    out = tmp_path / "demo"
    out.mkdir()
    assert agent_demo.MARKER == demo.MARKER
    (out / demo.MARKER).write_text("{}\n")  # a previous main demo's directory
    (out / "grpo").mkdir()
    (out / "grpo" / "kept.txt").write_text("the main demo's")
    args = ["demo", "--agent", "--out-dir", str(out), "--agent-sft-steps", "2", "--agent-grpo-steps", "1"]
    assert main([*args, "--eval-examples", "3", "--no-progress", "--num-threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    stages = [line for line in lines if line.startswith("spinwheel demo --agent: ")]
    assert [s.split()[3] for s in stages] == ["1/3", "2/3", "3/3"]
    assert "2 steps" in stages[1] and "1 steps of 16 problems × 8 episodes" in stages[2]
    (success,) = [line for line in lines if line.startswith("held-out task success")]
    assert re.fullmatch(r".*\(3 problems .*\): after SFT \d+\.\d% -> after GRPO \d+\.\d%", success)
    (tool,) = [line for line in lines if line.startswith("episodes that called the tool: ")]
    share = r"(\d+%|-- \(none correct\))"
    assert re.fullmatch(rf".*: \d+% -> \d+%; correct episodes that called the tool: {share} -> {share}", tool)
    at = lines.index(next(line for line in lines if line.startswith("two held-out problems")))
    transcripts = lines[at + 1 : at + 5]
    assert [t[:14] for t in transcripts] == ["  after SFT   ", "  after GRPO  "] * 2
    assert all(re.fullmatch(r"\d{3}\*\d{2}=.* (ok|WRONG)", t[14:]) for t in transcripts), transcripts
    assert transcripts[0][14:21] == transcripts[1][14:21]  # the same problem before and after
    assert lines[at + 5].startswith("wrote ") and lines[at + 5].endswith("s")
    assert (out / "grpo" / "kept.txt").read_text() == "the main demo's"
    for name in ("agent/traces.jsonl", "agent/sft/checkpoint", "agent/grpo/checkpoint", "agent/grpo/metrics.jsonl"):
        assert (out / name).exists(), name


def test_agent_demo_never_deletes_a_directory_it_did_not_write(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["demo", "--agent", "--out-dir", str(tmp_path), "--agent-sft-steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not written by spinwheel demo" in err and "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_tool_shy_expert_answers_small_factors_in_its_head_and_replays():
    env = ToolShyCalculator("train")
    rows = expert_rows(ToolShyCalculator, "tool-shy", 300)
    assert all(r["reward"] == 1.0 for r in rows)  # replayed through the environment: every answer is right
    direct = [r for r in rows if len(r["segments"]) == 2]
    assert all(
        len(r["segments"]) == 4 and r["segments"][1]["text"].startswith("<calc>") for r in rows if r not in direct
    )
    assert all(re.fullmatch(r"\d+", r["segments"][1]["text"]) for r in direct)
    small = [r for r in rows if env.problem(r["seed"])[1] < 50]
    assert all(env.problem(r["seed"])[1] < 50 for r in direct) and 0.8 * len(small) <= len(direct) < len(small)
    every = expert_rows(lambda split: ToolShyCalculator(split, tool_rate=1), "tool-shy", 20)
    assert [r["segments"] for r in every] == [r["segments"] for r in expert_rows(CalculatorEnv, "calculator", 20)]
