"""LoRA in the RL commands, DPO and reward models (``--lora-rank``): only the adapters train, the reference is the
base with the adapters off (equal to a separate frozen copy, with no copy loaded), resume is exact."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import small_config

from spinwheel.models.hf import load_model
from spinwheel.models.lora import LoRAConfig, LoRALinear, lora_parameters
from spinwheel.models.lora_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.preference.dpo import DPOLoss, train_dpo, with_reference
from spinwheel.preference.pref_config import DPOConfig, RMConfig
from spinwheel.preference.preference_data import PreferencePair
from spinwheel.preference.reward_model import reward_model_fn, train_rm
from spinwheel.rl.llm import loop
from spinwheel.tasks.data import write_jsonl
from spinwheel.train.checkpoint import load_trainer_state
from spinwheel.train.learners import LocalLearner
from spinwheel.train.lora_run import AdaptersOff
from spinwheel.train.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("digit_reward")
LORA = dict(lora_rank=4, lora_alpha=8)


def run_grpo(out_dir, monkeypatch, **kw) -> tuple[dict, loop.RLJob]:
    """A LoRA GRPO run (β > 0) of the `test` model; returns its result and its job (the trained model in memory)."""
    jobs: list[loop.RLJob] = []
    init = loop.RLJob.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        jobs.append(self)

    monkeypatch.setattr(loop.RLJob, "__init__", keep)
    return loop.train_rl(small_config(out_dir, **{"steps": 4, **LORA, **kw})), jobs[-1]


def frozen_base(vocab_size: int) -> LocalLearner:
    return LocalLearner(load_model("test", seed=0, vocab_size=vocab_size), None)


@pytest.mark.slow
def test_grpo_with_lora_trains_the_adapters_against_the_base_and_resumes_exactly(tmp_path, monkeypatch):
    result, job = run_grpo(tmp_path / "full", monkeypatch)
    model, vocab = job.learner.model, job.tokenizer.vocab_size
    # Only the adapters moved: every base tensor is bitwise the preset's, the adapters' B factors left zero.
    base = frozen_base(vocab)
    plain = {k: v for k, v in model.state_dict().items() if "lora_" not in k}
    assert plain.keys() == base.model.state_dict().keys()
    assert all(torch.equal(v, base.model.state_dict()[k]) for k, v in plain.items())
    assert all(p.abs().max() > 0 for n, p in lora_parameters(model).items() if "lora_B" in n)
    state = job.learner.optimizer.state  # AdamW state for the adapters alone
    assert {id(p) for p in state} == {id(p) for p in lora_parameters(model).values()}

    # The reference is the policy with its adapters off (no second copy), equal to a separate frozen base after
    # the updates; the policy itself (adapters back on afterwards) differs from it.
    assert isinstance(job.reference, AdaptersOff) and job.reference.model is model
    ids = torch.randint(3, vocab, (4, 9), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    ref = job.reference.forward(batch)["logprobs"]
    assert (ref - base.forward(batch)["logprobs"]).abs().max() <= 1e-6
    assert (job.learner.forward(batch)["logprobs"] - ref).abs().max() > 1e-4

    records = read_metrics(tmp_path / "full" / "metrics.jsonl")
    first = records[0]
    assert 0 < first["lora_sync_mb"] < 0.2 * first["full_sync_mb"]
    assert first["num_trainable_params"] == sum(p.numel() for p in lora_parameters(model).values())
    assert all(r["kl_ref"] > 0 for r in records if "kl_ref" in r and r["step"] > 1)
    names = {p.name for p in (tmp_path / "full" / "checkpoint").iterdir()}
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "trainer_state.pt"} <= names and "model.safetensors" not in names

    # Stopped after 2 steps and rerun: the adapters and their optimizer state continue to the same losses.
    part, _ = run_grpo(tmp_path / "split", monkeypatch, stop_after=2)
    rest, _ = run_grpo(tmp_path / "split", monkeypatch)
    assert rest["start_step"] == 2
    assert [h["loss"] for h in part["history"] + rest["history"]] == [h["loss"] for h in result["history"]]


@pytest.mark.parametrize("algo", ["rloo", "reinforce-pp", "ppo", "trpo", "gspo"])
def test_every_rl_command_trains_only_the_adapters(tmp_path, monkeypatch, algo):
    kw = {"beta": 0.0} if algo == "trpo" else {}  # TRPO's trust region replaces the KL penalty
    result, job = run_grpo(tmp_path, monkeypatch, algo=algo, steps=2, **kw)
    assert all(torch.isfinite(torch.tensor(h["grad_norm"])) for h in result["history"])
    base = frozen_base(job.tokenizer.vocab_size).model.state_dict()
    plain = {k: v for k, v in job.learner.model.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(v, base[k]) for k, v in plain.items())
    assert any(p.abs().max() > 0 for n, p in lora_parameters(job.learner.model).items() if "lora_B" in n)
    assert (job.reference is None) == (algo == "trpo")


def write_pairs(path, n: int = 24) -> None:
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": f"{a + b}0"})
    write_jsonl(path, rows)


def test_dpo_with_lora_references_the_base_without_a_copy_and_writes_an_adapter(tmp_path, monkeypatch):
    write_pairs(tmp_path / "pairs.jsonl")
    import spinwheel.preference.dpo as dpo

    def no_second_model(*args, **kwargs):
        raise AssertionError("LoRA DPO loaded a second model for its reference")

    monkeypatch.setattr(dpo, "load_model", no_second_model)  # the reference path's loader
    config = DPOConfig(
        model="test", data=str(tmp_path / "pairs.jsonl"), out_dir=str(tmp_path / "dpo"), steps=6, batch_size=4,
        lr=2e-2, warmup_steps=0, eval_every=0, eval_fraction=0.2, progress=False, **LORA,
    )  # fmt: skip
    result = train_dpo(config)
    assert result["eval_before"]["eval_margin"] == pytest.approx(0.0, abs=1e-6)
    assert result["eval_after"]["eval_margin"] > 0.05
    ckpt = tmp_path / "dpo" / "checkpoint"
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS} <= {p.name for p in ckpt.iterdir()}
    # The pairs' reference log-probs (computed with the adapters off) equal a separate frozen base's.
    tok = Tokenizer.from_pretrained(ckpt)
    stored = [PreferencePair(**p) for p in load_trainer_state(ckpt)["pairs"]["train"]]
    fresh = with_reference(frozen_base(tok.vocab_size), stored, DPOLoss(config.beta), tok.pad_id or 0, chunk=4)
    got, want = torch.tensor([p.ref_logprobs for p in stored]), torch.tensor([p.ref_logprobs for p in fresh])
    assert (got - want).abs().max() <= 1e-6


def test_reward_model_with_lora_writes_a_merged_reward_model_and_resumes_exactly(tmp_path):
    write_pairs(tmp_path / "pairs.jsonl")

    def config(out: str, **kw) -> RMConfig:
        base = dict(
            model="test", data=str(tmp_path / "pairs.jsonl"), out_dir=str(tmp_path / out), steps=6, batch_size=4,
            lr=3e-3, warmup_steps=0, eval_every=0, eval_fraction=0.25, progress=False, **LORA,
        )  # fmt: skip
        return RMConfig(**{**base, **kw})

    full = train_rm(config("full"))
    part = train_rm(config("split", stop_after=3))
    rest = train_rm(config("split"))
    assert [h["loss"] for h in part["history"] + rest["history"]] == [h["loss"] for h in full["history"]]
    assert full["history"][-1]["loss"] < full["history"][0]["loss"]
    # The checkpoint is HF's sequence classifier with the adapters folded in: what --reward-model loads.
    scores = reward_model_fn(tmp_path / "full" / "checkpoint")(["3+4=", "3+4="], ["7", "70"])
    assert len(scores) == 2 and all(isinstance(s, float) for s in scores)


def test_the_engine_samples_without_adapter_dropout():
    """The engine runs in inference mode: a training-mode adapter with dropout computes its eval-mode output."""
    base = torch.nn.Linear(8, 6)
    layer = LoRALinear(base, LoRAConfig(rank=2, dropout=0.5), torch.Generator().manual_seed(0))
    torch.nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = layer.eval()(x)
    layer.train()
    with torch.inference_mode():
        assert torch.equal(layer(x), want)
    assert not torch.equal(layer(x), want)  # training: dropout on the adapter's input
