"""ZeRO stages 1 and 2 (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models"); stage 3 is parameter sharding, which :mod:`spinwheel.parallel.data.fsdp` implements (units all-gathered before
use and freed after) — :func:`spinwheel.parallel.parallelize.parallelize` builds it for ``zero=3``.

Parameters are packed, in reverse registration order, into flat buckets padded to a multiple of the data-parallel
degree N; each parameter's ``.data`` becomes a view into its bucket. Rank r owns slice r of every bucket, and the
optimizer only sees these slices ("master" shards), so its states are partitioned (stage 1). Gradients:

* stage 1 keeps a full gradient buffer per bucket (``param.grad`` are views into it; :meth:`no_sync` accumulates
  there), reduce-scatters it when the bucket is complete and keeps the reduced slice in this rank's own part of the
  buffer (so accumulate under ``no_sync`` and call ``zero_grad`` between steps);
* stage 2 copies each gradient into a transient bucket buffer, reduce-scatters it as soon as the bucket is full and
  frees it, so only the owned 1/N of the gradients persists — in one contiguous buffer allocated at construction
  (ZeRO-R's memory defragmentation, :class:`~spinwheel.parallel.data.buffers.GradBuffer`), the first reduction of a step
  landing there directly.

Both overlap the reduce-scatter with backward (hooks, as in :mod:`spinwheel.parallel.data.ddp`); after the optimizer
step every bucket is all-gathered. Volume per step: reduce-scatter Ψ + all-gather Ψ = 2Ψ, the same as DDP.

Mixed precision: with bf16/fp16 parameters the master shards and Adam states are fp32 (K = 12 bytes per parameter);
with fp32 parameters the master shard *is* the parameter slice (no copy), so fp32 Adam matches the paper's
16Ψ / 8Ψ + 8Ψ/N / 4Ψ + 12Ψ/N formulas (see :func:`zero_memory_formula`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from spinwheel.parallel.comm import Comm, Handle
from spinwheel.parallel.data.buffers import GradBuffer
from spinwheel.parallel.data.ddp import broadcast_module, make_buckets, unique_params
from spinwheel.parallel.mesh import Axis


class _FlatBucket:
    """Parameters packed into one flat tensor (padded to a multiple of N); this rank owns one contiguous slice."""

    def __init__(self, params: list[nn.Parameter], axis: Axis, master_dtype: torch.dtype) -> None:
        self.params = params
        self.offsets, n = [], 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.shard_size = -(-n // axis.size)
        dtype, device = params[0].dtype, params[0].device
        self.flat = torch.zeros(self.shard_size * axis.size, dtype=dtype, device=device)  # (N·s,)
        with torch.no_grad():
            for p, off in zip(params, self.offsets):
                self.flat[off : off + p.numel()].copy_(p.data.view(-1))
                p.data = self.flat[off : off + p.numel()].view_as(p)
        self.shard = self.flat[axis.rank * self.shard_size : (axis.rank + 1) * self.shard_size]  # (s,)
        # fp32 parameters: the master is the parameter slice itself; otherwise an fp32 copy (mixed precision).
        self.master = nn.Parameter(self.shard if dtype == master_dtype else self.shard.detach().to(master_dtype))
        self.shard_grad: torch.Tensor | None = None  # (s,), parameter dtype
        self.grad_buffer: torch.Tensor | None = None  # (N·s,), parameter dtype
        self.pending = len(params)
        self.handle: Handle | None = None
        self.scattered: torch.Tensor | None = None

    def grad_view(self, i: int) -> torch.Tensor:
        p, off = self.params[i], self.offsets[i]
        assert self.grad_buffer is not None
        return self.grad_buffer[off : off + p.numel()].view_as(p)


class ZeroDataParallel(nn.Module):
    """ZeRO stage 1 or 2 over ``axis``. Build the optimizer with :meth:`make_optimizer`; gradients are averaged."""

    def __init__(
        self,
        module: nn.Module,
        axis: Axis,
        comm: Comm,
        stage: int,
        bucket_mb: float = 25.0,
        master_dtype: torch.dtype = torch.float32,
        broadcast: bool = True,
    ) -> None:
        super().__init__()
        if stage not in (1, 2):
            raise ValueError(
                f"ZeroDataParallel implements stages 1 and 2, got {stage}; "
                "stage 3 is FSDP (spinwheel.parallel.data.fsdp)"
            )
        self.module, self.axis, self.comm, self.stage = module, axis, comm, stage
        if broadcast:
            broadcast_module(module, axis, comm)
        params = unique_params(module)[::-1]
        self.buckets = [_FlatBucket(ps, axis, master_dtype) for ps in make_buckets(params, int(bucket_mb * 2**20))]
        self._where = {id(p): (b, i) for b, bk in enumerate(self.buckets) for i, p in enumerate(bk.params)}
        if stage == 1:
            for bk in self.buckets:
                bk.grad_buffer = torch.zeros_like(bk.flat)
        flat = self.buckets[0].flat
        self.grads = GradBuffer([bk.shard_size for bk in self.buckets], flat.dtype, flat.device) if stage == 2 else None
        self._sync = True
        self._reduced = False  # stage 1: gradients reduced since the last zero_grad
        self._callback_queued = False
        self._next_launch = 0
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Stage 1: accumulate full gradients locally. Stage 2 reduce-scatters every backward (its gradients are
        sharded), so the context changes nothing there."""
        previous, self._sync = self._sync, self.stage == 2
        try:
            yield
        finally:
            self._sync = previous

    # -- gradient hooks ------------------------------------------------------------------------------------------
    def _grad_ready(self, p: nn.Parameter) -> None:
        b, i = self._where[id(p)]
        bk = self.buckets[b]
        if self.stage == 1 and self._reduced:
            raise RuntimeError(
                "ZeRO-1 reduced this step's gradients already: call optimizer.zero_grad() before the "
                "next backward, and accumulate micro-batches under no_sync()"
            )
        if bk.grad_buffer is None:  # stage 2: a transient buffer per backward
            bk.grad_buffer = torch.zeros_like(bk.flat)
        view = bk.grad_view(i)
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            if self.stage == 2:
                view.add_(p.grad)
            else:
                view.copy_(p.grad)
        p.grad = view if self.stage == 1 else None
        if not self._sync:
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        bk.pending -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            bk = self.buckets[self._next_launch]
            if self.grads is not None and bk.shard_grad is None:  # stage 2: reduce into the contiguous buffer
                bk.scattered = self.grads.views[self._next_launch]
            else:
                bk.scattered = torch.empty_like(bk.shard)
            bk.handle = self.comm.reduce_scatter(bk.scattered, bk.grad_buffer, self.axis, async_op=True)
            self._next_launch += 1

    def _finish_backward(self) -> None:
        self._callback_queued = False
        for bk in self.buckets:
            if bk.pending:  # parameters without a gradient this backward contribute zeros
                if bk.grad_buffer is None:
                    bk.grad_buffer = torch.zeros_like(bk.flat)
                bk.pending = 0
        self._launch_ready()
        for bk in self.buckets:
            bk.handle.wait()
            bk.scattered.div_(self.axis.size)
            if self.stage == 1:
                # The reduced shard lives in this rank's own slice of the full gradient buffer (no extra copy
                # persists): stage 1 holds Ψ gradients, of which 1/N are reduced.
                lo = self.axis.rank * bk.shard_size
                bk.shard_grad = bk.grad_buffer[lo : lo + bk.shard_size]
                bk.shard_grad.copy_(bk.scattered)
            elif bk.shard_grad is None:
                bk.shard_grad = bk.scattered
            else:
                bk.shard_grad.add_(bk.scattered)
            bk.scattered, bk.handle = None, None
            bk.pending = len(bk.params)
            if self.stage == 2:
                bk.grad_buffer = None
        self._reduced = self.stage == 1
        self._next_launch = 0

    def sync_gradients(self) -> None:
        """Reduce-scatter gradients accumulated under :meth:`no_sync` (stage 1), outside any backward."""
        if self.stage == 2:
            return
        for bk in self.buckets:
            bk.pending = 0
        self._callback_queued = True
        self._launch_ready()
        self._finish_backward()

    # -- optimizer -----------------------------------------------------------------------------------------------
    def make_optimizer(self, factory) -> ZeroOptimizer:
        return ZeroOptimizer(self, factory([bk.master for bk in self.buckets]))

    def all_gather_params(self) -> None:
        for bk in self.buckets:
            self.comm.all_gather(bk.flat, bk.shard.clone(), self.axis)


class ZeroOptimizer:
    """Steps the inner optimizer on this rank's master shards, then all-gathers the parameters."""

    def __init__(self, model: ZeroDataParallel, inner: torch.optim.Optimizer) -> None:
        self.model, self.inner = model, inner

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def step(self) -> None:
        for bk in self.model.buckets:
            g = bk.shard_grad if bk.shard_grad is not None else torch.zeros_like(bk.shard)
            bk.master.grad = g if g.dtype == bk.master.dtype else g.to(bk.master.dtype)
        self.inner.step()
        with torch.no_grad():
            for bk in self.model.buckets:
                if bk.master.data_ptr() != bk.shard.data_ptr():
                    bk.shard.copy_(bk.master)
        self.model.all_gather_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for bk in self.model.buckets:
            bk.master.grad = None
            if bk.shard_grad is not None:
                bk.shard_grad.zero_()
            if bk.grad_buffer is not None:
                bk.grad_buffer.zero_()
        self.model._reduced = False

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


# -- memory accounting --------------------------------------------------------------------------------------------
def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and shared tensors count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optimizer) -> list[torch.Tensor]:
    inner = getattr(optimizer, "inner", optimizer)
    return [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]


def memory_breakdown(model: nn.Module, optimizer) -> dict[str, int]:
    """Per-rank bytes of parameters, gradients and optimizer state (fp32 masters count as optimizer state) held by
    a wrapped model, measured from the tensors themselves."""
    if isinstance(model, ZeroDataParallel):
        params = [bk.flat for bk in model.buckets]
        grads = [bk.grad_buffer for bk in model.buckets] + [bk.shard_grad for bk in model.buckets]
        masters = [bk.master for bk in model.buckets if bk.master.data_ptr() != bk.shard.data_ptr()]
    elif hasattr(model, "memory_tensors"):
        params, grads, masters = model.memory_tensors()
    else:
        ps = list(model.parameters())
        params, grads, masters = ps, [p.grad for p in ps], []
    param_ptrs = {t.untyped_storage().data_ptr() for t in params if t is not None}
    state = [t for t in optimizer_state_tensors(optimizer) if t.untyped_storage().data_ptr() not in param_ptrs]
    return {"params": storage_bytes(params), "grads": storage_bytes(grads), "optimizer": storage_bytes(state + masters)}


def zero_memory_formula(stage: int, num_params: int, dp: int, mixed_precision: bool = False) -> dict[str, float]:
    """The ZeRO paper's per-rank bytes for Adam: parameters, gradients, optimizer state (incl. fp32 master).

    fp32: 4Ψ + 4Ψ + 8Ψ (K=8); mixed precision: 2Ψ + 2Ψ + 12Ψ (K=12). Stage 1 divides the optimizer term by N,
    stage 2 also the gradients, stage 3 also the parameters.
    """
    p, g, k = (2, 2, 12) if mixed_precision else (4, 4, 8)
    n = float(dp)
    params = p * num_params / (n if stage >= 3 else 1)
    grads = g * num_params / (n if stage >= 2 else 1)
    opt = k * num_params / (n if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}
