"""Constant-size communication buffers (CB) and contiguous gradient memory (MD) for FSDP / ZeRO-3 — ZeRO-R's two
memory optimisations (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", §6, ZeRO-R).

**CB.** A unit's flat parameter (N·s,) is laid out rank-major: rank r's shard is elements [r·s, (r+1)·s). With a
buffer of B bytes, every all-gather and reduce-scatter of a unit is issued in *pieces* [lo, hi) of the shard
(n = hi − lo ≤ B / (N · element size) elements per rank, N·n in all), so no collective ever moves or stages more
than B bytes whatever the model size:

* all-gather piece: this rank's shard[lo:hi], cast to the compute dtype into the small staging (n,), is gathered into
  the large staging (N·n,) and copied into the strided columns ``full.view(N, s)[:, lo:hi]``;
* reduce-scatter piece: ``grad.view(N, s)[:, lo:hi]`` is copied (and cast to the reduce dtype) into the large
  staging (N·n,), reduce-scattered into the small staging (n,), and handed to the caller's ``finish``.

The staging buffers are a ring of ``num_slots`` slots per direction, allocated once; a piece that needs a busy slot
first waits for the collective that holds it (double buffering: one piece in flight while the next is staged), so at
most ``num_slots`` pieces are in flight and a prefetch of a unit of more pieces waits for its earlier ones — the
price of constant memory. A unit that fits one piece needs no copy-out: it gathers straight into ``full``, and
reduce-scatters straight from the gradient when no cast is needed, into the gradient buffer when nothing accumulates
there. Without a buffer size (CB off) every unit is one piece and the casts use temporaries allocated per call —
:attr:`CommBuffers.allocations` counts both kinds, so a test sees the difference.

**MD.** :class:`GradBuffer` holds every unit's reduced shard gradient (master dtype, Σ s) in one contiguous tensor
allocated at construction; ``unit.shard.grad`` are views into it, the same storage every step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spinwheel.parallel.comm import Comm, Handle
from spinwheel.parallel.mesh import Axis

NUM_SLOTS = 2


class PendingOp:
    """An in-flight collective and what to do with its result once it has arrived (copy-out, accumulation)."""

    def __init__(self, handle: Handle, finish: Callable[[], None] | None = None) -> None:
        self.handle, self.finish = handle, finish
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.handle.wait()
        self.done = True
        if self.finish is not None:
            self.finish()


class _Ring:
    """``num_slots`` pairs of staging tensors, small (n,) and large (N·n,), of one dtype; allocated once."""

    def __init__(self, numel: int, size: int, dtype: torch.dtype, device: torch.device, num_slots: int) -> None:
        self.small = [torch.empty(numel, dtype=dtype, device=device) for _ in range(num_slots)]
        self.large = [torch.empty(size * numel, dtype=dtype, device=device) for _ in range(num_slots)]
        self.busy: list[PendingOp | None] = [None] * num_slots
        self.next = 0

    def acquire(self) -> int:
        i = self.next
        self.next = (i + 1) % len(self.busy)
        if self.busy[i] is not None:
            self.busy[i].wait()  # the slot's previous collective must land before its staging is reused
        return i


class CommBuffers:
    """Staging for one FSDP wrapper's collectives over ``axis`` (see the module docstring).

    ``buffer_mb``: the fixed size B of one large staging buffer in MiB; None = CB off (one piece per unit).
    ``gather_dtype`` / ``reduce_dtype``: the dtypes of the all-gathers (compute) and reduce-scatters (reduce).
    """

    def __init__(
        self,
        axis: Axis,
        comm: Comm,
        gather_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        device: torch.device,
        buffer_mb: float | None = None,
        num_slots: int = NUM_SLOTS,
    ) -> None:
        self.axis, self.comm, self.device = axis, comm, device
        self.gather_dtype, self.reduce_dtype = gather_dtype, reduce_dtype
        self.buffer_bytes = int(buffer_mb * 2**20) if buffer_mb else None
        self.allocations = 0  # staging tensors created by this object (a fixed pool under CB)
        self.rings: dict[str, _Ring] = {}
        if self.buffer_bytes is not None:
            for name, dtype in (("gather", gather_dtype), ("reduce", reduce_dtype)):
                numel = self.piece_numel(dtype)
                self.rings[name] = _Ring(numel, axis.size, dtype, device, num_slots)
                self.allocations += 2 * num_slots

    def piece_numel(self, dtype: torch.dtype) -> int:
        """Elements per rank in one piece: the large staging (N·n elements) fills the buffer."""
        assert self.buffer_bytes is not None
        n = self.buffer_bytes // (self.axis.size * torch.empty((), dtype=dtype).element_size())
        if n < 1:
            raise ValueError(f"--fsdp-buffer-mb {self.buffer_bytes / 2**20} is too small for {self.axis.size} ranks")
        return n

    def pieces(self, shard_size: int, dtype: torch.dtype) -> list[tuple[int, int]]:
        """[lo, hi) ranges of a shard of ``shard_size`` elements, one per collective."""
        if self.buffer_bytes is None:
            return [(0, shard_size)]
        n = self.piece_numel(dtype)
        return [(lo, min(lo + n, shard_size)) for lo in range(0, shard_size, n)]

    def staging_bytes(self) -> int:
        """Bytes of the preallocated staging (constant in the model size; 0 with CB off)."""
        return sum(t.nbytes for ring in self.rings.values() for t in ring.small + ring.large)

    def _temp(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(numel, dtype=dtype, device=self.device)

    def _stage(
        self, ring: str, n: int, dtype: torch.dtype, small: bool, large: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, int | None]:
        """Small (n,) and large (N·n,) staging, each when asked: ring slots under CB, temporaries otherwise."""
        if ring in self.rings:
            r = self.rings[ring]
            i = r.acquire()
            return r.small[i][:n], r.large[i][: self.axis.size * n], i
        s = self._temp(n, dtype) if small else None
        return s, self._temp(self.axis.size * n, dtype) if large else None, None

    def _occupy(self, ring: str, slot: int | None, op: PendingOp) -> None:
        if slot is not None:
            self.rings[ring].busy[slot] = op

    # -- collectives ---------------------------------------------------------------------------------------------
    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> list[PendingOp]:
        """Start gathering every rank's ``shard`` (s,) into ``full`` (N·s,, compute dtype), piece by piece."""
        s, size = shard.numel(), self.axis.size
        ops = []
        for lo, hi in self.pieces(s, full.dtype):
            n, whole = hi - lo, (lo, hi) == (0, s)
            src = shard[lo:hi]
            if whole and src.dtype == full.dtype:
                op = PendingOp(self.comm.all_gather(full, src, self.axis, async_op=True))
                ops.append(op)
                continue
            small, large, slot = self._stage("gather", n, full.dtype, small=True, large=not whole)
            small.copy_(src)
            recv = full if whole else large
            finish = None if whole else _copy_columns(full.view(size, s), lo, hi, large)
            op = PendingOp(self.comm.all_gather(recv, small, self.axis, async_op=True), finish)
            self._occupy("gather", slot, op)
            ops.append(op)
        return ops

    def reduce_scatter(
        self,
        grad: torch.Tensor,
        shard_size: int,
        finish: Callable[[int, int, torch.Tensor], None],
        replicate_axis: Axis | None = None,
        out: torch.Tensor | None = None,
    ) -> list[PendingOp]:
        """Start summing ``grad`` (N·s,) over the shard axis (then over ``replicate_axis``, HSDP) in the reduce dtype,
        piece by piece; ``finish(lo, hi, reduced)`` receives each reduced piece (n,) of this rank's shard. ``out``
        (s,), if given in the reduce dtype, receives a one-piece result directly (no staging)."""
        s, size, dtype = shard_size, self.axis.size, self.reduce_dtype
        ops = []
        for lo, hi in self.pieces(s, dtype):
            n, whole = hi - lo, (lo, hi) == (0, s)
            direct_in = whole and grad.dtype == dtype
            direct_out = whole and out is not None and out.dtype == dtype
            slot = None
            if direct_in and direct_out:
                small, large = out, None
            else:
                small, large, slot = self._stage("reduce", n, dtype, small=not direct_out, large=not direct_in)
                small = out if direct_out else small
            if direct_in:
                send = grad
            else:
                large.view(size, n).copy_(grad.view(size, s)[:, lo:hi])
                send = large
            handle = self.comm.reduce_scatter(small, send, self.axis, async_op=True)
            if replicate_axis is not None and replicate_axis.size > 1:
                # HSDP: the replica all-reduce needs the reduced shard; it then runs while backward goes on.
                handle.wait()
                handle = self.comm.all_reduce(small, replicate_axis, async_op=True)
            op = PendingOp(handle, _bind(finish, lo, hi, small))
            self._occupy("reduce", slot, op)
            ops.append(op)
        return ops


def _copy_columns(full_2d: torch.Tensor, lo: int, hi: int, gathered: torch.Tensor) -> Callable[[], None]:
    def finish() -> None:
        with torch.no_grad():
            full_2d[:, lo:hi].copy_(gathered.view(full_2d.shape[0], hi - lo))

    return finish


def _bind(finish: Callable[[int, int, torch.Tensor], None], lo: int, hi: int, piece: torch.Tensor):
    return lambda: finish(lo, hi, piece)


class GradBuffer:
    """Every unit's reduced shard gradient in one contiguous tensor (MD): ``views[i]`` is unit i's (s_i,)."""

    def __init__(self, shard_sizes: list[int], dtype: torch.dtype, device: torch.device) -> None:
        self.flat = torch.zeros(sum(shard_sizes), dtype=dtype, device=device)  # (Σ s_i,)
        self.views = list(torch.split(self.flat, shard_sizes))
