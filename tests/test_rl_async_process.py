"""The rollout producer's engine in a child process (``--rollout-engine process``): at K = 0 the synchronous run bit
for bit — also when the engine process is killed mid-run (it restarts, the step is played again, its samples are
counted as re-generated and none is used twice); a producer that hangs fails the trainer's step within
``--timeout-s``; K = 1 overlaps and reports the weights it copied."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from helpers import small_config

import spinwheel.rl.llm.rollouts.async_rollouts as async_rollouts
from spinwheel.models.hf import load_model
from spinwheel.parallel.config import ParallelConfig
from spinwheel.rl.llm import train_rl
from spinwheel.rl.llm.rollouts.rollout_engine import EngineProcess
from spinwheel.train.metrics import read_metrics

pytestmark = [pytest.mark.usefixtures("digit_reward"), pytest.mark.slow]
KEYS = ("reward_mean", "loss", "kl_ref", "grad_norm", "mismatch_max")


def _steps(path) -> list[dict]:
    return [r for r in read_metrics(path / "metrics.jsonl") if "reward_mean" in r]


def test_engine_process_killed_mid_run_still_gives_the_synchronous_run(tmp_path, monkeypatch):
    """SIGKILL the engine process on its 4th step of step 1 (mid-generation): a new one starts on the newest
    weights, step 1 is played again from its start, and the run is still the synchronous one exactly."""
    sync_run = tmp_path / "sync"
    train_rl(small_config(sync_run, steps=2))
    calls = {"n": 0}
    step = EngineProcess.step

    def killing_step(self, stream=True):
        calls["n"] += 1
        if calls["n"] == 4 + 6 and self.restarts == 0:  # step 0 takes 6 engine steps (5 tokens + the prefill)
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(timeout=10)
        return step(self, stream)

    monkeypatch.setattr(EngineProcess, "step", killing_step)
    train_rl(small_config(tmp_path / "proc", steps=2, max_staleness=0, rollout_engine="process"))
    sync, proc = _steps(sync_run), _steps(tmp_path / "proc")
    for key in KEYS:
        assert [r[key] for r in proc] == [r[key] for r in sync], key
    assert [r["engine_restarts"] for r in proc] == [0, 1]
    assert [r["regenerated_samples"] for r in proc] == [0, 16]  # step 1's 4 prompts × 4, played twice
    assert proc[-1]["weight_publish_mb"] > 0 and proc[-1]["weight_swaps"] == 1
    want = load_model(sync_run / "checkpoint").state_dict()
    for name, w in load_model(tmp_path / "proc" / "checkpoint").state_dict().items():
        assert torch.equal(w, want[name]), name


def test_a_producer_that_hangs_fails_the_step_within_the_timeout(tmp_path, monkeypatch):
    def hang(self, step):
        self.box.wait_for(10**9)  # never published: waits until closed
        return [], 0.0

    monkeypatch.setattr(async_rollouts.RolloutProducer, "_play", hang)
    config = small_config(tmp_path, steps=2, max_staleness=1, parallel=ParallelConfig(timeout_s=1.0))
    with pytest.raises(TimeoutError, match=r"no batch for step 0 in 1 s \(--timeout-s\)"):
        train_rl(config)


def test_staleness_one_in_a_process(tmp_path):
    train_rl(small_config(tmp_path, steps=3, max_staleness=1, rollout_engine="process", kv_on_update="recompute"))
    recs = _steps(tmp_path)
    assert all(r["dropped_samples"] == 0 and r["staleness_max"] <= 1 for r in recs)
    assert recs[-1]["weight_swaps"] >= 1 and recs[-1]["engine_restarts"] == 0
