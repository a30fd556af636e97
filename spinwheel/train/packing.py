"""Token-budget micro-batches of right-padded rows, and their padding-free packed forward.

A learner's batch is rows of different lengths right-padded to the longest (B, T). Here its rows are cut, in their
order, into micro-batches of at most ``budget`` real tokens each (a longer row goes alone), and a micro-batch's rows
run as one packed row ``row₀ · row₁ · …`` (1, N): positions restart at 0 for each row and each row attends causally
to itself only (``AttentionMask.segments``: one causal kernel per row), so every token sees exactly the context it
has in its own padded row — the same outputs up to float rounding, for ``Σ len`` tokens instead of ``b · T`` — and
the output layer runs on the scored positions only, a chunk at a time
(:func:`~spinwheel.parallel.chunked_logprobs.chunked_token_logprobs`).

A row's *span* is what it feeds and scores: with ``prompt_lens`` / ``completion_lens`` (B,) in the batch (rollout
rows; ``n`` / ``c``), it feeds ``n + c − 1`` tokens and scores labels ``n − 1 …`` (its completion, and any later
turns); without them the whole row of T. Outputs outside the scored labels are 0 — the losses weigh them by 0.

The outputs come back as the micro-batch's rows (b, T), so a loss sees the same per-row tensors as with the
padded forward and its contributions (global weights, see :mod:`spinwheel.parallel.trainer`) sum to the same
global loss. Reference: the padded forward, ``tests/test_packing.py`` (loss and gradients to 1e-5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spinwheel.models.transformer import AttentionMask, Transformer
from spinwheel.parallel.chunked_logprobs import chunked_token_logprobs
from spinwheel.parallel.token_outputs import TokenOutputs, is_scalar_head
from spinwheel.parallel.trainer import Batch

# Activation memory a micro-batch of the automatic token budget takes (about): with the weights, the engine's KV pool
# and the runtime, a LoRA step of SmolLM2-135M stays under 4 GB.
ACTIVATION_BYTES = 2**30


@dataclass(frozen=True)
class RowSpans:
    """Per row: tokens fed (``ends``: positions 0 … end − 1) and the first scored label (``starts``)."""

    starts: list[int]
    ends: list[int]

    @classmethod
    def of(cls, batch: Batch) -> RowSpans:
        b, t = batch["input_ids"].shape
        if "prompt_lens" not in batch or "completion_lens" not in batch:
            return cls([0] * b, [t] * b)
        n, c = batch["prompt_lens"].tolist(), batch["completion_lens"].tolist()
        ends = [max(0, min(t, p + k - 1)) for p, k in zip(n, c)]
        return cls([min(max(0, p - 1), e) for p, e in zip(n, ends)], ends)


def shared_prefixes(batch: Batch) -> list[int]:
    """Per row, the tokens a shared-prompt forward does not run again for it: its prompt when the row before has
    the same one (a GRPO group's rows are consecutive), else 0."""
    ids, n = batch["input_ids"], batch["prompt_lens"].tolist()
    same = [i > 0 and n[i] == n[i - 1] and torch.equal(ids[i, : n[i]], ids[i - 1, : n[i]]) for i in range(len(n))]
    return [n[i] if same[i] else 0 for i in range(len(n))]


def plan_microbatches(lengths: list[int], budget: int, shared: list[int] | None = None) -> list[range]:
    """Consecutive rows in micro-batches of at most ``budget`` tokens run (a row over the budget goes alone); row i
    costs ``lengths[i]`` less ``shared[i]`` (what it shares with the row before) when that row is in the micro-batch
    too. ``budget`` 0: one micro-batch of every row."""
    if budget < 0:
        raise ValueError(f"the micro-batch token budget must be ≥ 0 (0: off), got {budget}")
    if budget == 0 or not lengths:
        return [range(len(lengths))]
    shared = shared or [0] * len(lengths)
    plan, start, used = [], 0, 0
    for i, n in enumerate(lengths):
        cost = n - shared[i] if i > start else n
        if i > start and used + cost > budget:
            plan.append(range(start, i))
            start, used, cost = i, 0, n
        used += cost
    plan.append(range(start, len(lengths)))
    return plan


def activation_bytes_per_token(config) -> int:
    """Bytes one token's activations take until the backward in a decoder block stack (fp32; what autograd keeps
    per layer: ~16 hidden-size vectors — norms, q/k/v, rotary, attention in and out — and ~5 of the MLP's width).
    Measured on SmolLM2-135M under LoRA: 2.1 MB per token over its 30 layers (``tests/test_packing.py``)."""
    return config.num_hidden_layers * (16 * config.hidden_size + 5 * config.intermediate_size) * 4


def auto_micro_batch_tokens(config, activation_bytes: int = ACTIVATION_BYTES) -> int:
    """The token budget whose activations take about ``activation_bytes`` (at least 64 tokens)."""
    return max(64, activation_bytes // activation_bytes_per_token(config))


def rows_of(batch: Batch, rows: range) -> Batch:
    """The micro-batch ``rows`` of every per-row tensor (views, no copies)."""
    return {k: v[rows.start : rows.stop] for k, v in batch.items()}


def packed_outputs(
    model: Transformer, batch: Batch, spans: RowSpans, entropy: bool, temperature: float = 1.0
) -> TokenOutputs:
    """:class:`TokenOutputs` (b, T) of right-padded rows from one padding-free packed forward (module docstring)."""
    ids, device = batch["input_ids"], batch["input_ids"].device
    b, t = ids.shape
    tokens, positions, src, dst, bounds = [], [], [], [], [0]
    for i, (start, end) in enumerate(zip(spans.starts, spans.ends)):
        if end == 0:
            continue  # nothing fed or scored (a failed episode's empty row)
        base = bounds[-1]
        tokens.append(ids[i, :end])
        positions.append(torch.arange(end, device=device))
        src.append(torch.arange(base + start, base + end, device=device))  # packed index of each scored position
        dst.append(torch.arange(i * t + start, i * t + end, device=device))  # its place in the flat (b, T) rows
        bounds.append(base + end)
    scalar = is_scalar_head(model.config)
    out = TokenOutputs()
    if not tokens:
        zeros = torch.zeros(b, t, device=device)
        out.values, out.logprobs = (zeros, None) if scalar else (None, zeros)
        out.entropy = zeros if entropy and not scalar else None
        return out
    hidden = model(
        torch.cat(tokens)[None],
        positions=torch.cat(positions)[None],
        attn_metadata=AttentionMask(None, segments=tuple(bounds)),
        return_hidden=True,
    )[0]  # (N, C)
    where, picked = torch.cat(dst), hidden.index_select(0, torch.cat(src))  # (M,), (M, C)

    def unpack(x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(b * t).index_copy(0, where, x).view(b, t)

    if scalar:
        out.values = unpack(model.lm_head(picked)[:, 0].float())
        return out
    labels = batch["labels"].reshape(-1).index_select(0, where)
    logp, ent = chunked_token_logprobs(picked, model.lm_head, labels, temperature=temperature, entropy=entropy)
    out.logprobs = unpack(logp)
    out.entropy = unpack(ent) if ent is not None else None
    return out
