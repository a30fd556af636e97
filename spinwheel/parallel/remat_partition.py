"""How a checkpoint keeps its input: whole, or partitioned across the tensor-parallel group (ZeRO-R's Pa and Pa+cpu;
Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", §6.1 and §7).

Under Megatron tensor parallelism every rank of a TP group holds the same block input x (B, T, C): each sub-layer
ends with the g all-reduce, so the one activation a checkpoint keeps is replicated tp times across the group. Pa
keeps only this rank's 1/tp slice of the flattened input (padded to equal slices) and all-gathers the slices right
before the region is recomputed in backward: one all-gather of |x| per checkpoint (counted by the
:class:`~spinwheel.parallel.comm.Comm` on the ``tp`` axis) buys (tp−1)/tp of the checkpoint memory.

Pa+cpu also moves the slice to host memory (pinned, copied without blocking) and back before the all-gather. On a
machine without a GPU the slice already lives in host memory: there the "offload" is the slice's own copy and saves
nothing beyond Pa — the measured bytes say so, nothing is assumed.

A store has two methods: ``pack(x) -> (tensor to save, meta)`` when the region starts, and ``unpack(saved, meta) ->
x`` before recomputation. The region saves ``tensor to save`` through autograd, so memory accounting sees it.

Either store may take a :class:`~spinwheel.parallel.remat_buffer.CheckpointBuffer` (MD): what it keeps — the whole
input, a slice, or whole token ids — is then written into a slot of that one contiguous buffer instead of an
allocation of its own, and the slot rides along as (part of) the meta, so it is freed with the region.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spinwheel.parallel.comm import Comm
from spinwheel.parallel.mesh import Axis
from spinwheel.parallel.remat_buffer import CheckpointBuffer, CheckpointSlot


def _keep_whole(x: torch.Tensor, buffer: CheckpointBuffer | None) -> tuple[torch.Tensor, CheckpointSlot | None]:
    """x itself (no copy), or its copy in a slot of ``buffer``."""
    if buffer is None:
        return x.detach(), None
    slot = buffer.keep(x)
    return slot.tensor, slot


class WholeInput:
    """The unpartitioned store: a checkpoint keeps its input tensor itself (no copy), or with a ``buffer`` (MD) its
    copy in a slot of that buffer — a copy, so the caller may free the input's own storage."""

    def __init__(self, buffer: CheckpointBuffer | None = None) -> None:
        self.buffer = buffer

    @property
    def copies_input(self) -> bool:
        return self.buffer is not None

    def pack(self, x: torch.Tensor) -> tuple[torch.Tensor, CheckpointSlot | None]:
        return _keep_whole(x, self.buffer)

    def unpack(self, saved: torch.Tensor, meta: CheckpointSlot | None) -> torch.Tensor:
        return saved


@dataclass(frozen=True)
class _PartitionMeta:
    shape: torch.Size
    numel: int
    device: torch.device
    slot: CheckpointSlot | None  # the buffer place the slice lives in (MD), freed with this meta


@dataclass(frozen=True)
class PartitionedInput:
    """Pa: keep this rank's slice of a TP-replicated input; ``offload`` (Pa+cpu) keeps the slice in host memory.

    Integer inputs (the first pipeline stage's token ids, 1/C of a hidden state and held by the caller anyway) are
    kept whole. With a ``buffer`` (MD) the slices (and whole ids) live in its slots."""

    axis: Axis
    comm: Comm
    offload: bool = False
    buffer: CheckpointBuffer | None = None
    copies_input = True  # a floating input's storage is no longer needed by the region once packed

    def slice_size(self, numel: int) -> int:
        """Elements each rank keeps of an input of ``numel`` elements: ⌈numel / tp⌉ (the last slice is padded)."""
        return -(-numel // self.axis.size)

    def pack(self, x: torch.Tensor) -> tuple[torch.Tensor, _PartitionMeta | CheckpointSlot | None]:
        if not x.is_floating_point():
            return _keep_whole(x, self.buffer)
        flat = x.detach().reshape(-1)  # (N,)
        n = self.slice_size(flat.numel())
        start = min(self.axis.rank * n, flat.numel())
        own = flat[start : start + n]
        # A tensor of its own of n elements (fresh, or a buffer slot): a view would keep the whole input alive.
        device, pin = torch.device("cpu") if self.offload else x.device, self._pin(x)
        slot = self.buffer.allocate((n,), x.dtype, device, pin) if self.buffer is not None else None
        part = slot.tensor if slot is not None else torch.empty(n, dtype=x.dtype, device=device, pin_memory=pin)
        part[: own.numel()].copy_(own, non_blocking=pin)
        part[own.numel() :].zero_()  # the last rank's padding
        return part, _PartitionMeta(x.shape, flat.numel(), x.device, slot)

    def unpack(self, saved: torch.Tensor, meta: _PartitionMeta | CheckpointSlot | None) -> torch.Tensor:
        if not isinstance(meta, _PartitionMeta):  # kept whole
            return saved
        part = saved.to(meta.device, non_blocking=True)  # (n,)
        full = torch.empty(part.numel() * self.axis.size, dtype=part.dtype, device=meta.device)  # (tp·n,)
        self.comm.all_gather(full, part, self.axis)
        return full[: meta.numel].view(meta.shape)

    def _pin(self, x: torch.Tensor) -> bool:
        return self.offload and x.device.type == "cuda"
