"""Distributed data parallel with gradient buckets (Li et al., 2020, "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training").

* Parameters (and buffers) are broadcast from data-parallel rank 0 at construction, so every replica starts equal.
* Gradients are grouped into buckets of at most ``bucket_mb`` MiB in *reverse* registration order (roughly the order
  backward produces them). A post-accumulate-grad hook marks a parameter ready; when a bucket is full its flattened
  gradients are all-reduced asynchronously, so communication overlaps the rest of backward. Buckets launch in a fixed
  order on every rank (bucket i only after buckets < i), as collectives must match across ranks.
* At the end of backward (an autograd-engine callback) all buckets are waited on, averaged and each ``param.grad``
  becomes a view into its bucket (gradient-as-bucket-view: no second copy of the gradients is kept).
* :meth:`no_sync` skips communication so gradients accumulate locally over micro-batches.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from spinwheel.parallel.comm import Comm, Handle
from spinwheel.parallel.mesh import Axis


def unique_params(module: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters in registration order, each once (tied weights appear once)."""
    return [p for p in module.parameters() if p.requires_grad]


def broadcast_module(module: nn.Module, axis: Axis, comm: Comm) -> None:
    """Copy rank 0's parameters and buffers (on ``axis``) to the other ranks."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            comm.broadcast(t.data, axis, src=0)


class _Bucket:
    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype, device: torch.device) -> None:
        self.params = params
        self.offsets: list[int] = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.buffer = torch.zeros(n, dtype=dtype, device=device)
        self.pending = len(params)
        self.handle: Handle | None = None

    def view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.buffer[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)


def make_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Group ``params`` (already in launch order) into consecutive buckets of at most ``bucket_bytes`` (≥ 1 param,
    one dtype per bucket)."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if buckets and size + nbytes <= bucket_bytes and buckets[-1][0].dtype == p.dtype:
            buckets[-1].append(p)
            size += nbytes
        else:
            buckets.append([p])
            size = nbytes
    return buckets


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` for data parallelism over ``axis``; gradients are averaged over the axis."""

    def __init__(
        self, module: nn.Module, axis: Axis, comm: Comm, bucket_mb: float = 25.0, broadcast: bool = True
    ) -> None:
        super().__init__()
        self.module = module
        self.axis = axis
        self.comm = comm
        if broadcast:
            broadcast_module(module, axis, comm)
        params = unique_params(module)[::-1]
        self._buckets = [_Bucket(ps, ps[0].dtype, ps[0].device) for ps in make_buckets(params, int(bucket_mb * 2**20))]
        self._where: dict[int, tuple[int, int]] = {}
        for b, bucket in enumerate(self._buckets):
            for i, p in enumerate(bucket.params):
                self._where[id(p)] = (b, i)
        self._sync = True
        self._callback_queued = False
        self._next_launch = 0
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self._attach_grad_views()
        return self.module(*args, **kwargs)

    def _attach_grad_views(self) -> None:
        # Gradient-as-bucket-view: a parameter whose gradient was cleared (optimizer.zero_grad) gets a zeroed view of
        # its bucket, so autograd accumulates straight into the bucket — no fresh allocation, no copy in the hook.
        for bucket in self._buckets:
            if all(p.grad is None for p in bucket.params):
                bucket.buffer.zero_()
                for i, p in enumerate(bucket.params):
                    p.grad = bucket.view(i)

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward outside the context all-reduces the sum."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # -- hooks ---------------------------------------------------------------------------------------------------
    def _grad_ready(self, p: nn.Parameter) -> None:
        if not self._sync:
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        b, i = self._where[id(p)]
        bucket = self._buckets[b]
        view = bucket.view(i)
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view  # gradient-as-bucket-view: later backwards accumulate straight into the bucket
        bucket.pending -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            bucket = self._buckets[self._next_launch]
            bucket.handle = self.comm.all_reduce(bucket.buffer, self.axis, async_op=True)
            self._next_launch += 1

    def _finish_backward(self) -> None:
        self._callback_queued = False
        for bucket in self._buckets:  # parameters that got no gradient this backward contribute zeros
            if bucket.pending:
                for i, p in enumerate(bucket.params):
                    if p.grad is None:
                        bucket.view(i).zero_()
                    elif p.grad.data_ptr() != bucket.view(i).data_ptr():
                        bucket.view(i).copy_(p.grad)
                bucket.pending = 0
        self._launch_ready()
        for bucket in self._buckets:
            bucket.handle.wait()
            bucket.buffer.div_(self.axis.size)
            for i, p in enumerate(bucket.params):
                p.grad = bucket.view(i)
            bucket.pending = len(bucket.params)
            bucket.handle = None
        self._next_launch = 0

    def sync_gradients(self) -> None:
        """All-reduce (average) gradients accumulated under :meth:`no_sync`, outside any backward (pipeline use)."""
        for bucket in self._buckets:
            for i, p in enumerate(bucket.params):
                view = bucket.view(i)
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                bucket.pending = 0
        self._launch_ready()
        self._callback_queued = True  # _finish_backward resets it
        self._finish_backward()

    def make_optimizer(self, factory) -> torch.optim.Optimizer:
        return factory(unique_params(self.module))

    def memory_tensors(self):
        """(parameters, gradients, extra optimizer tensors) for memory accounting; gradients live in the buckets."""
        return unique_params(self.module), [b.buffer for b in self._buckets], []
