"""Column- and row-parallel linear layers on their own (Megatron-LM §3), on 2 spawned gloo ranks, against the dense
``nn.Linear`` holding the same full weights (fp32): the forward output, and in backward the input gradient dX, the
weight gradient dW and the bias gradient, each the rank's slice of the dense one where the layer shards it.

* ``ColumnParallelLinear(gather_output=True)`` returns the full (..., out) output: ``f`` then an all-gather of the last
  dim (whose backward hands each rank its slice of the gradient); with ``gather_output=False`` the output is the
  rank's slice (..., out/tp);
* ``RowParallelLinear(input_is_parallel=False)`` takes the replicated (..., in) input and splits it (the split's
  backward all-gathers dX back to (..., in)); with ``input_is_parallel=True`` the input is already the rank's slice.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spinwheel.parallel import Axis, Comm, ParallelDims, spawn
from spinwheel.parallel.tensor import ColumnParallelLinear, RowParallelLinear

TP, SHAPE, IN, OUT = 2, (3, 5), 8, 12
TOL = 1e-6  # relative to the largest entry


def _dense(in_features: int, out_features: int, gen: torch.Generator) -> nn.Linear:
    dense = nn.Linear(in_features, out_features)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(dense.weight.shape, generator=gen) / in_features**0.5)
        dense.bias.copy_(torch.randn(dense.bias.shape, generator=gen))
    return dense


def _mine(t: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
    return t.chunk(TP, dim=dim)[rank]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest entry (fp32 rounding: ~1e-7)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def _column(dims: ParallelDims, gather_output: bool, gen: torch.Generator) -> dict:
    axis, comm, r = dims.tp_axis, dims.comm, dims.tp_axis.rank
    dense = _dense(IN, OUT, gen)
    x = torch.randn(*SHAPE, IN, generator=gen, requires_grad=True)
    grad_y = torch.randn(*SHAPE, OUT, generator=gen)  # the loss is Σ y · grad_y
    y = dense(x)
    (y * grad_y).sum().backward()

    layer = ColumnParallelLinear(dense, axis, comm, gather_output=gather_output)
    xp = x.detach().clone().requires_grad_(True)
    comm.stats.reset()
    yp = layer(xp)
    forward = dict(comm.stats.elements)
    # Without gathering, each rank holds its slice of y and of the loss; the slices' losses sum to the dense one.
    (yp * (grad_y if gather_output else _mine(grad_y, -1, r))).sum().backward()
    return dict(
        errors=dict(
            y=_err(yp, y if gather_output else _mine(y, -1, r)),
            dx=_err(xp.grad, x.grad),
            dw=_err(layer.weight.grad, _mine(dense.weight.grad, 0, r)),
            db=_err(layer.bias.grad, _mine(dense.bias.grad, 0, r)),
        ),
        forward=forward,
        total=dict(comm.stats.elements),
    )


def _row(dims: ParallelDims, input_is_parallel: bool, gen: torch.Generator) -> dict:
    axis, comm, r = dims.tp_axis, dims.comm, dims.tp_axis.rank
    dense = _dense(OUT, IN, gen)
    x = torch.randn(*SHAPE, OUT, generator=gen, requires_grad=True)
    grad_y = torch.randn(*SHAPE, IN, generator=gen)
    y = dense(x)
    (y * grad_y).sum().backward()

    layer = RowParallelLinear(dense, axis, comm, input_is_parallel=input_is_parallel)
    xp = (_mine(x, -1, r) if input_is_parallel else x).detach().clone().requires_grad_(True)
    comm.stats.reset()
    yp = layer(xp)
    forward = dict(comm.stats.elements)
    (yp * grad_y).sum().backward()
    return dict(
        errors=dict(
            y=_err(yp, y),
            dx=_err(xp.grad, _mine(x.grad, -1, r) if input_is_parallel else x.grad),
            dw=_err(layer.weight.grad, _mine(dense.weight.grad, 1, r)),
            db=_err(layer.bias.grad, dense.bias.grad),  # the bias is whole on every rank, added after the reduction
        ),
        forward=forward,
        total=dict(comm.stats.elements),
    )


def _layers(rank: int, world_size: int) -> dict:
    dims = ParallelDims.create(tp=TP)
    out = {}
    for flag in (True, False):
        out["column", flag] = _column(dims, flag, torch.Generator().manual_seed(1))
        out["row", flag] = _row(dims, flag, torch.Generator().manual_seed(2))
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_layers, TP, timeout_s=120)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("gather_output", [True, False])
def test_column_parallel_linear_matches_dense(results, gather_output):
    n = SHAPE[0] * SHAPE[1]
    for res in results:
        got = res["column", gather_output]
        assert max(got["errors"].values()) < TOL, got["errors"]
        # ZeRO accounting: the all-gather of y counts its full size, the backward all-reduce of dX twice its size.
        assert got["forward"] == ({"all_gather": n * OUT} if gather_output else {})
        assert got["total"] == {**got["forward"], "all_reduce": 2 * n * IN}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear_matches_dense(results, input_is_parallel):
    n = SHAPE[0] * SHAPE[1]
    for res in results:
        got = res["row", input_is_parallel]
        assert max(got["errors"].values()) < TOL, got["errors"]
        assert got["forward"] == {"all_reduce": 2 * n * IN}
        assert got["total"] == {**got["forward"], **({} if input_is_parallel else {"all_gather": n * OUT})}


def test_layers_refuse_features_the_degree_does_not_divide():
    axis = Axis("tp", (0, 1), 0)  # constructing a layer communicates nothing: no process group needed
    with pytest.raises(ValueError, match="out_features"):
        ColumnParallelLinear(nn.Linear(4, 5), axis, Comm())
    with pytest.raises(ValueError, match="in_features"):
        RowParallelLinear(nn.Linear(5, 4), axis, Comm())
