"""DPO on the learners: the loss through the trainer equals ``dpo_loss`` on sequence log-probs summed by hand from
a plain forward; pair batches mark exactly the completion tokens; self-generated pairs pair a correct with a wrong
sample; a short run raises the chosen-vs-rejected margin and resumes exactly; bad input fails in one line."""

from __future__ import annotations

import json
import random

import pytest
import torch

from spinwheel.models.presets import preset_config
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.models.transformer import Transformer
from spinwheel.parallel import ParallelConfig
from spinwheel.preference.dpo import DPOLoss, dpo_batch, train_dpo, with_reference
from spinwheel.preference.pref_config import DPOConfig
from spinwheel.preference.preference_data import SampledGroups, TaskPrompt, self_generated_pairs, tokenize_pair
from spinwheel.preference.preference_losses import dpo_loss
from spinwheel.tasks.data import DataError, read_preference_jsonl, write_jsonl
from spinwheel.train.learners import LocalLearner, OptimConfig

TOK = Tokenizer.char_level()
TEXTS = [("12+34=", "46", "45"), ("7*8=", "56", "5"), ("3-15=", "-12", "12"), ("99+1=", "100", "1000")]


def make_model(seed: int) -> Transformer:
    return Transformer(preset_config("test", TOK.vocab_size)).init_weights(seed, std=0.1)


def hand_sequence_logprob(model: Transformer, prompt_ids, completion_ids, mean: bool) -> float:
    """log π(completion | prompt) by a loop over the completion's tokens of one unpadded sequence."""
    seq = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq)[0].double(), -1)
    terms = [float(logp[len(prompt_ids) + k - 1, tok]) for k, tok in enumerate(completion_ids)]
    return sum(terms) / len(terms) if mean else sum(terms)


@pytest.mark.parametrize(
    "loss_type,smoothing,nll", [("sigmoid", 0.0, 0.0), ("sigmoid", 0.2, 0.0), ("ipo", 0.0, 0.0), ("sigmoid", 0.0, 0.7)]
)
def test_loss_through_learner_equals_formula(loss_type, smoothing, nll):
    pairs = [tokenize_pair(TOK, *t, add_eos=True) for t in TEXTS]
    policy, reference = make_model(1), make_model(2)
    loss = DPOLoss(beta=0.3, loss_type=loss_type, label_smoothing=smoothing, nll_weight=nll)
    mean = loss_type == "ipo"
    pairs = with_reference(LocalLearner(reference, None), pairs, loss, TOK.pad_id, chunk=3)  # a padded last chunk
    sides = [
        ("pc", policy, "chosen"),
        ("pr", policy, "rejected"),
        ("rc", reference, "chosen"),
        ("rr", reference, "rejected"),
    ]
    hand = {
        k: torch.tensor(
            [hand_sequence_logprob(m, p.prompt_ids, getattr(p, f"{side}_ids"), mean) for p in pairs],
            dtype=torch.float64,
        )
        for k, m, side in sides
    }
    torch.testing.assert_close(
        torch.tensor([p.ref_logprobs for p in pairs], dtype=torch.float64),
        torch.stack([hand["rc"], hand["rr"]], 1),
        rtol=1e-5,
        atol=1e-5,
    )
    want, stats = dpo_loss(
        hand["pc"], hand["pr"], hand["rc"], hand["rr"], beta=0.3, loss_type=loss_type, label_smoothing=smoothing
    )
    if nll:  # RPO: the token-mean NLL of every chosen completion's tokens together
        summed = [hand_sequence_logprob(policy, p.prompt_ids, p.chosen_ids, mean=False) for p in pairs]
        want = want - nll * sum(summed) / sum(len(p.chosen_ids) for p in pairs)
    result = LocalLearner(policy, OptimConfig(lr=1e-3)).train_step(dpo_batch(pairs, TOK.pad_id), loss, 1e-3)
    assert result.loss == pytest.approx(float(want), rel=1e-5)
    assert result.stats["margin"] == pytest.approx(float(stats["margin"]), rel=1e-4, abs=1e-6)
    assert result.stats["accuracy"] == pytest.approx(float(stats["accuracy"]))


def test_pair_batch_marks_completion_tokens():
    pairs = [tokenize_pair(TOK, *t, add_eos=True) for t in TEXTS[:2]]
    batch = dpo_batch(pairs, TOK.pad_id)
    assert batch["input_ids"].shape[0] == 4 and batch["pair_weights"].tolist() == [0.5] * 4
    for row, (p, side) in enumerate([(p, s) for p in pairs for s in ("chosen_ids", "rejected_ids")]):
        labels = batch["labels"][row][batch["mask"][row].bool()].tolist()
        assert labels == list(getattr(p, side))  # the completion with its EOS, nothing of the prompt or padding
        assert labels[-1] == TOK.eos_id


def test_self_generated_pairs_pair_correct_with_wrong():
    prompts = [TaskPrompt("1+1=", (1, 5), "2"), TaskPrompt("2+2=", (1, 6), "4"), TaskPrompt("3+3=", (1, 7), "6")]
    ids = [[10], [11], [10], [12], [20], [20], [21], [21], [30], [31], [31], [32]]
    rewards = [0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    groups = SampledGroups(prompts, 4, ids, [str(i) for i in ids], rewards)
    assert groups.num_mixed == 2
    pairs = self_generated_pairs(groups, max_pairs_per_prompt=2)
    # prompt 0: correct [11], [12]; wrong [10] (its repeat is dropped) -> one pair; prompt 1 all right -> none.
    assert [(p.prompt, p.chosen_ids, p.rejected_ids) for p in pairs] == [("1+1=", (11,), (10,)), ("3+3=", (32,), (30,))]


def _write_pairs(path, n: int = 24) -> None:
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": f"{a + b}0"})
    write_jsonl(path, rows)


def _config(tmp_path, **kw) -> DPOConfig:
    base = dict(
        model="test",
        data=str(tmp_path / "pairs.jsonl"),
        out_dir=str(tmp_path / "dpo"),
        steps=8,
        batch_size=4,
        lr=2e-3,
        warmup_steps=0,
        eval_every=0,
        eval_fraction=0.2,
        progress=False,
    )
    return DPOConfig(**{**base, **kw})


def test_short_run_raises_the_margin_and_resumes_exactly(tmp_path):
    _write_pairs(tmp_path / "pairs.jsonl")
    full = train_dpo(_config(tmp_path, out_dir=str(tmp_path / "full")))
    assert full["eval_before"]["eval_margin"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    assert full["eval_after"]["eval_margin"] > 0.05 and full["eval_after"]["eval_accuracy"] == 1.0
    margins = [h["margin"] for h in full["history"]]
    assert margins[-1] > margins[0] + 0.05
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert {"loss", "margin", "accuracy", "eval_margin"} <= {k for r in records for k in r}
    assert (tmp_path / "full" / "curves.png").is_file()

    train_dpo(_config(tmp_path, stop_after=3))
    with pytest.raises(ValueError, match=r"trained with other settings \(--lr 0.002 -> 0.001\)"):
        train_dpo(_config(tmp_path, lr=1e-3))  # would not continue the same run
    with pytest.raises(ValueError, match="is at step 3, past --steps 2"):
        train_dpo(_config(tmp_path, steps=2))
    resumed = train_dpo(_config(tmp_path, eval_every=4))  # what is observed may change
    assert resumed["start_step"] == 3
    losses = [h["loss"] for h in resumed["history"]]
    assert losses == pytest.approx([h["loss"] for h in full["history"][3:]], rel=1e-6)


def test_bad_input_is_one_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n{"prompt": "2+2=", "chosen": " ", "rejected": "5"}\n'
    )
    with pytest.raises(DataError, match=r"bad.jsonl:2: field 'chosen' is empty"):
        read_preference_jsonl(path)
    path.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "2"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: fields 'chosen' and 'rejected' are the same"):
        read_preference_jsonl(path)
    with pytest.raises(ValueError, match="--beta must be > 0"):
        DPOConfig(beta=0.0)
    with pytest.raises(ValueError, match="--label-smoothing applies to --loss-type sigmoid only"):
        DPOConfig(loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"--batch-size \(pairs\) 3 must be divisible"):
        train_dpo(_config(tmp_path, batch_size=3, parallel=ParallelConfig(microbatches=2)))
