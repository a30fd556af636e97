"""Multi-LoRA serving: one base model in the engine, many LoRA adapters, mixed in one batch.

References: Sheng et al., 2023, "S-LoRA: Serving Thousands of Concurrent LoRA Adapters"; Chen et al., 2023, "Punica:
Multi-Tenant LoRA Serving". The base weights are shared by every request and never merged with an adapter; a request
names an adapter (``SamplingParams.lora``, None: the base) and the rows it has in a step's flat batch go through that
adapter's factors on every projection it adapts:

    y[rows_i] = x[rows_i] W^T + b + s_i (x[rows_i] A_i^T) B_i^T        rows_i: the rows of adapter i's requests

Punica's SGMV kernel computes the per-adapter products in one launch; here a loop over the adapters present in the
step (a gather, two thin GEMMs and an ``index_add_`` each) does the same arithmetic, and rows of the base skip it.
A step whose rows all share one adapter needs no gather.

:class:`LoRAProjection` wraps a projection of the engine's model, sharing its weight and bias (so the model's state
dict, weight updates and the CPU path's packed copies stay the base's), and holds the factors of every registered
adapter that targets it, ``B`` pre-scaled by ``s``, in the weight's dtype and device. :class:`AdapterRegistry`
registers adapters by name (slot 0 is the base) from PEFT adapter directories checked against the model
(:func:`~spinwheel.models.lora_io.read_adapter`: a different base is a one-line error), and says which rows of the
step run through which adapter while the step's forward runs (:meth:`AdapterRegistry.active`). The K/V a request
computes depend on its adapter, so the prefix cache keys blocks by adapter too (``namespace`` in
:class:`~spinwheel.engine.kv.block_manager.BlockManager`).

One registry serves every layout: its :class:`Shard` says which part of the model this rank holds. A pipeline
stage holds its layers' factors (renumbered as it numbers its layers); a tensor-parallel rank its slice of each
factor, cut like the layer it adapts (:mod:`spinwheel.parallel.tensor_lora` does the same for training): on a
column-parallel projection (q, k, v, gate, up) A whole and s·B's rows, on a row-parallel one (o, down) A's columns
and s·B whole, whose term joins the rank's partial output before the layer's all-reduce, so the sum is
``W x + s B A x`` exactly as on one device with no collective added. On a sharded engine the driver alone reads and
checks a PEFT directory, against the whole model's shapes (a meta-device model: a bad adapter is the same one-line
:class:`~spinwheel.models.lora.LoRAError` as on one device, and no rank has changed), installs its own part at once
and queues the whole adapter (:meth:`AdapterRegistry.take_pending`); it travels with the next message the executor
sends the other ranks, which install it in the driver's slot before that message's step, so ranks cannot disagree
on an adapter's validity or slot.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from spinwheel.models.config import ModelConfig
from spinwheel.models.lora import TARGETS, LoRAError, lora_layers
from spinwheel.models.lora_io import read_adapter
from spinwheel.models.transformer import Transformer
from spinwheel.parallel.mesh import Axis
from spinwheel.parallel.tensor import ColumnParallelLinear, RowParallelLinear, reduce_from_tp

Factors = dict[str, tuple[torch.Tensor, ...]]  # ``layers.0.self_attn.q_proj`` -> (A, s·B)


@dataclass
class ActiveRows:
    """The step's rows by adapter: (slot, row indices (R,) int64 into the flat batch, or None for every row)."""

    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)


@dataclass
class AdapterShipment:
    """One adapter as the driver ships it to the other ranks: its name, the slot every rank gives it, and its
    factors by projection (whole; a stage's part once :func:`~spinwheel.engine.parallel.pp_lora.stage_part` cut them),
    on
    CPU."""

    name: str
    path: str
    slot: int
    factors: Factors


@dataclass(frozen=True)
class Shard:
    """The part of the model a rank serves: all of it (``config`` None: one device), or of the whole model whose
    config is ``config``, the global ``layers`` (a pipeline stage's; None: every layer), each split over ``axis``
    (tensor parallelism; None: whole)."""

    config: ModelConfig | None = None
    layers: range | None = None
    axis: Axis | None = None

    def own_layers(self, factors: Factors) -> Factors:
        """An adapter's factors of this shard's layers, renumbered from 0 as its model numbers them."""
        return factors if self.layers is None else stage_factors(factors, self.layers)


def stage_factors(factors: Factors, layers: range) -> Factors:
    """An adapter's factors of the global ``layers``, renumbered from 0."""
    out = {}
    for key, value in factors.items():
        _, index, target = key.split(".", 2)
        if int(index) in layers:
            out[f"layers.{int(index) - layers.start}.{target}"] = value
    return out


class LoRAProjection(nn.Linear):
    """A projection of the served base plus the factors of the adapters that target it, applied per row group."""

    def __init__(self, base: nn.Linear, rows: ActiveRows) -> None:
        nn.Module.__init__(self)
        self.out_features, self.in_features = base.weight.shape  # a shard's own (out, in) under TP
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.rows = rows
        # slot -> (A (r, in), s * B (out, r)); plain tensors, not parameters: the state dict stays the base's
        self.factors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)  # (..., out)
        if self.rows.groups:
            self.add_delta(x.reshape(-1, self.in_features), y.view(-1, self.out_features))
        return y

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y`` (N, out) += s B A x for each row group of ``x`` (N, in) whose adapter targets this projection, in
        place (``y`` may be a column slice of a fused projection's output)."""
        for slot, rows in self.rows.groups:
            factors = self.factors.get(slot)
            if factors is None:
                continue
            a, b = factors
            if rows is None:
                y.add_(F.linear(F.linear(x, a), b))
            else:
                y.index_add_(0, rows, F.linear(F.linear(x.index_select(0, rows), a), b))

    def local_factors(self, a: torch.Tensor, b: torch.Tensor, axis: Axis | None) -> tuple[torch.Tensor, ...]:
        """The part of an adapter's (A, s·B) this projection applies: all of it, or (a column-parallel shard of
        ``axis``) A whole and s·B's rows of this shard, copied so that the slice alone stays."""
        return (a, b) if axis is None else (a, b.chunk(axis.size, dim=0)[axis.rank].clone())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, adapters={len(self.factors)}"


class RowParallelLoRAProjection(LoRAProjection):
    """A row-parallel projection (W and A split on the input features, s·B whole) plus its adapters: each row's
    term joins the rank's partial output before the all-reduce; the bias is added once, after it."""

    def __init__(self, base: RowParallelLinear, rows: ActiveRows) -> None:
        super().__init__(base, rows)  # type: ignore[arg-type]
        self.axis, self.comm = base.axis, base.comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = F.linear(x, self.weight)  # (..., out): this rank's partial sum
        if self.rows.groups:
            self.add_delta(x.reshape(-1, self.in_features), z.view(-1, self.out_features))
        y = reduce_from_tp(z, self.axis, self.comm)
        return y + self.bias if self.bias is not None else y

    def local_factors(self, a: torch.Tensor, b: torch.Tensor, axis: Axis | None) -> tuple[torch.Tensor, ...]:
        """A's columns of this shard, s·B whole."""
        return a.chunk(axis.size, dim=1)[axis.rank].clone(), b  # type: ignore[union-attr]


class AdapterRegistry:
    """The adapters an engine rank serves over its model (its ``shard`` of the whole model), by name; slot 0 is the
    base (no adapter), or :attr:`default` when set. On a sharded engine's driver :meth:`add` also queues each adapter
    for the other ranks (:meth:`take_pending`), which :meth:`receive` it."""

    adaptable: tuple[type, ...] = (nn.Linear, LoRAProjection)  # the projections an adapter may target

    def __init__(self, model: Transformer, shard: Shard | None = None) -> None:
        self.model, self.shard = model, shard or Shard()
        self.slots: dict[str, int] = {}
        self.paths: dict[str, str] = {}
        self.rows = ActiveRows()
        self.pending: list[AdapterShipment] = []  # whole adapters the other ranks have not been sent yet
        self.default: str | None = None  # the adapter requests naming none run through (the RL policy's)
        self._full: Transformer | None = None

    @property
    def names(self) -> list[str]:
        return list(self.slots)

    def slot(self, name: str | None) -> int:
        """The slot of adapter ``name`` (None: :attr:`default`'s, or 0, the base); an unknown name is a ValueError."""
        name = self.default if name is None else name
        if name is None:
            return 0
        if name not in self.slots:
            known = ", ".join(self.slots) or "none are registered"
            raise ValueError(f"unknown LoRA adapter '{name}' (the engine serves: {known})")
        return self.slots[name]

    def full_model(self) -> Transformer:
        """What adapters are checked against: the served model, or (a shard) the whole model on the meta device."""
        if self.shard.config is None:
            return self.model
        if self._full is None:
            with torch.device("meta"):
                self._full = Transformer(self.shard.config)
        return self._full

    def add(self, name: str, path: str | os.PathLike) -> None:
        """Serve the PEFT adapter in ``path`` as ``name`` (on a sharded engine: on this rank now, on the others from
        the next message). It is checked against the whole model before anything changes: one whose base differs is
        a one-line :class:`LoRAError`. Names are never reused (the prefix cache keys K/V by adapter name, so another
        adapter under an old name would read stale K/V)."""
        factors = self.read(name, path)
        self.install(name, str(path), self.shard.own_layers(factors))
        if self.shard.config is not None:
            self.pending.append(AdapterShipment(name, str(path), self.slots[name], factors))

    def take_pending(self) -> list[AdapterShipment]:
        """The adapters added since the last message to the other ranks (the executor sends them with the next)."""
        pending, self.pending = self.pending, []
        return pending

    def receive(self, shipment: AdapterShipment) -> None:
        """On a rank other than the driver: serve an adapter the driver added (this rank's layers of it), in the
        driver's slot."""
        if shipment.slot != (slot := len(self.slots) + 1):
            raise RuntimeError(f"adapter '{shipment.name}' arrived for slot {shipment.slot}, this rank's next: {slot}")
        self.install(shipment.name, shipment.path, shipment.factors)

    def read(self, name: str, path: str | os.PathLike) -> Factors:
        """The adapter in ``path`` checked against the whole model (:meth:`full_model`) for serving as ``name``: its
        factors by projection (``layers.0.self_attn.q_proj`` -> (A, s * B in float32)); nothing changes."""
        if not isinstance(name, str) or not name:
            raise LoRAError(f"a LoRA adapter needs a non-empty name, got {name!r}")
        if name in self.slots:
            raise LoRAError(f"the engine serves an adapter named '{name}' already ({self.paths[name]})")
        if lora_layers(self.model):
            raise LoRAError(
                "the engine's model carries trained LoRA layers already: serve adapters by name on a plain base model"
            )
        model = self.full_model()
        config, tensors = read_adapter(model, path)
        targets = [(i, TARGETS[t]) for i in range(len(model.layers)) for t in config.targets]
        for i, target in targets:
            module = model.layers[i].get_submodule(target)
            if type(module) not in self.adaptable:
                raise LoRAError(
                    f"layers.{i}.{target} is a {type(module).__name__}: multi-LoRA serving adapts plain nn.Linear "
                    "projections only"
                )
        return {
            f"layers.{i}.{target}": (
                tensors[f"layers.{i}.{target}.lora_A.weight"],
                tensors[f"layers.{i}.{target}.lora_B.weight"].float() * config.scaling,
            )
            for i, target in targets
        }

    def install(self, name: str, path: str, factors: Factors) -> None:
        """Serve ``factors`` (this shard's layers of :meth:`read`'s) as adapter ``name`` in the next slot, on the
        projections they name, each its part of them."""
        slot = len(self.slots) + 1
        for key, (a, b) in factors.items():
            _, index, target = key.split(".", 2)
            proj = self._wrap(int(index), target)
            a, b = proj.local_factors(a, b, self.shard.axis)
            w = proj.weight
            proj.factors[slot] = (a.to(w.device, w.dtype), b.to(w.device, w.dtype))
        self.slots[name] = slot
        self.paths[name] = path

    def update(self, name: str, factors: Factors, sliced: bool = False) -> None:
        """New factors (:meth:`read`'s form) for served adapter ``name``, or (``sliced``) this rank's parts of them
        already: they overwrite its slot's in place (nothing is shipped: the caller runs on every rank, as the RL
        engine's adapter sync does)."""
        slot = self.slot(name)
        for key, (a, b) in factors.items():
            _, index, target = key.split(".", 2)
            proj = self._wrap(int(index), target)
            new = (a, b) if sliced else proj.local_factors(a, b, self.shard.axis)
            for old, part in zip(proj.factors[slot], new, strict=True):
                old.copy_(part)

    def wrapper(self, module: nn.Module) -> LoRAProjection:
        """``module`` wrapped to apply the adapters (a tensor-parallel shard's row-parallel layers add their term
        before their all-reduce; a column-parallel layer must not gather its output)."""
        if isinstance(module, RowParallelLinear):
            return RowParallelLoRAProjection(module, self.rows)
        if isinstance(module, ColumnParallelLinear) and module.gather_output:
            raise RuntimeError(f"a column-parallel projection that gathers its output is no LoRA target: {module}")
        return LoRAProjection(module, self.rows)  # type: ignore[arg-type]

    def projections(self) -> list[LoRAProjection]:
        return [m for m in self.model.modules() if isinstance(m, LoRAProjection)]

    def _wrap(self, index: int, target: str) -> LoRAProjection:
        parent_name, _, attr = target.rpartition(".")
        parent = self.model.layers[index].get_submodule(parent_name)
        module = getattr(parent, attr)
        if isinstance(module, LoRAProjection):
            return module
        wrapped = self.wrapper(module)
        setattr(parent, attr, wrapped)
        return wrapped

    def row_groups(self, slots: list[int], device: torch.device) -> list[tuple[int, torch.Tensor | None]]:
        """``slots``: the adapter slot of every row of the flat batch -> the adapters' row groups (the base's rows
        need none; one adapter over every row needs no indices)."""
        present = sorted(set(slots) - {0})
        if not present:
            return []
        if len(present) == 1 and 0 not in slots:
            return [(present[0], None)]
        index = torch.tensor(slots)
        return [(s, torch.nonzero(index == s).flatten().to(device)) for s in present]

    @contextmanager
    def active(self, slots: list[int] | None, device: torch.device) -> Iterator[None]:
        """Inside the block the wrapped projections apply each row's adapter (``slots``: one per row of the step's
        flat batch; None or all 0: the base alone)."""
        self.rows.groups = self.row_groups(slots, device) if slots else []
        try:
            yield
        finally:
            self.rows.groups = []
