"""FSDP / ZeRO-3 mixed precision, after PyTorch FSDP2's ``MixedPrecisionPolicy`` (Micikevicius et al., 2018, "Mixed
Precision Training", for the fp32 master copy).

The sharded flat parameters stay in the model's dtype (fp32): they are the *masters* the optimizer steps. A unit's
all-gather casts this rank's shard to ``param_dtype`` and gathers in that dtype, so forward and backward run on
bf16 (or fp16) parameters and produce gradients in ``param_dtype``. Those are reduce-scattered (and all-reduced
across HSDP replicas) in ``reduce_dtype`` — fp32 for an exact sum of the ranks' bf16 gradients, or ``param_dtype`` to
halve the gradient traffic — divided by the data-parallel degree in that dtype, and accumulated into the fp32 shard
gradient the optimizer reads.

Per-rank bytes with Adam and fp32 masters (N = ``dp_shard``, Ψ the padded parameter count):
4Ψ/N masters + 4Ψ/N shard gradients + 8Ψ/N Adam moments, plus the gathered compute parameters of the units that
are unsharded at once, 2 bytes per element in bf16 (see :func:`fsdp_memory_formula`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``param_dtype``: dtype of the gathered (compute) parameters, None = the masters' dtype (no mixed precision);
    ``reduce_dtype``: dtype of the gradient reduce-scatter / all-reduce, None = ``param_dtype``."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and not value.is_floating_point:
                raise ValueError(f"MixedPrecisionPolicy.{name} must be a floating dtype, got {value}")

    def compute_dtype(self, master: torch.dtype) -> torch.dtype:
        return self.param_dtype or master

    def comm_dtype(self, master: torch.dtype) -> torch.dtype:
        return self.reduce_dtype or self.compute_dtype(master)


def fsdp_memory_formula(
    unit_numels: list[int], dp_shard: int, max_gathered: list[int], param_bytes: int = 2, master_bytes: int = 4
) -> dict[str, float]:
    """Predicted per-rank bytes of FSDP with fp32 masters and Adam.

    ``unit_numels``: each unit's parameter count padded to a multiple of ``dp_shard``; ``max_gathered``: indices of
    the units unsharded at the peak (e.g. the root, the current block and the prefetched one). Returns masters,
    shard gradients and optimizer (two Adam moments) — each Σ numel / N times its bytes — and the gathered compute
    parameters, Σ over ``max_gathered`` of numel · ``param_bytes``.
    """
    shard = sum(unit_numels) / dp_shard
    params = master_bytes * shard
    grads = master_bytes * shard
    optimizer = 2 * master_bytes * shard
    gathered = float(param_bytes * sum(unit_numels[i] for i in max_gathered))
    return {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "gathered": gathered,
        "total": params + grads + optimizer + gathered,
    }
