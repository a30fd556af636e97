"""Adam over parameters that live in one flat buffer: a handful of kernels per step whatever the layer count.

Reference: Kingma & Ba, "Adam" (2015), algorithm 1 (bias-corrected moments) — the update of
``torch.optim.Adam`` without weight decay, which the tests compare it against.

For the tiny MLPs of classic control, ``torch.optim.Adam`` spends most of its time in per-parameter Python
bookkeeping. Here every parameter's storage (and its ``.grad``) becomes a view into one flat tensor, so
zeroing, clipping, the data-parallel all-reduce and the Adam update are each one or a few whole-buffer ops.
Backward accumulates into the pre-set ``.grad`` views in place. Do not move the module to another device
afterwards (``.to()`` would re-home the parameters out of the buffer); ``load_state_dict`` is fine.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn


class FlatAdam:
    """Adam on ``params``, which are re-homed into :attr:`flat` (values) and :attr:`grad` (gradients)."""

    def __init__(
        self, params: Iterable[nn.Parameter], lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8
    ):
        self.params = list(params)
        self.lr, self.betas, self.eps = lr, betas, eps
        numel = sum(p.numel() for p in self.params)
        ref = self.params[0]
        self.flat = torch.zeros(numel, dtype=ref.dtype, device=ref.device)
        self.grad = torch.zeros_like(self.flat)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                self.flat[offset : offset + n].copy_(p.reshape(-1))
                p.data = self.flat[offset : offset + n].view_as(p)
                p.grad = self.grad[offset : offset + n].view_as(p)
                offset += n
        self.exp_avg = torch.zeros_like(self.flat)
        self.exp_avg_sq = torch.zeros_like(self.flat)
        self.num_steps = 0

    def zero_grad(self) -> None:
        self.grad.zero_()

    def clip_grad_norm(self, max_norm: float) -> Tensor:
        """Scale the gradient to norm ≤ ``max_norm`` (as ``nn.utils.clip_grad_norm_``); returns the prior norm."""
        norm = torch.linalg.vector_norm(self.grad)
        self.grad.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm

    @torch.no_grad()
    def step(self) -> None:
        beta1, beta2 = self.betas
        self.num_steps += 1
        bias1 = 1.0 - beta1**self.num_steps
        bias2 = 1.0 - beta2**self.num_steps
        self.exp_avg.lerp_(self.grad, 1.0 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(self.grad, self.grad, value=1.0 - beta2)
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(self.eps)
        self.flat.addcdiv_(self.exp_avg, denom, value=-self.lr / bias1)

    def state_dict(self) -> dict:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "num_steps": self.num_steps}
