"""Peak RSS per phase (spinwheel/train/memory.py): a phase that allocates shows it, one that does not shows less,
the process's own peak is left as it was (no VmHWM reset), and the RL loop logs the figures."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import small_config

from spinwheel.train.memory import PhasePeaks, current_rss_gb, process_peak_gb, release_free_memory
from spinwheel.train.metrics import read_metrics

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")


@linux
@pytest.mark.serial  # process-wide RSS: earlier tests in the same xdist worker leave freed memory mapped
def test_phase_peaks_see_memory_freed_inside_the_phase():
    peaks = PhasePeaks()
    before = current_rss_gb()
    with peaks.phase("alloc"):
        x = torch.ones(400 * 2**20 // 4)  # 400 MiB, touched
        del x
    with peaks.phase("idle"):
        torch.ones(10).sum()
    figures = peaks.figures()
    assert figures["rss_peak_alloc_gb"] >= before + 0.35  # freed before the phase ended: still counted
    assert figures["rss_peak_idle_gb"] < figures["rss_peak_alloc_gb"] - 0.3
    assert figures["rss_peak_gb"] == pytest.approx(process_peak_gb(), abs=1e-3)
    assert figures["rss_peak_gb"] >= figures["rss_peak_alloc_gb"]
    assert peaks.figures().keys() == {"rss_peak_gb"}  # the phases are cleared for the next step
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        PhasePeaks(0)


@linux
def test_release_free_memory_returns_freed_heap():
    big = torch.ones(5_000_000)  # a freed 20 MB block raises glibc's mmap threshold: what follows is heap
    del big
    xs = [torch.ones(700_000) for _ in range(300)]  # 840 MB of 2.8 MB tensors
    held = current_rss_gb()
    del xs
    if not release_free_memory():
        pytest.skip("no malloc_trim (not glibc)")
    assert current_rss_gb() < held - 0.6


@pytest.mark.usefixtures("digit_reward")  # the reward module `rl_test_reward:digits` (helpers.py)
def test_rl_run_logs_peak_rss_per_phase(tmp_path):
    from spinwheel.rl.llm import train_rl

    train_rl(small_config(tmp_path, steps=2))
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "reward_mean" in r]
    assert len(steps) == 2
    for r in steps:
        phases = [r[f"rss_peak_{p}_gb"] for p in ("gen", "logprobs", "update")]
        assert all(0.05 < gb <= r["rss_peak_gb"] + 1e-3 for gb in phases), r
