"""Activation re-materialisation (Chen et al., 2016, "Training Deep Nets with Sublinear Memory Cost"; GPipe §2.3).

Each transformer block keeps only its input during forward; its internal activations are recomputed in backward
(``torch.utils.checkpoint``, non-reentrant). The block's ``forward`` is replaced on the instance rather than wrapped
in another module, so parameter names — and with them checkpoints, TP shard maps and FSDP units — stay unchanged,
and module hooks (FSDP's gather/free) still run around the block's call.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def _checkpointed_forward(block: nn.Module, *args, **kwargs):
    return checkpoint(type(block).forward, block, *args, use_reentrant=False, **kwargs)


def apply_remat(model: nn.Module) -> int:
    """Checkpoint every block in ``model.layers`` (ModuleList or ModuleDict); returns how many were wrapped."""
    layers = model.layers
    blocks = layers.values() if isinstance(layers, nn.ModuleDict) else layers
    count = 0
    for block in blocks:
        if not getattr(block, "_remat", False):
            block.forward = functools.partial(_checkpointed_forward, block)
            block._remat = True
            count += 1
    return count
