"""LoRA adapters under tensor parallelism: each factor split the way its base layer splits, so the adapter's update
``s · B A x`` rides on the base layer's own collectives (Megatron layouts, :mod:`spinwheel.parallel.tensor`).

* **Column-parallel** base (q, k, v, gate, up: W split on its output features): B (out, r) is split the same way
  (this rank's out/tp rows) and A (r, in) is replicated. Rank r computes ``W_r x + s B_r (A x)``: its slice of
  the output features, adapter included — no communication in forward.
* **Row-parallel** base (o, down: W split on its input features, the partial outputs summed by ``g``): A (r, in)
  is split on its input features and B (out, r) is replicated. Rank r computes ``W_r x_r + s B (A_r x_r)``, and the
  base's all-reduce sums ``Σ_r B A_r x_r = B A x`` along with ``Σ_r W_r x_r`` — again nothing extra in forward.

Backward, the replicated factor (A of a column layer, B of a row layer) gets only this rank's share of its
gradient (column: the out/tp rows of B that rank holds; row: its in/tp columns of A), so it enters the layer
through ``f`` (:func:`~spinwheel.parallel.tensor.copy_to_tp`: identity forward, all-reduce of the gradient
backward): one all-reduce of r·in (column) or out·r (row) elements per layer per backward — the adapter's own
size, against the (B, T, C) activations the base layers reduce. After it every tp rank holds the same gradient,
so the replicated factors stay equal and count once in the global gradient norm.

Each layer keeps the names of :class:`~spinwheel.models.lora.LoRALinear` (``weight``, ``lora_A.weight``,
``lora_B.weight``) and its switch ``enabled`` (:func:`~spinwheel.models.lora.adapters_disabled` turns these off
too), and reports the split dim of its sharded factor in ``shard_dims`` so checkpoints gather the full adapter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spinwheel.models.lora import LoRALinear
from spinwheel.parallel.comm import Comm
from spinwheel.parallel.mesh import Axis
from spinwheel.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    scatter_to_tp,
)


def _factor(linear: nn.Linear, dim: int | None, axis: Axis) -> nn.Linear:
    """The adapter factor ``linear`` as this rank holds it: whole (``dim`` None, the same module) or its slice."""
    if dim is None:
        return linear
    weight = linear.weight.detach().chunk(axis.size, dim=dim)[axis.rank].clone()
    part = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    part.weight = nn.Parameter(weight, requires_grad=linear.weight.requires_grad)
    return part


class _AdapterMixin:
    """The adapter state a tensor-parallel LoRA layer takes over from its :class:`LoRALinear`."""

    lora_A: nn.Linear
    lora_B: nn.Linear

    def _adopt(self, layer: LoRALinear, axis: Axis, a_dim: int | None, b_dim: int | None) -> None:
        self.lora_A = _factor(layer.lora_A, a_dim, axis)
        self.lora_B = _factor(layer.lora_B, b_dim, axis)
        self.lora_dropout = layer.lora_dropout
        self.config, self.rank, self.scaling = layer.config, layer.rank, layer.scaling
        self.enabled = layer.enabled

    def _delta(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """s · B A dropout(x) for this rank's factors ``a`` and ``b``, in ``dtype``."""
        h = x.to(a.dtype)
        if not torch.is_inference_mode_enabled():
            h = self.lora_dropout(h)
        return (F.linear(F.linear(h, a), b) * self.scaling).to(dtype)


class ColumnParallelLoRA(_AdapterMixin, ColumnParallelLinear):
    """A column-parallel :class:`LoRALinear`: W and B split on the output features, A replicated."""

    shard_dims = {"weight": 0, "bias": 0, "lora_B.weight": 0}

    def __init__(
        self, layer: LoRALinear, axis: Axis, comm: Comm, *, gather_output: bool = False, copy_input: bool = True
    ) -> None:
        ColumnParallelLinear.__init__(self, layer, axis, comm, gather_output=gather_output, copy_input=copy_input)
        self._adopt(layer, axis, a_dim=None, b_dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.axis, self.comm) if self.copy_input else x
        y = F.linear(x, self.weight, self.bias)  # (..., out/tp)
        if self.enabled:
            a = copy_to_tp(self.lora_A.weight, self.axis, self.comm)  # replicated: its gradient summed over tp
            y = y + self._delta(x, a, self.lora_B.weight, y.dtype)
        return gather_from_tp(y, self.axis, self.comm) if self.gather_output else y


class RowParallelLoRA(_AdapterMixin, RowParallelLinear):
    """A row-parallel :class:`LoRALinear`: W and A split on the input features, B replicated; the base's
    all-reduce sums the adapter's partial outputs too."""

    shard_dims = {"weight": 1, "lora_A.weight": 1}

    def __init__(self, layer: LoRALinear, axis: Axis, comm: Comm, *, input_is_parallel: bool = True) -> None:
        RowParallelLinear.__init__(self, layer, axis, comm, input_is_parallel=input_is_parallel)
        self._adopt(layer, axis, a_dim=1, b_dim=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x if self.input_is_parallel else scatter_to_tp(x, self.axis, self.comm)  # (..., in/tp)
        z = F.linear(x, self.weight)  # this rank's partial sum (..., out)
        if self.enabled:
            b = copy_to_tp(self.lora_B.weight, self.axis, self.comm)  # replicated: its gradient summed over tp
            z = z + self._delta(x, self.lora_A.weight, b, z.dtype)
        y = reduce_from_tp(z, self.axis, self.comm)
        return y + self.bias if self.bias is not None else y


def lora_column_layer(linear: nn.Linear, axis: Axis, comm: Comm) -> nn.Module:
    """:func:`~spinwheel.parallel.tensor.apply_tensor_parallel`'s ``column``: LoRA-aware."""
    if isinstance(linear, LoRALinear):
        return ColumnParallelLoRA(linear, axis, comm, copy_input=False)
    return ColumnParallelLinear(linear, axis, comm, copy_input=False)


def lora_row_layer(linear: nn.Linear, axis: Axis, comm: Comm) -> nn.Module:
    """:func:`~spinwheel.parallel.tensor.apply_tensor_parallel`'s ``row``: LoRA-aware."""
    if isinstance(linear, LoRALinear):
        return RowParallelLoRA(linear, axis, comm)
    return RowParallelLinear(linear, axis, comm)
