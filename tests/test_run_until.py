"""``Run.train(until=...)``: a stage that ends at a level reached, not a step count (the demo's SFT): the first
periodic evaluation that passes the test ends the run there, saved at that step, that evaluation its result; a
test never passed runs to ``--steps`` as before."""

from __future__ import annotations

import pytest
from helpers import run_cli

from spinwheel.tasks.arithmetic import ArithmeticConfig
from spinwheel.train.checkpoint import load_trainer_state
from spinwheel.train.metrics import read_metrics
from spinwheel.train.sft.sft import train_sft
from spinwheel.train.sft.sft_config import SFTConfig


def config(out, **kw) -> SFTConfig:
    base = dict(model="test", out_dir=str(out), steps=8, batch_size=4, lr=3e-3, warmup_steps=1, eval_every=2)
    base.update(eval_examples=4, max_new_tokens=3, save_every=0, progress=False, num_threads=1)
    return SFTConfig(**base, task=ArithmeticConfig(num_digits=1, num_train=40, num_test=4), **kw)


def test_until_ends_the_run_at_the_first_evaluation_that_passes(tmp_path):
    seen = []
    result = train_sft(config(tmp_path / "a"), until=lambda ev: seen.append(ev) or len(seen) == 2)
    assert result["end_step"] == result["reached"] == 4  # evaluations at 2 and 4: the second passes
    assert result["eval_after"] is seen[-1]
    assert load_trainer_state(tmp_path / "a" / "checkpoint")["step"] == 4
    rows = read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert max(r["step"] for r in rows) == 4 and [r["step"] for r in rows if "eval_exact_match" in r] == [0, 2, 4]
    # the same steps as a run without the test, up to there
    full = train_sft(config(tmp_path / "b"), until=lambda ev: False)
    assert full["end_step"] == 8 and "reached" not in full
    assert result["losses"] == full["losses"][:4]


@pytest.mark.slow
def test_demo_sft_checks_every_step_near_the_target_and_grpo_evaluates_periodically(tmp_path, capfd):
    """The demo's two SFT phases (coarse checks, then one a step from --sft-near on: a resumed run of the same
    schedule) and GRPO's periodic held-out curve, at tiny step counts."""
    argv = ["demo", "--out-dir", str(tmp_path), "--sft-steps", "9", "--sft-check-every", "3", "--sft-near", "0"]
    argv += ["--sft-target", "1", "--grpo-steps", "4", "--grpo-eval-every", "2", "--grpo-prompts", "2"]
    proc = run_cli([*argv, "--eval-examples", "8", "--no-progress"], capfd)
    assert proc.returncode == 0, proc.stderr
    assert "SFT ended at step 9" in proc.stdout and "after SFT 0.0% -> after GRPO" in proc.stdout
    sft_evals = [r["step"] for r in read_metrics(tmp_path / "sft" / "metrics.jsonl") if "eval_exact_match" in r]
    assert sft_evals == [0, 3, 4, 5, 6, 7, 8, 9]  # near (0) reached at the first check: then every step
    grpo = read_metrics(tmp_path / "grpo" / "metrics.jsonl")
    assert [r["step"] for r in grpo if "eval_exact_match" in r] == [0, 2, 4]
