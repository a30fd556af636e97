"""A counting process group: what the ranks really send, measured below :class:`~spinwheel.parallel.comm.Comm`.

:class:`~spinwheel.parallel.comm.CommStats` *books* each collective at the size the ZeRO paper assigns it (an
all-reduce of Ψ as 2Ψ, whatever the backend does). :func:`counting_backend` checks those books from underneath: while
it is active, every collective a :class:`Comm` issues is lowered to the reference **ring** algorithm over
point-to-point sends (Patarasuk & Yuan, 2009; what NCCL and gloo's ring run for large tensors), and each rank counts
the calls it made and the bytes it put on the wire itself:

====================  =====================================  ==============================
collective of Ψ       ring steps                             bytes one rank sends
====================  =====================================  ==============================
reduce-scatter        N − 1, one chunk (Ψ/N) each            Ψ(N − 1)/N
all-gather            N − 1, one chunk each                  Ψ(N − 1)/N
all-reduce            reduce-scatter, then all-gather        2Ψ(N − 1)/N
broadcast             a chain from the source                Ψ (the last rank: 0)
send                  itself                                 its size
====================  =====================================  ==============================

A chunk a rank sends is the tensor the backend is handed, padding included, so the count is what moves, not what
the caller meant to move. Results are those of the backend's collectives (sums in ring order), so training goes on
unchanged. Point-to-point traffic (pipeline activations) passes through and is counted as sent.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from spinwheel.parallel import comm as comm_module

_COMBINE = {
    dist.ReduceOp.SUM: torch.Tensor.add_,
    dist.ReduceOp.MAX: lambda a, b: torch.maximum(a, b, out=a),
    dist.ReduceOp.MIN: lambda a, b: torch.minimum(a, b, out=a),
}


@dataclass
class WireCounts:
    """Per-rank counts of what went on the wire: backend calls and bytes sent, by collective."""

    calls: Counter = field(default_factory=Counter)
    sent: Counter = field(default_factory=Counter)  # bytes this rank sent, by collective

    def total_sent(self, ops: tuple[str, ...] | None = None) -> int:
        return sum(v for k, v in self.sent.items() if ops is None or k in ops)

    def reset(self) -> None:
        self.calls.clear()
        self.sent.clear()


class _Done:
    """A finished work handle (the ring runs synchronously)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _RingGroup:
    """The ring over one process group: this rank's index, its neighbours' global ranks, counted sends."""

    def __init__(self, group, counts: WireCounts, op: str) -> None:
        self.group, self.counts, self.op = group, counts, op
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self.n, self.index = len(ranks), ranks.index(dist.get_rank())
        self.right, self.left = ranks[(self.index + 1) % self.n], ranks[(self.index - 1) % self.n]
        self.ranks = ranks

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Send ``send`` to the right neighbour while receiving ``recv`` from the left one."""
        work = None
        if send.numel():
            self.counts.sent[self.op] += send.numel() * send.element_size()
            work = dist.isend(send.contiguous(), dst=self.right, group=self.group)
        if recv.numel():
            dist.irecv(recv, src=self.left, group=self.group).wait()
        if work is not None:
            work.wait()

    def reduce_scatter(self, chunks: list[torch.Tensor], combine) -> None:
        """In place: afterwards ``chunks[index]`` holds the reduction of every rank's chunk ``index``."""
        n, r = self.n, self.index
        # Step s sends chunk r − s − 1 (reduced over s + 1 ranks) and reduces the left neighbour's chunk r − s − 2
        # into its own; the last step (s = n − 2) completes chunk r.
        for step in range(n - 1):
            send, recv = chunks[(r - step - 1) % n], chunks[(r - step - 2) % n]
            incoming = torch.empty_like(recv)
            self.exchange(send, incoming)
            combine(recv, incoming)

    def all_gather(self, chunks: list[torch.Tensor]) -> None:
        """In place: every rank's ``chunks[its index]`` reaches every rank."""
        n, r = self.n, self.index
        for step in range(n - 1):  # pass on chunk r − step, receive chunk r − step − 1
            self.exchange(chunks[(r - step) % n], chunks[(r - step - 1) % n])


class _CountingDist:
    """``torch.distributed`` as :mod:`spinwheel.parallel.comm` sees it while counting: collectives by the ring."""

    def __init__(self, counts: WireCounts) -> None:
        self.counts = counts

    def __getattr__(self, name: str):
        return getattr(dist, name)

    def _ring(self, group, op: str) -> _RingGroup:
        self.counts.calls[op] += 1
        return _RingGroup(group, self.counts, op)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
        ring = self._ring(group, "all_reduce")
        flat = tensor.detach().view(-1) if tensor.is_contiguous() else tensor.detach().reshape(-1).clone()
        chunks = list(torch.tensor_split(flat, ring.n))
        ring.reduce_scatter(chunks, _combine(op))  # rank r now holds chunk r reduced
        ring.all_gather(chunks)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
        return _Done()

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None, **_):
        ring = self._ring(group, "reduce_scatter")
        chunks = list(input.detach().clone().view(-1).chunk(ring.n))
        ring.reduce_scatter(chunks, _combine(op))
        output.copy_(chunks[ring.index].view_as(output))
        return _Done()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group=None, **_):
        ring = self._ring(group, "all_gather")
        chunks = list(output.view(-1).chunk(ring.n))
        chunks[ring.index].copy_(input.reshape(-1))
        ring.all_gather(chunks)
        return _Done()

    def broadcast(self, tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
        ring = self._ring(group, "broadcast")
        pos = (ring.index - ring.ranks.index(src)) % ring.n  # distance from the source along the chain
        if pos > 0:
            dist.irecv(tensor, src=ring.left, group=group).wait()
        if pos < ring.n - 1:
            ring.counts.sent["broadcast"] += tensor.numel() * tensor.element_size()
            dist.isend(tensor, dst=ring.right, group=group).wait()
        return _Done()

    def isend(self, tensor: torch.Tensor, dst: int, group=None, **kwargs):
        self.counts.calls["send"] += 1
        self.counts.sent["send"] += tensor.numel() * tensor.element_size()
        return dist.isend(tensor, dst=dst, group=group, **kwargs)


def _combine(op):
    if op not in _COMBINE:
        raise ValueError(f"the counting backend reduces with SUM, MAX or MIN, not {op}")
    return _COMBINE[op]


@contextmanager
def counting_backend() -> Iterator[WireCounts]:
    """While active, every :class:`~spinwheel.parallel.comm.Comm` collective in this process runs as a ring over
    point-to-point sends and is counted in the :class:`WireCounts` yielded (every rank must enter it alike)."""
    counts = WireCounts()
    fake = _CountingDist(counts)
    saved = comm_module.dist, comm_module._all_gather_tensor, comm_module._reduce_scatter_tensor
    comm_module.dist = fake  # type: ignore[assignment]
    comm_module._all_gather_tensor = fake.all_gather
    comm_module._reduce_scatter_tensor = fake.reduce_scatter
    try:
        yield counts
    finally:
        comm_module.dist, comm_module._all_gather_tensor, comm_module._reduce_scatter_tensor = saved
