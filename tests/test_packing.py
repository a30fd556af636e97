"""Padding-free packing with token-budget micro-batches (spinwheel/train/packing.py) against the plain padded
forward: per-token outputs, the loss, its stats and the gradients of a micro-batched step to 1e-5 (fp32)."""

from __future__ import annotations

import pytest
import torch

from spinwheel.models.hf import load_model
from spinwheel.models.presets import preset_config
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.models.transformer import AttentionMask
from spinwheel.rl.llm.rollout import Prompt, Rollout, rollout_batch
from spinwheel.rl.llm.token_losses import grpo_loss, token_weights
from spinwheel.train.learners import LocalLearner, OptimConfig
from spinwheel.train.packing import (
    RowSpans,
    activation_bytes_per_token,
    auto_micro_batch_tokens,
    packed_outputs,
    plan_microbatches,
    shared_prefixes,
)

TOK = Tokenizer.char_level()
T_SAMPLE = 0.7  # the learner's rollout temperature: log-probs of logits / T


def rollout_rows(prompt_texts: list[str], group: int, seed: int) -> dict[str, torch.Tensor]:
    """Right-padded rollout rows of random completions of 1–7 tokens, ``group`` per prompt."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [Prompt(t, tuple(TOK.encode(t)), "") for t in prompt_texts]
    b = len(prompts) * group
    comps = [torch.randint(4, 40, (int(n),), generator=gen).tolist() for n in torch.randint(1, 8, (b,), generator=gen)]
    return rollout_batch(Rollout(prompts, group, comps, [[0.0] * len(c) for c in comps], [""] * b), pad_id=0)


def grpo_batch(batch: dict[str, torch.Tensor], packed: bool, seed: int) -> dict[str, torch.Tensor]:
    """The loss's per-row tensors: advantages, old log-probs, global token-mean weights; with ``packed`` the rows
    also say where their prompts end (what lets the learner pack them)."""
    gen = torch.Generator().manual_seed(seed)
    mask = batch["mask"]
    rows = {
        "input_ids": batch["input_ids"],
        "labels": batch["labels"],
        "advantages": torch.randn(mask.shape[0], 1, generator=gen) * mask,
        "old_logprobs": -torch.rand(mask.shape, generator=gen) * 3 * mask,
        "weights": token_weights(mask, "token-mean"),
    }
    if packed:
        rows.update(prompt_lens=batch["prompt_lens"], completion_lens=batch["completion_lens"])
    return rows


def loss_fn(out, mb):
    loss, stats = grpo_loss(out.logprobs, mb["old_logprobs"], mb["advantages"], mb["weights"], eps_low=0.2)
    return loss, {**stats, "entropy": (mb["weights"] * out.entropy).sum()}


def step_grads(batch, budget: int) -> tuple[float, dict[str, float], list[torch.Tensor]]:
    """Loss, stats and gradients of one step (lr 0: the weights stay; grad_clip 0: measured, not clipped)."""
    model = load_model("test", seed=3, vocab_size=TOK.vocab_size)
    learner = LocalLearner(model, OptimConfig(lr=0.0, grad_clip=0.0), temperature=T_SAMPLE, micro_batch_tokens=budget)
    result = learner.train_step(batch, loss_fn, 0.0, entropy=True)
    return result.loss, result.stats, [p.grad.clone() for p in model.parameters()]


def test_packed_outputs_equal_the_padded_forward():
    """Rows of different lengths in one packed row (positions restart, attention per row): the padded forward's
    log-probs and entropies at every scored label, zeros elsewhere, and the same gradients."""
    model = load_model("test", seed=3, vocab_size=TOK.vocab_size)
    batch = rollout_rows(["12+34=", "5+6=", "7*8=", "100-1="], group=2, seed=0)
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["mask"]
    spans = RowSpans.of(batch)
    assert spans.ends == (batch["prompt_lens"] + batch["completion_lens"] - 1).tolist()
    logits = model(ids) / T_SAMPLE  # the reference: padded rows, full logits
    ref = torch.log_softmax(logits, -1)
    ref_logp, ref_ent = ref.gather(-1, labels[..., None])[..., 0], -(ref.exp() * ref).sum(-1)
    out = packed_outputs(model, batch, spans, entropy=True, temperature=T_SAMPLE)
    torch.testing.assert_close(out.logprobs * mask, ref_logp * mask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy * mask, ref_ent.detach() * mask, rtol=1e-5, atol=1e-5)
    assert out.logprobs[mask == 0].abs().max() == 0
    w = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    params = list(model.parameters())
    grads = torch.autograd.grad((out.logprobs * w).sum(), params)
    for g, g_ref in zip(grads, torch.autograd.grad((ref_logp * w).sum(), params)):
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [1, 4])  # 1: distinct prompts (packed rows); 4: groups share a prompt
def test_micro_batched_packed_step_equals_the_padded_step(group):
    """GRPO's loss over token-budget micro-batches (several of them, a row over the budget alone) sums to the
    padded one-forward step's loss, stats and gradients: the global weights make each micro-batch's part exact."""
    batch = rollout_rows(["12+34=", "5+6=", "7*8=", "100-1=", "9+9="], group=group, seed=group)
    padded = step_grads(grpo_batch(batch, packed=False, seed=2), budget=0)  # plain rows: one padded forward
    budget = max(RowSpans.of(batch).ends) - 1  # the longest row goes alone, the others share
    model = load_model("test", seed=3, vocab_size=TOK.vocab_size)
    layout, mbs = LocalLearner(model, None, micro_batch_tokens=budget).microbatches(grpo_batch(batch, True, 2))
    assert layout == ("packed" if group == 1 else "shared") and len(mbs) >= 3
    packed = step_grads(grpo_batch(batch, packed=True, seed=2), budget=budget)
    assert packed[0] == pytest.approx(padded[0], rel=1e-5, abs=1e-7)
    assert packed[1].keys() == padded[1].keys()
    for k in padded[1]:
        assert packed[1][k] == pytest.approx(padded[1][k], rel=1e-5, abs=1e-6), k
    assert max(float(g.abs().max()) for g in padded[2]) > 1e-3
    for g, g_ref in zip(packed[2], padded[2]):
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)


def test_micro_batched_forward_returns_every_row_in_order():
    batch = rollout_rows(["12+34=", "5+6=", "7*8="], group=2, seed=4)
    rows = {k: batch[k] for k in ("input_ids", "labels", "prompt_lens", "completion_lens")}
    model = load_model("test", seed=3, vocab_size=TOK.vocab_size)
    whole = LocalLearner(model, None, temperature=T_SAMPLE).forward(rows, entropy=True)
    parts = LocalLearner(model, None, temperature=T_SAMPLE, micro_batch_tokens=10).forward(rows, entropy=True)
    assert parts.keys() == whole.keys() == {"logprobs", "entropy"}
    for k in whole:
        assert parts[k].shape == batch["mask"].shape
        torch.testing.assert_close(parts[k], whole[k], rtol=1e-5, atol=1e-6)


def test_plan_microbatches_keeps_row_order_under_the_budget():
    assert plan_microbatches([3, 4, 2, 9, 1, 1], 7) == [range(0, 2), range(2, 3), range(3, 4), range(4, 6)]
    assert plan_microbatches([3, 4, 2], 0) == [range(0, 3)]  # off: one micro-batch
    assert plan_microbatches([5, 5], 10) == [range(0, 2)]
    with pytest.raises(ValueError, match="must be ≥ 0"):
        plan_microbatches([1], -1)


def test_segments_attend_within_each_sequence_only():
    """The model's varlen attention: two sequences packed in one row equal each run alone."""
    model = load_model("test", seed=3, vocab_size=TOK.vocab_size)
    a, b = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[9, 10, 11]])
    packed = model(
        torch.cat([a, b], 1),
        positions=torch.tensor([[0, 1, 2, 3, 0, 1, 2]]),
        attn_metadata=AttentionMask(None, segments=(0, 4, 7)),
    )
    torch.testing.assert_close(packed[:, :4], model(a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, 4:], model(b), rtol=1e-5, atol=1e-5)


def test_shared_prompt_rows_count_their_prompt_once_and_the_auto_budget_follows_the_model():
    batch = rollout_rows(["12+34=", "5+6="], group=3, seed=5)
    n = batch["prompt_lens"].tolist()
    assert shared_prefixes(batch) == [0, n[1], n[2], 0, n[4], n[5]]  # each group's later rows share its prompt
    assert plan_microbatches([10, 10, 10, 10], 18, shared=[0, 6, 6, 0]) == [range(0, 3), range(3, 4)]  # 10 + 4 + 4
    smol = preset_config("test", 49_152, num_hidden_layers=30, hidden_size=576, intermediate_size=1536)
    assert activation_bytes_per_token(smol) == 30 * (16 * 576 + 5 * 1536) * 4  # ≈ 2.0 MB: SmolLM2-135M
    assert auto_micro_batch_tokens(smol) == 529
    model = load_model("test", seed=3, vocab_size=TOK.vocab_size)
    auto = LocalLearner(model, None, micro_batch_tokens=None).micro_batch_tokens
    assert auto == auto_micro_batch_tokens(model.config) > 529  # a smaller model: more tokens in the same memory
