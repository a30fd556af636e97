"""Temperature in the loss: rollouts sampled at T ≠ 1 are trained with the tempered policy's log-probs (logits / T,
as TRL and verl do), so the trainer's and the engine's log-probs of the sampled tokens agree and the ratio to the
sampling policy is 1."""

from __future__ import annotations

import pytest
import torch
from helpers import generate_rollout, small_config

from spinwheel.engine import LLM, SamplingParams
from spinwheel.models import Transformer
from spinwheel.models.presets import preset_config
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.parallel import ParallelConfig, ParallelTrainer
from spinwheel.rl.llm import train_rl
from spinwheel.rl.llm.rollout import Prompt, rollout_batch
from spinwheel.train.learners import LocalLearner
from spinwheel.train.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("digit_reward")  # the reward module `rl_test_reward:digits` (helpers.py)

T = 0.7


def _rollout(model: Transformer, tokenizer: Tokenizer) -> dict[str, torch.Tensor]:
    llm = LLM(model, tokenizer, seed=0, max_model_len=64)
    prompts = [Prompt(f"{a}+{b}=", tuple(tokenizer.encode(f"{a}+{b}=")), str(a + b)) for a, b in [(1, 2), (3, 4)]]
    rollout = generate_rollout(llm, prompts, 0, 0, 4, 6, T, 1.0, None)
    return rollout_batch(rollout, tokenizer.pad_id or 0)


@pytest.mark.parametrize("packed", [False, True])
def test_trainer_logprobs_at_the_sampling_temperature_equal_the_engines(packed):
    """The engine reports the tempered log-prob of each sampled token; the learner at T gives the same (ratio 1 to
    1e-5), on the plain forward and on the shared-prompt (packed) forward; at T = 1 they differ."""
    tokenizer = Tokenizer.char_level()
    model = Transformer(preset_config("test", vocab_size=tokenizer.vocab_size)).eval()
    batch = _rollout(model, tokenizer)
    inputs = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    if packed:
        inputs.update(prompt_lens=batch["prompt_lens"], completion_lens=batch["completion_lens"])
    mask = batch["mask"].bool()
    tempered = LocalLearner(model, None, temperature=T).forward(inputs)["logprobs"]
    ratio = (tempered - batch["engine_logprobs"])[mask].exp()
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)
    untempered = LocalLearner(model, None).forward(inputs)["logprobs"]
    assert (untempered - batch["engine_logprobs"])[mask].abs().max() > 1e-2  # the old, off-policy objective


def test_parallel_trainer_tempers_its_logprobs_as_the_local_learner():
    tokenizer = Tokenizer.char_level()
    model = Transformer(preset_config("test", vocab_size=tokenizer.vocab_size)).eval()
    batch = _rollout(model, tokenizer)
    inputs = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    local = LocalLearner(model, None, temperature=T).forward(inputs)["logprobs"]
    trainer = ParallelTrainer(model, None, ParallelConfig())
    trainer.temperature = T
    torch.testing.assert_close(trainer.forward(inputs)["logprobs"], local, atol=1e-5, rtol=1e-5)


def test_engine_processed_logprobs_are_of_the_tempered_distribution():
    tokenizer = Tokenizer.char_level()
    model = Transformer(preset_config("test", vocab_size=tokenizer.vocab_size)).eval()
    llm = LLM(model, tokenizer, seed=0, max_model_len=64)
    ids = tokenizer.encode("1+2=")
    raw, processed = (
        llm.generate([ids], SamplingParams(temperature=T, max_tokens=1, seed=3, logprobs=2, logprobs_mode=mode))[0]
        for mode in ("raw", "processed")
    )
    token = raw.outputs[0].token_ids[0]
    assert processed.outputs[0].token_ids[0] == token  # the mode changes what is reported, not what is drawn
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0, -1].float()
    for out, scale in ((raw, 1.0), (processed, T)):
        expected = torch.log_softmax(logits / scale, -1)
        for t, lp in out.outputs[0].logprobs[0].items():
            assert lp == pytest.approx(float(expected[t]), abs=1e-5)


def test_grpo_at_temperature_0_7_is_on_policy(tmp_path):
    """A GRPO run sampling at T = 0.7: the trainer's log-probs equal the engine's on every sampled token, so the
    truncated-IS weights are all 1."""
    train_rl(small_config(tmp_path, steps=2, temperature=T, tis_cap=2.0))
    recs = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "reward_mean" in r]
    assert len(recs) == 2
    for r in recs:
        assert r["mismatch_max"] < 1e-4
        assert r["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
