"""``Run.train(until=...)``: a stage that ends at a level reached, not a step count (the demo's SFT): the first
periodic evaluation that passes the test ends the run there, saved at that step, that evaluation its result; a
test never passed runs to ``--steps`` as before."""

from __future__ import annotations

from spinwheel.tasks.arithmetic import ArithmeticConfig
from spinwheel.train.checkpoint import load_trainer_state
from spinwheel.train.metrics import read_metrics
from spinwheel.train.sft import train_sft
from spinwheel.train.sft_config import SFTConfig


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
