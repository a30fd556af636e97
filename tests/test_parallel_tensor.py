"""Megatron tensor-parallel pieces against their dense counterparts on 2 spawned ranks: the vocab-parallel
cross-entropy (value and gradient) never gathering the logits, and a column→row MLP pair with the f/g operators."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spinwheel.parallel import ParallelDims, spawn
from spinwheel.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)


def _pieces(rank: int, world_size: int) -> dict:
    dims = ParallelDims.create(tp=2)
    axis, comm = dims.tp_axis, dims.comm
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 10, generator=gen) * 3
    targets = torch.randint(0, 10, (6,), generator=gen)
    # Dense reference.
    dense = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(dense, targets, reduction="none")
    (ref * torch.arange(1.0, 7.0)).sum().backward()
    # Sharded: this rank's vocabulary slice only.
    local = logits.chunk(2, dim=-1)[axis.rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, targets, axis, comm)
    (loss * torch.arange(1.0, 7.0)).sum().backward()
    ce_err = (loss - ref).abs().max().item()
    grad_err = (local.grad - dense.grad.chunk(2, dim=-1)[axis.rank]).abs().max().item()

    # Column -> row MLP (Megatron Fig. 3a) and the vocab-parallel embedding.
    up, down = nn.Linear(8, 16), nn.Linear(16, 8)
    emb = nn.Embedding(10, 8)
    for m in (up, down, emb):
        for p in m.parameters():
            p.data = torch.randn(p.shape, generator=gen)
    x = torch.randn(3, 8, generator=gen, requires_grad=True)
    ref_out = down(torch.relu(up(x)))
    ref_out.sum().backward()
    col, row = ColumnParallelLinear(up, axis, comm), RowParallelLinear(down, axis, comm)
    xp = x.detach().clone().requires_grad_(True)
    out = row(torch.relu(col(xp)))
    out.sum().backward()
    ids = torch.randint(0, 10, (2, 5), generator=gen)
    emb_err = (VocabParallelEmbedding(emb, axis, comm)(ids) - emb(ids)).abs().max().item()
    return dict(
        ce=ce_err,
        grad=grad_err,
        mlp=(out - ref_out).abs().max().item(),
        x_grad=(xp.grad - x.grad).abs().max().item(),
        w_grad=(col.weight.grad - up.weight.grad.chunk(2, dim=0)[axis.rank]).abs().max().item(),
        emb=emb_err,
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_tensor_parallel_pieces_match_dense():
    for res in spawn(_pieces, 2, timeout_s=90):
        for key, err in res.items():
            assert err < 1e-5, (key, err)
