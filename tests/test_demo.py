"""``spinwheel demo``: one thread unless ``--num-threads`` says otherwise, so that a seed's run repeats exactly (a
count fitted to the machine's load, :mod:`spinwheel.threads`, rounds each run differently under load); the
``--agent`` and ``--real`` stories keep PyTorch's count."""

from __future__ import annotations

import pytest
from helpers import run_cli

from spinwheel import demo
from spinwheel.demo import DemoConfig
from spinwheel.train.metrics import read_metrics

TINY = ["--sft-steps", "6", "--sft-check-every", "3", "--sft-target", "1", "--grpo-steps", "3"]
TINY += ["--grpo-eval-every", "3", "--grpo-prompts", "2", "--eval-examples", "8", "--no-progress"]


@pytest.mark.slow
def test_demo_runs_on_one_thread_and_a_seed_repeats_exactly(tmp_path, capfd, monkeypatch):
    seen = []
    story = demo._main_story
    monkeypatch.setattr(demo, "_main_story", lambda config, out: seen.append(config.num_threads) or story(config, out))
    runs = []
    for name in ("a", "b"):
        proc = run_cli(["demo", "--out-dir", str(tmp_path / name), "--seed", "3", *TINY], capfd)
        assert proc.returncode == 0, proc.stderr
        runs.append({stage: read_metrics(tmp_path / name / stage / "metrics.jsonl") for stage in ("sft", "grpo")})
    assert seen == [1, 1]  # the default: one thread
    for stage in ("sft", "grpo"):
        a, b = ([{k: v for k, v in r.items() if not k.startswith(("time/", "rss_")) and "per_s" not in k} for r in
                 run[stage]] for run in runs)  # fmt: skip
        assert len(a) > 3 and a == b  # every loss, reward, gradient norm and held-out figure, bit for bit


@pytest.mark.parametrize(
    ("argv", "threads"), [([], 1), (["--num-threads", "0"], 0), (["--num-threads", "2"], 2), (["--agent"], 0)]
)
def test_the_thread_count_each_story_gets(monkeypatch, tmp_path, argv, threads):
    """The main story defaults to one thread; an explicit count is kept; --agent (and --real) keep PyTorch's."""
    import spinwheel.agent_demo
    from spinwheel.cli import main

    seen = []
    monkeypatch.setattr(demo, "_main_story", lambda config, out: seen.append(config.num_threads) or {})
    monkeypatch.setattr(spinwheel.agent_demo, "run_agent_demo", lambda config: seen.append(config.num_threads) or {})
    assert main(["demo", "--out-dir", str(tmp_path), *argv]) == 0
    assert seen == [threads]


def test_a_negative_thread_count_is_refused():
    with pytest.raises(ValueError, match="num-threads must be >= 0"):
        DemoConfig(num_threads=-1)
