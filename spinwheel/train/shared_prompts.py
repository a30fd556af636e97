"""Rollout rows that share prompts, forwarded with each distinct prompt run once: a GRPO group's G completions of
one prompt become one packed row ``prompt · completion₀[:-1] · completion₁[:-1] · …`` with a block mask, so the
trainer's forwards (reference and update) process ``P·n + Σ c`` tokens instead of ``B·(n + c)``. Used by
:func:`spinwheel.train.local_outputs.local_outputs` where a FLOP estimate says it is cheaper (short completions)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spinwheel.models.transformer import AttentionMask, Transformer
from spinwheel.parallel.chunked_logprobs import chunked_token_logprobs
from spinwheel.parallel.token_outputs import TokenOutputs
from spinwheel.parallel.trainer import Batch

# Pack shared prompts only when the FLOP estimate is below this share of the plain batch's: the block-masked
# attention runs slower per FLOP than the plain causal kernel (measured: a 0.6 estimate ran at ≈ 0.5 of the time).
PACKING_MARGIN = 0.8


def _flops_per_token(config, context: float) -> float:
    """Forward FLOPs of one token through the decoder (projections, plus attention over ``context`` keys)."""
    c, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    return config.num_hidden_layers * (2 * (2 * c * q + 2 * c * kv + 3 * c * i) + 4 * context * q)


def plain_cost(config, rows: int, length: int) -> float:
    """Forward FLOPs of a right-padded (rows, length) batch; causal attention sees half the row on average."""
    return rows * length * _flops_per_token(config, length / 2)


@dataclass
class SharedPrompts:
    """The packed layout of :func:`shared_prompt_outputs`: one row per distinct prompt (lists of ints)."""

    tokens: list[list[int]]
    positions: list[list[int]]
    segments: list[list[int]]  # -1: prompt; j: the row's j-th completion
    src: list[int]  # flat index (row · L + k) of the hidden state that predicts each completion label
    tgt: list[int]  # that label
    dst: list[int]  # where its log-prob goes in the flattened (B, T) output

    @property
    def length(self) -> int:
        return max(len(x) for x in self.tokens)

    def cost(self, config) -> float:
        """Forward FLOPs: every packed token attends over the whole row (a block mask skips nothing)."""
        return len(self.tokens) * self.length * _flops_per_token(config, self.length)

    @classmethod
    def of(cls, batch: Batch) -> SharedPrompts | None:
        """Group the rows by prompt (``batch["prompt_lens"]``, ``["completion_lens"]``); None without completions."""
        ids, labels = batch["input_ids"].tolist(), batch["labels"].tolist()
        lens, t = batch["completion_lens"].tolist(), batch["input_ids"].shape[1]
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, n in enumerate(batch["prompt_lens"].tolist()):
            if lens[i] > 0:
                groups.setdefault(tuple(ids[i][:n]), []).append(i)
        if not groups:
            return None
        out = cls([], [], [], [], [], [])
        pairs: list[tuple[int, int]] = []  # (packed row, index in it)
        for r, (prompt, rows) in enumerate(groups.items()):
            n = len(prompt)
            row_tokens, row_pos, row_seg = list(prompt), list(range(n)), [-1] * n
            for j, i in enumerate(rows):
                c, start = lens[i], len(row_tokens)
                row_tokens += ids[i][n : n + c - 1]  # the completion's last token is only a label
                row_pos += range(n, n + c - 1)
                row_seg += [j] * (c - 1)
                pairs += [(r, n - 1)] + [(r, start + k) for k in range(c - 1)]
                out.tgt += labels[i][n - 1 : n - 1 + c]
                out.dst += range(i * t + n - 1, i * t + n - 1 + c)
            out.tokens.append(row_tokens)
            out.positions.append(row_pos)
            out.segments.append(row_seg)
        length = out.length  # a property over every row: once, not once per pair
        out.src = [r * length + k for r, k in pairs]
        return out


def shared_prompt_outputs(
    model: Transformer, batch: Batch, packed: SharedPrompts, entropy: bool, temperature: float = 1.0
) -> TokenOutputs:
    """:func:`local_outputs` of rollout rows (``prompt + completion``, right-padded) with every distinct prompt run
    once for all the completions that continue it — G of them in a GRPO group — instead of once per row.

    ``batch["prompt_lens"]`` / ``["completion_lens"]`` (B,) give row i's prompt length n_i and completion length c_i
    (labels ``n_i − 1 .. n_i + c_i − 2`` are its completion). The rows of one prompt become one packed row,
    ``prompt · completion₀[:-1] · completion₁[:-1] · …``, each completion at positions ``n, n+1, …`` and attending to
    the prompt and causally to itself only (a block mask), so every token sees exactly the context it has in its own
    row: the same log-probs up to float rounding, for ``P·n + Σ c`` tokens instead of ``B·(n + c)`` — but attention
    over the whole packed row, so :func:`local_outputs` packs only where that is cheaper (short completions). The last
    prompt token predicts every completion's first token. Returns (B, T) log-probs (and entropy) at the completion
    labels, 0 elsewhere.
    """
    b, t = batch["input_ids"].shape
    length, device = packed.length, batch["input_ids"].device

    def padded(rows: list[list[int]], fill: int) -> torch.Tensor:
        return torch.tensor([x + [fill] * (length - len(x)) for x in rows], dtype=torch.long, device=device)

    seg = padded(packed.segments, -2)  # (P, L); padding is its own segment, so padded queries see something
    q_idx = torch.arange(length, device=device)
    causal = q_idx[None, :] <= q_idx[:, None]  # (L, L): key ≤ query
    allowed = causal & ((seg[:, None, :] == -1) | (seg[:, None, :] == seg[:, :, None]))  # (P, L, L)
    hidden = model(
        padded(packed.tokens, 0),
        positions=padded(packed.positions, 0),
        attn_metadata=AttentionMask(allowed[:, None]),
        return_hidden=True,
    )  # (P, L, C)
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, torch.tensor(packed.src, device=device))
    where, labels = torch.tensor(packed.dst, device=device), torch.tensor(packed.tgt, device=device)
    # (M,) with M = Σ c, the (M, V) logits a chunk of rows at a time
    logp, ent = chunked_token_logprobs(picked, model.lm_head, labels, temperature=temperature, entropy=entropy)
    out = TokenOutputs(logprobs=logp.new_zeros(b * t).index_copy(0, where, logp).view(b, t))
    if ent is not None:
        out.entropy = ent.new_zeros(b * t).index_copy(0, where, ent).view(b, t)
    return out
