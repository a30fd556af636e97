"""One FSDP unit: a group of parameters flattened into one padded vector and sharded over the ``dp_shard`` axis
(Zhao et al., 2023, §3.2 "FlatParameter"; the rest of the protocol is in :mod:`spinwheel.parallel.data.fsdp`).

The shard (s,) is an ``nn.Parameter`` in the model's dtype — the master the optimizer steps. The gathered flat buffer
``full`` (N·s,) is an autograd leaf in the compute dtype (:class:`~spinwheel.parallel.data.mixed_precision.
MixedPrecisionPolicy`) whose storage is resized to 0 while the unit is sharded; while gathered, the modules read views
of it. Gathers go through :class:`~spinwheel.parallel.data.buffers.CommBuffers` (piece by piece under constant-size
buffers).
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch
from torch import nn

from spinwheel.parallel.data.buffers import CommBuffers, PendingOp
from spinwheel.parallel.mesh import Axis


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class FlatParamUnit:
    """The parameters of one module (not inside another unit), flattened and sharded; ``compute_dtype`` is the dtype
    they are gathered in (None: the parameters' own). ``read_shard(params, lo, hi)``: elements [lo, hi) of the
    flattened parameters (a lazy load's reader, :mod:`~spinwheel.parallel.io.lazy_load`), instead of the values the
    parameters hold."""

    def __init__(
        self,
        name: str,
        refs: list[tuple[str, nn.Module, str, nn.Parameter]],
        shard_axis: Axis,
        compute_dtype: torch.dtype | None = None,
        read_shard: Callable[[list[torch.Tensor], int, int], torch.Tensor] | None = None,
    ) -> None:
        self.name = name
        self.axis = shard_axis
        self.refs: list[tuple[str, nn.Module, str, int]] = []  # (full name, owner module, attribute, param index)
        params: list[nn.Parameter] = []
        index: dict[int, int] = {}
        for full_name, owner, attr, p in refs:
            if id(p) not in index:
                index[id(p)] = len(params)
                params.append(p)
            self.refs.append((full_name, owner, attr, index[id(p)]))
        self.shapes = [p.shape for p in params]
        self.sizes = [p.numel() for p in params]
        numel = sum(self.sizes)
        self.shard_size = -(-numel // shard_axis.size)
        padded = self.shard_size * shard_axis.size
        self.split_sizes = self.sizes + [padded - numel]
        dtype, device = params[0].dtype, params[0].device
        lo, hi = shard_axis.rank * self.shard_size, (shard_axis.rank + 1) * self.shard_size
        if read_shard is None:
            flat = torch.cat(
                [p.detach().reshape(-1) for p in params] + [torch.zeros(padded - numel, dtype=dtype, device=device)]
            )
            self.shard = nn.Parameter(flat[lo:hi].clone())  # (s,)
        else:  # a lazy load (parameters on the meta device): only this rank's elements are read
            self.shard = nn.Parameter(read_shard(params, lo, hi))
            flat = torch.empty(padded, dtype=compute_dtype or dtype, device=self.shard.device)  # no pages touched
        # The gathered flat buffer is an autograd leaf whose storage comes and goes.
        self.full = flat.to(compute_dtype or dtype).requires_grad_(True)  # (N·s,)
        self.nbytes = self.full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED
        self.ops: list[PendingOp] = []
        for _, owner, attr, _ in self.refs:
            owner._parameters.pop(attr, None)  # the module now reads a plain tensor attribute

    @property
    def padded_numel(self) -> int:
        return self.shard_size * self.axis.size

    # -- parameters ----------------------------------------------------------------------------------------------
    def unshard(self, buffers: CommBuffers, async_op: bool = False) -> None:
        if self.state is UnitState.SHARDED:
            self.full.untyped_storage().resize_(self.nbytes)
            self.ops = buffers.all_gather(self.full.data, self.shard.data)  # .data: no version bump for autograd
            self.state = UnitState.GATHERING
        if not async_op and self.state is UnitState.GATHERING:
            self._wait()
            self.state = UnitState.GATHERED

    def _wait(self) -> None:
        for op in self.ops:
            op.wait()
        self.ops = []

    def set_views(self) -> None:
        # split's backward concatenates the gradients into one flat tensor (one allocation, not one per parameter).
        pieces = torch.split(self.full, self.split_sizes)
        views = [piece.view(shape) for piece, shape in zip(pieces, self.shapes)]
        for _, owner, attr, i in self.refs:
            setattr(owner, attr, views[i])

    def reshard(self) -> None:
        if self.state is UnitState.GATHERING:
            self._wait()
        if self.state is not UnitState.SHARDED:
            self.full.untyped_storage().resize_(0)
            self.state = UnitState.SHARDED

    def full_tensors(self, buffers: CommBuffers) -> dict[str, torch.Tensor]:
        """Every parameter by full name (tied names each get the tensor), gathered from the masters in their own
        dtype (a checkpoint keeps fp32 weights under mixed precision)."""
        flat = torch.empty(self.padded_numel, dtype=self.shard.dtype, device=self.shard.device)  # (N·s,)
        buffers.comm.all_gather(flat, self.shard.detach(), self.axis)
        pieces = torch.split(flat, self.split_sizes)
        return {name: pieces[i].view(self.shapes[i]).clone() for name, _, _, i in self.refs}
