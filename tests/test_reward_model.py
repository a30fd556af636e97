"""Reward models: the Bradley–Terry loss through the learner equals the formula on scores read by hand at each
sequence's last token; random wrong answers stay in the operator's range; a short run learns the pairs, writes a
checkpoint that ``transformers`` loads as ``LlamaForSequenceClassification`` with the scores of
:func:`reward_model_fn`; 2 gloo ranks (DDP, and TP with the score head kept whole) train like one process."""

from __future__ import annotations

import random

import pytest
import torch

import spinwheel
from spinwheel.models.presets import preset_config
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.models.transformer import Transformer
from spinwheel.parallel import ParallelConfig, spawn
from spinwheel.preference.pref_config import RMConfig
from spinwheel.preference.preference_data import answer_range, random_wrong_answer, tokenize_pair
from spinwheel.preference.preference_losses import bradley_terry_loss
from spinwheel.preference.reward_model import (
    RewardModelError,
    bradley_terry_pair_loss,
    reward_model_fn,
    rm_batch,
    train_rm,
)
from spinwheel.tasks.arithmetic import ArithmeticConfig, ArithmeticTask
from spinwheel.tasks.data import write_jsonl
from spinwheel.train.learners import LocalLearner, OptimConfig
from spinwheel.train.metrics import read_metrics

TOK = Tokenizer.char_level()
TEXTS = [("12+34=", "46", "45"), ("7*8=", "56", "5"), ("3-15=", "-12", "12"), ("99+1=", "100", "1000")]


def test_loss_through_learner_equals_formula():
    model = Transformer(preset_config("test", TOK.vocab_size, num_labels=1)).init_weights(1, std=0.3)
    pairs = [tokenize_pair(TOK, *t, add_eos=False) for t in TEXTS]
    scores = []
    with torch.no_grad():
        for p in pairs:
            for completion in (p.chosen_ids, p.rejected_ids):
                seq = torch.tensor([list(p.prompt_ids) + list(completion)])  # unpadded: the last token is the score
                scores.append(float(model(seq)[0, -1, 0]))
    r = torch.tensor(scores, dtype=torch.float64)
    want, stats = bradley_terry_loss(r[0::2], r[1::2])
    result = LocalLearner(model, OptimConfig(lr=1e-3)).train_step(
        rm_batch(pairs, TOK.pad_id), bradley_terry_pair_loss, 1e-3
    )
    assert result.loss == pytest.approx(float(want), rel=1e-5)
    assert result.stats["margin"] == pytest.approx(float(stats["margin"]), rel=1e-4)
    assert result.stats["accuracy"] == pytest.approx(float(stats["accuracy"]))
    assert 0 < result.stats["accuracy"] < 1  # the check above compares a non-trivial share


def test_random_wrong_answers_span_the_operator_range():
    task = ArithmeticTask(ArithmeticConfig(num_digits=2, operators=("+", "-"), num_train=300, num_test=10))
    rng = random.Random(0)
    for e in task.train:
        wrong = int(random_wrong_answer(e, rng))
        lo, hi = answer_range("-" if "-" in e.prompt else "+", 2)
        assert wrong != int(e.answer) and lo <= wrong <= hi
    assert answer_range("*", 1) == (0, 81) and answer_range("-", 2) == (-99, 99)
    with pytest.raises(ValueError, match="not an arithmetic problem"):
        random_wrong_answer(spinwheel.tasks.arithmetic.Example("hello", "1"), rng)


def _write_pairs(path, n: int = 24) -> None:
    """Pairs a tiny random model can learn in a few steps: the right sum against the sum with a 0 appended."""
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": f"{a + b}0"})
    write_jsonl(path, rows)


def _config(tmp_path, out: str, **kw) -> RMConfig:
    base = dict(
        model="test",
        data=str(tmp_path / "pairs.jsonl"),
        out_dir=str(tmp_path / out),
        steps=6,
        batch_size=4,
        lr=3e-3,
        warmup_steps=0,
        eval_every=3,
        eval_fraction=0.25,
        progress=False,
    )
    return RMConfig(**{**base, **kw})


def test_short_run_learns_and_saves_an_hf_reward_model(tmp_path):
    _write_pairs(tmp_path / "pairs.jsonl")
    result = train_rm(_config(tmp_path, "rm"))
    assert result["eval_before"]["eval_accuracy"] < 0.9
    assert result["eval_after"]["eval_accuracy"] == 1.0 and result["eval_after"]["eval_margin"] > 1.0
    records = read_metrics(tmp_path / "rm" / "metrics.jsonl")
    assert [r["step"] for r in records if "eval_accuracy" in r] == [0, 3, 6]
    assert (tmp_path / "rm" / "curves.png").is_file()

    ckpt = tmp_path / "rm" / "checkpoint"
    import transformers  # the reference (here, not at the top: the spawned ranks import this module)

    hf = transformers.AutoModelForSequenceClassification.from_pretrained(ckpt).eval()
    assert type(hf).__name__ == "LlamaForSequenceClassification" and hf.config.pad_token_id == TOK.pad_id
    prompts, completions = ["3+4=", "9+9=", "0+0="], ["7", "180", "0"]
    ids = [TOK.encode(p) + TOK.encode(c, add_special_tokens=False) for p, c in zip(prompts, completions)]
    tokens = torch.full((3, max(map(len, ids))), TOK.pad_id)
    for i, s in enumerate(ids):
        tokens[i, : len(s)] = torch.tensor(s)
    with torch.no_grad():
        want = hf(tokens).logits[:, 0].tolist()
    assert reward_model_fn(ckpt)(prompts, completions) == pytest.approx(want, abs=1e-5)

    spinwheel.save_pretrained(spinwheel.load_model("test"), tmp_path / "lm")
    with pytest.raises(RewardModelError, match=r"lm is not a reward model \(num_labels != 1\)"):
        reward_model_fn(tmp_path / "lm")


def _parallel_worker(rank: int, world_size: int, tmp_path) -> dict[str, list[float]]:
    out = {}
    for name, parallel in [("dp2", ParallelConfig()), ("tp2", ParallelConfig(tp=2))]:
        result = train_rm(_config(tmp_path, name, parallel=parallel))
        out[name] = [h["loss"] for h in result["history"]] + [result["eval_after"]["eval_margin"]]
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_train_like_one_process(tmp_path):
    _write_pairs(tmp_path / "pairs.jsonl")
    single = train_rm(_config(tmp_path, "single"))
    want = [h["loss"] for h in single["history"]] + [single["eval_after"]["eval_margin"]]
    results = spawn(_parallel_worker, 2, args=(tmp_path,), timeout_s=300)
    for name in ("dp2", "tp2"):
        for rank in range(2):
            assert results[rank][name] == pytest.approx(want, rel=1e-5), (name, rank)
        got = spinwheel.load_model(tmp_path / name / "checkpoint").state_dict()
        ref = spinwheel.load_model(tmp_path / "single" / "checkpoint").state_dict()
        for key in ref:
            torch.testing.assert_close(got[key], ref[key], rtol=1e-4, atol=1e-6)
