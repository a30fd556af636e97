"""Checkpointed activations in one pre-allocated contiguous buffer: ZeRO-R's memory defragmentation (MD) applied to
the inputs re-materialisation keeps (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", §6.3; DeepSpeed's ``contiguous_memory_optimization`` for activation checkpoints).

Why: without it every checkpoint is an allocation of its own that lives from its region's forward to its backward,
while the short-lived activations of the blocks in between are allocated and freed around it. Long- and short-lived
blocks then interleave in the allocator's memory, and a large request can fail with enough memory free in total.
With it, a checkpoint's kept tensor (the whole input, or its 1/tp slice under Pa) is copied into a *slot* of one
buffer allocated once, and the rest of memory holds only short-lived tensors. The price is one copy of each kept
tensor per forward (the unpartitioned store otherwise keeps the input tensor itself, without a copy).

Sizing. How many bytes a step's checkpoints hold at once depends on the mode, the micro-batch shapes and, under
1F1B, on the micro-batches in flight, so the buffer measures it. Until it has a size, each checkpoint is allocated
on its own (counted in :attr:`CheckpointBuffer.num_allocations`) and the most bytes live at once are recorded. At
the first *quiescent* point (no checkpoint live: the end of a step's, or a micro-batch's, backward) the buffer is
allocated at that peak: one storage, counted once. Later steps take their slots from it (first fit, freed slots
merged with their neighbours) and allocate nothing. A step that needs more (longer sequences, more micro-batches
in flight) takes what does not fit from overflow allocations, and at the next quiescent point the buffer is
re-allocated at the larger size, with the reason in :attr:`CheckpointBuffer.growths`. It never shrinks. A buffer
cannot grow in place — live slots are views of its storage — hence the wait for quiescence.

Lifetime. A slot is freed when its :class:`CheckpointSlot` is collected. The store hands the slot to the region as
the kept tensor's meta, so the slot lives exactly as long as the region: until autograd releases the region's
saved tensors (after its backward, or when the graph is dropped; a retained graph keeps it).

Every slot starts on an ``ALIGN``-byte boundary, so the buffer holds Σ ⌈bytes / ALIGN⌉·ALIGN over the checkpoints
live at the peak; kept tensors whose sizes are multiples of ALIGN (any hidden state with C a multiple of 4, in
fp32) make that exactly the sum of their bytes.
"""

from __future__ import annotations

import math

import torch

ALIGN = 16  # bytes: every slot starts where any dtype's elements (and vectorised kernels) may start


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class CheckpointSlot:
    """One kept tensor's place: ``tensor`` is a view of the buffer (``offset`` set) or an overflow allocation of its
    own (``offset`` None); collecting the slot frees the place."""

    __slots__ = ("tensor", "offset", "nbytes", "_owner")

    def __init__(self, owner: CheckpointBuffer, tensor: torch.Tensor, offset: int | None, nbytes: int) -> None:
        self.tensor, self.offset, self.nbytes, self._owner = tensor, offset, nbytes, owner

    def __del__(self) -> None:
        self._owner._release(self.offset, self.nbytes)


class CheckpointBuffer:
    """One contiguous storage for every checkpoint of a model on this rank (see the module docstring)."""

    def __init__(self) -> None:
        self.storage: torch.Tensor | None = None  # (capacity,) uint8; every in-buffer slot is a view of it
        self.num_allocations = 0  # storages allocated for checkpoints: overflow slots and the buffer itself
        self.growths: list[str] = []  # one line per (re)allocation of the buffer, saying why
        self.live_bytes = 0  # aligned bytes of live slots, in the buffer and overflow
        self._holes: list[list[int]] = []  # free [offset, nbytes] ranges of the buffer, by offset
        self._peak = 0  # the most live bytes since the last quiescent point
        self._overflow = self._overflow_peak = 0  # live overflow bytes, and their most since then
        self._device: torch.device | None = None
        self._pin = False

    @property
    def capacity(self) -> int:
        """Bytes of the buffer (0 before the first quiescent point)."""
        return 0 if self.storage is None else self.storage.numel()

    def keep(self, x: torch.Tensor, pin_memory: bool = False) -> CheckpointSlot:
        """A slot holding a copy of ``x`` (same shape, dtype and device)."""
        slot = self.allocate(x.shape, x.dtype, x.device, pin_memory)
        slot.tensor.copy_(x.detach())
        return slot

    def allocate(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device, pin_memory: bool = False
    ) -> CheckpointSlot:
        """An uninitialised slot of ``shape`` and ``dtype``: a view of the buffer when it fits, else an overflow
        allocation (recorded, so the buffer grows at the next quiescent point)."""
        device = torch.device(device)
        if self._device is not None and device != self._device:
            raise ValueError(
                f"a checkpoint buffer lives on one device: it holds {self._device} checkpoints, asked for {device}; "
                "use one buffer per device"
            )
        self._device, self._pin = device, pin_memory
        if self.live_bytes == 0:
            self._settle()  # retries a resize whose allocation failed when the last slot was freed
        nbytes = math.prod(shape) * dtype.itemsize
        size = _aligned(nbytes)
        offset = self._take(size)
        self.live_bytes += size
        self._peak = max(self._peak, self.live_bytes)
        if offset is None:
            self.num_allocations += 1
            self._overflow += size
            self._overflow_peak = max(self._overflow_peak, self._overflow)
            tensor = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory)
        else:
            # A tensor on the buffer's storage with a version counter of its own (not an autograd view of the
            # buffer): writing the next slot must not look like an in-place change of the ones already saved.
            tensor = torch.empty(0, dtype=dtype, device=device)
            tensor.set_(self.storage.untyped_storage(), offset // dtype.itemsize, torch.Size(shape))
        return CheckpointSlot(self, tensor, offset, size)

    def _take(self, size: int) -> int | None:
        for hole in self._holes:
            if hole[1] >= size:
                offset = hole[0]
                hole[0] += size
                hole[1] -= size
                if hole[1] == 0:
                    self._holes.remove(hole)
                return offset
        return None

    def _release(self, offset: int | None, size: int) -> None:
        self.live_bytes -= size
        if offset is None:
            self._overflow -= size
        else:
            self._give_back(offset, size)
        if self.live_bytes == 0:
            self._settle()

    def _give_back(self, offset: int, size: int) -> None:
        i = next((i for i, h in enumerate(self._holes) if h[0] > offset), len(self._holes))
        self._holes.insert(i, [offset, size])
        if i + 1 < len(self._holes) and offset + size == self._holes[i + 1][0]:
            self._holes[i][1] += self._holes.pop(i + 1)[1]
        if i > 0 and self._holes[i - 1][0] + self._holes[i - 1][1] == offset:
            self._holes[i - 1][1] += self._holes.pop(i)[1]

    def _settle(self) -> None:
        """At a quiescent point: (re)allocate the buffer if checkpoints overflowed it since the last one."""
        if self._overflow_peak:
            # Overflow beyond the peak can only come from holes too small for a slot: make room for it as well.
            need = max(self._peak, self.capacity + self._overflow_peak)
            if self.storage is None:
                reason = f"sized at {need} bytes: the most the first step's checkpoints held at once"
            else:
                reason = (
                    f"grown from {self.capacity} to {need} bytes: a later step's checkpoints held {self._peak} bytes "
                    f"at once, {self._overflow_peak} of them outside the buffer (larger or more inputs in flight)"
                )
            self.storage, self._holes = None, []  # the old storage goes first: its memory may serve the new one
            self.storage = torch.empty(need, dtype=torch.uint8, device=self._device, pin_memory=self._pin)
            self._holes = [[0, need]]
            self.num_allocations += 1
            self.growths.append(reason)
        self._peak = self._overflow_peak = 0
