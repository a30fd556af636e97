"""Log-probabilities (and entropy) of chosen tokens from final hidden states, a chunk of rows at a time, so the
(tokens × vocab) fp32 logits never exist whole — forward or backward.

A vocabulary of 49,152 makes the logits of 32 rows × 160 tokens ≈ 1 GB in fp32, and ``log_softmax`` / its backward
make more of them. Here the output layer runs on ``chunk`` rows at a time: logits (chunk, V) → /T → logsumexp →
gather, and no chunk's logits are kept for backward (a custom autograd Function, as Liger-Kernel's fused linear
cross-entropy and Apple's Cut Cross-Entropy do; Wijmans et al. 2024). The gradient of ``log p(y) = z_y − lse(z)``
with ``z = h·Wᵀ / T`` is ``∂z = (onehot(y) − softmax(z)) · g / T``; it flows to the hidden states (``∂z · W``) and,
when the head trains, to its weight (``∂zᵀ · h``). A frozen head (LoRA) needs only the first, one C-vector per
position ``(W[y] − p·W) / T`` times g: computed in the forward from the chunk's softmax and kept, so the backward
recomputes nothing; a trained head recomputes each chunk's logits in the backward. The entropy ``lse − Σ p·z`` is
detached, as :class:`~spinwheel.parallel.token_outputs.TokenOutputs` has it.

Reference: the plain full-logits computation (``lm_head`` → ``/ T`` → ``token_logprobs``);
``tests/test_chunked_logprobs.py`` compares values and gradients to 1e-5 (fp32).
"""

from __future__ import annotations

import torch
from torch import nn

# Logits bytes (fp32) of one chunk: a few copies of this (logits, softmax, its gradient) is the extra memory.
CHUNK_BYTES = 32 * 2**20


def chunk_rows(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk so one chunk's fp32 logits take about ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * vocab_size))


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """(n, C) hidden states -> (n, V) fp32 logits / T, computed as the model's head does (its dtype, then fp32)."""
    z = (hidden @ weight.t()).float()
    return z / temperature if temperature != 1.0 else z


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature: float, rows: int, entropy: bool):  # type: ignore[override]
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n, dtype=torch.float32, device=hidden.device) if entropy else None
        # A frozen head (LoRA): log p(y_i) depends on h_i alone, so its gradient is one row per position,
        # ∂ log p(y_i) / ∂h_i = (W[y_i] − p_i·W) / T — kept (n, C) instead of recomputing the logits in backward.
        jac = torch.empty_like(hidden) if ctx.needs_input_grad[0] and not ctx.needs_input_grad[1] else None
        for s in range(0, n, rows):
            z = _chunk_logits(hidden[s : s + rows], weight, temperature)  # (rows, V)
            lse = torch.logsumexp(z, dim=-1)
            y = labels[s : s + rows]
            logp[s : s + rows] = z.gather(-1, y[:, None])[:, 0] - lse
            if ent is None and jac is None:
                continue
            z.sub_(lse[:, None])  # log p, in place: one (rows, V) buffer
            p = z.exp()
            if ent is not None:
                ent[s : s + rows] = -(p * z).sum(-1)
            if jac is not None:
                row = weight.index_select(0, y) - p.to(weight.dtype) @ weight  # (rows, C)
                jac[s : s + rows] = row / temperature if temperature != 1.0 else row
        ctx.save_for_backward(hidden if jac is None else jac, weight, labels)
        ctx.temperature, ctx.rows, ctx.jacobian = temperature, rows, jac is not None
        if ent is None:
            return logp, torch.zeros(0, device=hidden.device)
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):  # type: ignore[override]
        saved, weight, labels = ctx.saved_tensors
        if ctx.jacobian:
            return saved * grad_logp[:, None].to(saved.dtype), None, None, None, None, None
        hidden, t, rows = saved, ctx.temperature, ctx.rows
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        for s in range(0, hidden.shape[0], rows):  # a trained head: each chunk's logits recomputed
            h, g = hidden[s : s + rows], grad_logp[s : s + rows].float()
            dz = torch.softmax(_chunk_logits(h, weight, t), dim=-1).mul_(-g[:, None])  # (rows, V): −p·g
            dz.scatter_add_(-1, labels[s : s + rows, None], g[:, None])  # + onehot(y)·g
            if t != 1.0:
                dz.div_(t)
            dz = dz.to(hidden.dtype)
            if grad_h is not None:
                grad_h[s : s + rows] = dz @ weight
            if grad_w is not None:
                grad_w.addmm_(dz.t().float(), h.float())
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    head: nn.Linear,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(head(hidden) / T)[labels]`` (..., ) fp32 with gradient, and the detached entropy (..., ) when
    asked, from hidden states (..., C) and labels (...), ``rows`` positions at a time (default: :func:`chunk_rows`)."""
    if head.bias is not None:
        raise ValueError("chunked_token_logprobs takes a head without bias (the LM heads spinwheel loads have none)")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    shape = labels.shape
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    rows = rows or chunk_rows(head.weight.shape[0])
    logp, ent = _ChunkedLogprobs.apply(flat_h, head.weight, flat_y, float(temperature), rows, entropy)
    return logp.view(shape), ent.view(shape) if entropy else None
