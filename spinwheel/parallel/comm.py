"""Collectives over one grid axis, with volume counters and timeouts.

Every wrapper in :mod:`spinwheel.parallel` talks to other ranks only through a :class:`Comm`. It counts what each
collective moves per rank the way the ZeRO paper (Rajbhandari et al., 2020, §7) counts it, in elements of the full
tensor Ψ: an all-reduce moves 2Ψ (reduce-scatter then all-gather), a reduce-scatter Ψ, an all-gather Ψ. Point-to-point
sends count their own size. So DDP moves 2Ψ per step, ZeRO-1/2 2Ψ, ZeRO-3 / FSDP 3Ψ. :func:`ring_all_reduce` is the
reference ring algorithm over point-to-point sends: it sends 2Ψ(N − 1)/N per rank, whose N → ∞ limit 2Ψ is the count.
Counts are kept per grid axis too (``tp``, ``dp``, ``dp_shard``, ...); under ``torchrun`` the training loops write each
step's share of them to ``metrics.jsonl`` (:meth:`CommStats.metrics`), so a user sees what a layout costs.

Work handles wait with a timeout, so a dead peer ends the job with an error instead of a hang. Axes of size 1 (and
the whole single-process case) never touch ``torch.distributed``: the collectives reduce to local copies.
"""

from __future__ import annotations

import datetime
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp


# PyTorch 2.13 renamed the fused-tensor collectives (``*_single``) and warns on every call of the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Per-rank communication volume (ZeRO accounting): totals keyed by operation name, and calls and bytes keyed
    by (axis name, operation) — what :meth:`metrics` reports."""

    elements: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    axis_bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    axis_calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))

    def add(self, op: str, elements: int, element_size: int, axis: str = "world") -> None:
        self.elements[op] += elements
        self.bytes[op] += elements * element_size
        self.calls[op] += 1
        self.axis_bytes[axis, op] += elements * element_size
        self.axis_calls[axis, op] += 1

    def total_bytes(self, ops: tuple[str, ...] | None = None) -> int:
        return sum(v for k, v in self.bytes.items() if ops is None or k in ops)

    def total_elements(self, ops: tuple[str, ...] | None = None) -> int:
        return sum(v for k, v in self.elements.items() if ops is None or k in ops)

    def metrics(self, prefix: str = "comm") -> dict[str, int]:
        """Cumulative counters as flat metric names: ``{prefix}/{axis}/{op}/calls`` and ``.../bytes``, e.g.
        ``comm/tp/all_reduce/bytes`` (an all-reduce of Ψ bytes counts 2Ψ, see the module docstring)."""
        out: dict[str, int] = {}
        for (axis, op), calls in sorted(self.axis_calls.items()):
            out[f"{prefix}/{axis}/{op}/calls"] = calls
            out[f"{prefix}/{axis}/{op}/bytes"] = self.axis_bytes[axis, op]
        return out

    def reset(self) -> None:
        for counter in (self.elements, self.bytes, self.calls, self.axis_bytes, self.axis_calls):
            counter.clear()


def metrics_since(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """What :meth:`CommStats.metrics` counted between two readings (e.g. one training step); collectives that did
    not run in between are left out."""
    return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


class Handle:
    """An in-flight collective; :meth:`wait` blocks up to the timeout and then runs ``on_done`` (if any)."""

    def __init__(self, work: object | None, timeout: datetime.timedelta | None, on_done=None) -> None:
        self._work = work
        self._timeout = timeout
        self._on_done = on_done
        self.done = work is None
        if self.done and on_done is not None:
            on_done()

    def wait(self) -> None:
        if self.done:
            return
        if self._timeout is not None:
            ok = self._work.wait(self._timeout)  # type: ignore[union-attr]
        else:
            ok = self._work.wait()  # type: ignore[union-attr]
        if ok is False:
            raise TimeoutError(f"collective did not finish within {self._timeout}")
        self.done = True
        if self._on_done is not None:
            self._on_done()


class Comm:
    """Collectives over an :class:`~spinwheel.parallel.mesh.Axis` (anything with ``group``, ``ranks``, ``size``)."""

    def __init__(self, timeout_s: float | None = 600.0) -> None:
        self.stats = CommStats()
        self.timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None

    # The counters only count real traffic: an axis of size 1 moves nothing.
    def _count(self, op: str, axis, elements: int, t: torch.Tensor) -> None:
        if axis.size > 1:
            self.stats.add(op, elements, t.element_size(), getattr(axis, "name", "world"))

    def all_reduce(self, tensor: torch.Tensor, axis, op=ReduceOp.SUM, async_op: bool = False) -> Handle:
        """In-place all-reduce of ``tensor`` over ``axis`` (counted as 2Ψ)."""
        self._count("all_reduce", axis, 2 * tensor.numel(), tensor)
        if axis.size == 1:
            return Handle(None, None)
        work = dist.all_reduce(tensor, op=op, group=axis.group, async_op=True)
        return self._finish(work, async_op)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, axis, op=ReduceOp.SUM, async_op: bool = False
    ) -> Handle:
        """``output`` (Ψ/N,) = this rank's slice of the sum of every rank's ``input`` (Ψ,) (counted as Ψ)."""
        self._count("reduce_scatter", axis, input.numel(), input)
        if axis.size == 1:
            output.copy_(input.view_as(output))
            return Handle(None, None)
        work = _reduce_scatter_tensor(output, input, op=op, group=axis.group, async_op=True)
        return self._finish(work, async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, axis, async_op: bool = False) -> Handle:
        """``output`` (Ψ,) = every rank's ``input`` (Ψ/N,) concatenated in axis order (counted as Ψ)."""
        self._count("all_gather", axis, output.numel(), output)
        if axis.size == 1:
            output.copy_(input.view_as(output))
            return Handle(None, None)
        work = _all_gather_tensor(output, input, group=axis.group, async_op=True)
        return self._finish(work, async_op)

    def all_gather_list(self, input: torch.Tensor, axis) -> list[torch.Tensor]:
        """Every rank's ``input`` (same shape on all ranks), in axis order."""
        out = torch.empty((axis.size, *input.shape), dtype=input.dtype, device=input.device)
        self.all_gather(out.view(-1), input.contiguous().view(-1), axis)
        return list(out.unbind(0))

    def broadcast(self, tensor: torch.Tensor, axis, src: int = 0, async_op: bool = False) -> Handle:
        """Broadcast from the rank with index ``src`` on ``axis`` (counted as Ψ)."""
        self._count("broadcast", axis, tensor.numel(), tensor)
        if axis.size == 1:
            return Handle(None, None)
        work = dist.broadcast(tensor, src=axis.global_rank(src), group=axis.group, async_op=True)
        return self._finish(work, async_op)

    def isend(self, tensor: torch.Tensor, axis, dst: int) -> Handle:
        """Send to the rank with index ``dst`` on ``axis`` without waiting (counted as its size)."""
        self._count("send", axis, tensor.numel(), tensor)
        return Handle(dist.isend(tensor, dst=axis.global_rank(dst), group=axis.group), self.timeout)

    def recv(self, tensor: torch.Tensor, axis, src: int) -> None:
        """Blocking receive into ``tensor`` from the rank with index ``src`` on ``axis``."""
        Handle(dist.irecv(tensor, src=axis.global_rank(src), group=axis.group), self.timeout).wait()

    def barrier(self, axis) -> None:
        if axis.size > 1:
            flag = torch.zeros(1)
            self._finish(dist.all_reduce(flag, group=axis.group, async_op=True), False)

    def all_gather_object(self, obj: object, axis) -> list[object]:
        if axis.size == 1:
            return [obj]
        out: list[object] = [None] * axis.size
        dist.all_gather_object(out, obj, group=axis.group)
        return out

    def _finish(self, work: object, async_op: bool) -> Handle:
        handle = Handle(work, self.timeout)
        if not async_op:
            handle.wait()
        return handle


def ring_all_reduce(comm: Comm, tensor: torch.Tensor, axis) -> None:
    """In-place sum of ``tensor`` over ``axis`` by the ring algorithm, over point-to-point sends only: the reference
    for what the backend's all-reduce does (Patarasuk & Yuan, 2009; the accounting of the module docstring).

    The flattened tensor is cut into N chunks (sizes differing by at most one element). Each of the N − 1 steps of
    the **reduce-scatter** phase sends one chunk to the next rank on the ring and adds the chunk received from the
    previous one; afterwards rank r holds the full sum of chunk r + 1. Each of the N − 1 steps of the **all-gather**
    phase passes a finished chunk on. Each rank thus sends every chunk but one per phase: 2Ψ(N − 1)/N elements for a
    tensor of Ψ, which tends to the 2Ψ that :meth:`Comm.all_reduce` counts; the sends are counted as ``send``.
    """
    n, r = axis.size, axis.rank
    if n == 1:
        return
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce needs a contiguous tensor (it reduces views of it in place)")
    chunks = torch.tensor_split(tensor.view(-1), n)
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):  # reduce-scatter: send chunk r − step, add the received chunk r − step − 1
        send, recv = chunks[(r - step) % n], chunks[(r - step - 1) % n]
        incoming = torch.empty_like(recv)
        _ring_step(comm, axis, send, incoming, right, left)
        recv.add_(incoming)
    for step in range(n - 1):  # all-gather: pass on finished chunk r + 1 − step, receive chunk r − step
        _ring_step(comm, axis, chunks[(r + 1 - step) % n], chunks[(r - step) % n], right, left)


def _ring_step(comm: Comm, axis, send: torch.Tensor, recv: torch.Tensor, right: int, left: int) -> None:
    """Send ``send`` to ``right`` while receiving ``recv`` from ``left``; empty chunks (Ψ < N) are not sent."""
    handle = comm.isend(send, axis, right) if send.numel() else None
    if recv.numel():
        comm.recv(recv, axis, left)
    if handle is not None:
        handle.wait()  # the chunk sent may be written by a later step
