"""Fully sharded data parallel (Zhao et al., 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data
Parallel"), which is also ZeRO stage 3.

The model is cut into *units* — by default one per transformer block plus a root unit holding what is left (the
embedding, final norm and head, tied weights once). Each unit's parameters are flattened into one padded vector and
sharded over the ``dp_shard`` axis (:class:`~spinwheel.parallel.data.flat_param.FlatParamUnit`); the optimizer sees only
the shards. The original parameters are removed from their modules and, while a unit is gathered, replaced by views
of its flat buffer:

* **pre-forward** (module hook): wait for the unit's all-gather (start it if no prefetch did), set the views, and
  start the next unit's all-gather (forward prefetch), so it overlaps this unit's compute;
* **post-forward**: free the flat buffer (its storage is resized to 0; the views autograd saved keep pointing at
  it) and hook the output's gradient;
* **pre-backward** (the output's gradient hook): all-gather again into the same storage, prefetch the previous unit;
* **post-backward** (post-accumulate-grad hook of the flat buffer): reduce-scatter its gradient asynchronously, free
  the buffer; the reduced shard lands in the unit's view of one contiguous gradient buffer (MD).

**Hybrid sharding (HSDP)**: shard within groups of size F (``dp_shard``), then all-reduce the reduced shard across
the ``dp_replicate`` groups. The post-backward hook of unit i waits for its reduce-scatter and *launches* that
all-reduce asynchronously, so it runs during the backward of unit i − 1 (under NCCL that wait only orders the
streams; under gloo it blocks for the reduce-scatter); every handle is waited at the end of backward. Volume per
step and rank, Ψ the padded parameter count: all-gather 2Ψ and reduce-scatter Ψ on the shard axis (ZeRO-3's 3Ψ),
all-reduce 2·Ψ/F on the replicate axis. Gradients are averaged over the whole data-parallel degree.

**Mixed precision** (:class:`~spinwheel.parallel.data.mixed_precision.MixedPrecisionPolicy`): fp32 shards are the
masters; units are gathered in the compute dtype and gradients reduced in the reduce dtype. **Constant-size
buffers** (``buffer_mb``): gathers and reduce-scatters run in pieces through a fixed staging ring
(:class:`~spinwheel.parallel.data.buffers.CommBuffers`).

Activation re-materialisation composes: recomputation runs inside backward, after the unit's pre-backward gather.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from spinwheel.parallel.comm import Comm
from spinwheel.parallel.data.buffers import CommBuffers, GradBuffer, PendingOp
from spinwheel.parallel.data.ddp import broadcast_module
from spinwheel.parallel.data.flat_param import FlatParamUnit, UnitState
from spinwheel.parallel.data.mixed_precision import MixedPrecisionPolicy
from spinwheel.parallel.mesh import Axis

if TYPE_CHECKING:
    from spinwheel.parallel.io.lazy_load import LoadPlan


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class FullyShardedDataParallel(nn.Module):
    """Shard ``module`` over ``shard_axis`` (replicating over ``replicate_axis`` for HSDP).

    ``unit_modules``: submodules that become units (default: every block in ``module.layers``); the rest of the
    parameters form the root unit. ``prefetch`` overlaps the next unit's all-gather with compute; ``reshard_root``
    frees the root unit after forward too (ZeRO-3 accounting: every parameter gathered twice per step).
    ``mixed_precision``: compute and reduce dtypes (default: the parameters' own); ``buffer_mb``: constant-size
    staging buffers for the collectives (None: one collective per unit). ``loader``: a lazy load's reads
    (:mod:`~spinwheel.parallel.io.lazy_load`): each rank reads only its shard of each unit.
    """

    def __init__(
        self,
        module: nn.Module,
        shard_axis: Axis,
        comm: Comm,
        replicate_axis: Axis | None = None,
        dp_axis: Axis | None = None,
        unit_modules: list[nn.Module] | None = None,
        prefetch: bool = True,
        reshard_root: bool = True,
        broadcast: bool = True,
        mixed_precision: MixedPrecisionPolicy | None = None,
        buffer_mb: float | None = None,
        loader: LoadPlan | None = None,
    ) -> None:
        super().__init__()
        self.module, self.comm = module, comm
        self.shard_axis, self.replicate_axis = shard_axis, replicate_axis
        if broadcast:
            broadcast_module(module, dp_axis or shard_axis, comm)
        if unit_modules is None:
            layers = getattr(module, "layers", None)
            if layers is None and hasattr(module, "model"):
                layers = getattr(module.model, "layers", None)
            unit_modules = list(layers.values() if isinstance(layers, nn.ModuleDict) else layers or [])
        self.prefetch, self.reshard_root = prefetch, reshard_root
        self.dp_size = shard_axis.size * (replicate_axis.size if replicate_axis is not None else 1)
        first = next(p for p in module.parameters() if p.requires_grad)
        self.policy = mixed_precision or MixedPrecisionPolicy()
        self.compute_dtype = self.policy.compute_dtype(first.dtype)
        self.loader = loader
        self.units = self._build_units(unit_modules)  # forward order; the root unit is last
        device = self.units[0].shard.device  # ``first`` is on the meta device under a lazy load
        self.root = self.units[-1]
        self.flat_shards = nn.ParameterList([u.shard for u in self.units])
        self.buffers = CommBuffers(
            shard_axis, comm, self.compute_dtype, self.policy.comm_dtype(first.dtype), device, buffer_mb
        )
        self.grads = GradBuffer([u.shard_size for u in self.units], first.dtype, device)
        self.peak_gathered_bytes = 0  # the most compute-parameter bytes gathered at once so far
        self._pending: list[PendingOp] = []
        self._reduced: set[int] = set()  # units whose gradient this backward reduced
        self._callback_queued = False
        for i, (_unit, mod) in enumerate(zip(self.units[:-1], unit_modules)):
            mod.register_forward_pre_hook(self._make_pre_forward(i))
            mod.register_forward_hook(self._make_post_forward(i))
        for i, unit in enumerate(self.units):
            unit.full.register_post_accumulate_grad_hook(self._make_post_backward(i))

    def _build_units(self, unit_modules: list[nn.Module]) -> list[FlatParamUnit]:
        owner_of = {id(m): i for i, m in enumerate(unit_modules)}
        refs: list[list] = [[] for _ in range(len(unit_modules) + 1)]

        # Walk modules; a parameter belongs to the innermost unit module enclosing it (else to the root).
        def walk(mod: nn.Module, prefix: str, unit: int) -> None:
            unit = owner_of.get(id(mod), unit)
            for attr, p in list(mod._parameters.items()):
                if p is not None and p.requires_grad:
                    refs[unit].append((prefix + attr, mod, attr, p))
            for child_name, child in mod._modules.items():
                if child is not None:
                    walk(child, f"{prefix}{child_name}.", unit)

        walk(self.module, "", len(unit_modules))
        units = []
        for i, r in enumerate(refs):
            if not r:
                raise ValueError(f"FSDP unit {i} has no trainable parameters")
            units.append(self._flat_unit("root" if i == len(unit_modules) else f"unit{i}", r))
        return units

    def _flat_unit(self, name: str, refs: list) -> FlatParamUnit:
        """One unit flattened and sharded; under a lazy load only this rank's shard of it is read."""
        reader = self.loader.read_shard if self.loader is not None else None
        return FlatParamUnit(name, refs, self.shard_axis, self.compute_dtype, read_shard=reader)

    # -- hooks ---------------------------------------------------------------------------------------------------
    def _unshard(self, i: int, async_op: bool = False) -> None:
        self.units[i].unshard(self.buffers, async_op)
        gathered = sum(u.nbytes for u in self.units if u.state is not UnitState.SHARDED)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, gathered)

    def forward(self, *args, **kwargs):
        self._unshard(len(self.units) - 1)
        self.root.set_views()
        if self.prefetch and len(self.units) > 1:
            self._unshard(0, async_op=True)
        out = self.module(*args, **kwargs)
        self._hook_output(out, len(self.units) - 1)
        if self.reshard_root:
            self.root.reshard()
        return out

    def _make_pre_forward(self, i: int):
        def hook(module, args):
            self._unshard(i)
            self.units[i].set_views()
            if self.prefetch and not _in_backward() and i + 1 < len(self.units) - 1:
                self._unshard(i + 1, async_op=True)

        return hook

    def _make_post_forward(self, i: int):
        def hook(module, args, out):
            if _in_backward():  # re-materialisation inside backward: keep the unit gathered for its gradients
                return out
            self.units[i].reshard()
            self._hook_output(out, i)
            return out

        return hook

    def _hook_output(self, out, i: int) -> None:
        tensors = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]
        for t in tensors:
            if t.requires_grad:
                t.register_hook(self._make_pre_backward(i))

    def _make_pre_backward(self, i: int):
        def hook(grad):
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._unshard(i)
            if self.prefetch:
                prev = i - 1 if i < len(self.units) - 1 else len(self.units) - 2
                if prev >= 0:
                    self._unshard(prev, async_op=True)
            return grad

        return hook

    def _make_post_backward(self, i: int):
        unit = self.units[i]

        def hook(full: torch.Tensor) -> None:
            grad = full.grad  # (N·s,), compute dtype
            full.grad = None
            self._reduced.add(i)
            finish = self._make_accumulate(i)
            out = self.grads.views[i] if unit.shard.grad is None else None  # nothing to accumulate: reduce in place
            self._pending += self.buffers.reduce_scatter(grad, unit.shard_size, finish, self.replicate_axis, out)
            unit.reshard()

        return hook

    def _make_accumulate(self, i: int):
        """Average a reduced piece (n,) over the data-parallel degree (in the reduce dtype) and add it to the unit's
        shard gradient, a view of the contiguous gradient buffer (the first piece of a step overwrites)."""
        unit, view = self.units[i], self.grads.views[i]

        def finish(lo: int, hi: int, reduced: torch.Tensor) -> None:
            reduced.div_(self.dp_size)
            if reduced.data_ptr() == view[lo:hi].data_ptr():  # reduced straight into the gradient buffer
                return
            if unit.shard.grad is None:
                view[lo:hi].copy_(reduced)
            else:
                view[lo:hi].add_(reduced)

        return finish

    def _finish_backward(self) -> None:
        self._callback_queued = False
        for op in self._pending:
            op.wait()
        self._pending.clear()
        for i in self._reduced:  # a unit without a gradient keeps its shard's (None after zero_grad)
            self.units[i].shard.grad = self.grads.views[i]
        self._reduced.clear()
        for unit in self.units:
            unit.reshard()

    # -- utilities -----------------------------------------------------------------------------------------------
    def make_optimizer(self, factory) -> torch.optim.Optimizer:
        return factory(list(self.flat_shards))

    def memory_tensors(self):
        return [u.shard for u in self.units], [self.grads.flat], []

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter, unsharded (collective over the shard axis), by its name inside the wrapped module."""
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            out.update(unit.full_tensors(self.buffers))
        return out

    @contextmanager
    def no_sync(self):
        """Gradients are reduce-scattered every backward and accumulate in the shards; nothing to skip."""
        yield

    def sync_gradients(self) -> None:
        pass
