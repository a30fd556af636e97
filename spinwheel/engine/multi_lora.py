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
:class:`~spinwheel.engine.block_manager.BlockManager`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from spinwheel.models.lora import TARGETS, LoRAError, lora_layers
from spinwheel.models.lora_io import read_adapter
from spinwheel.models.transformer import Transformer


@dataclass
class ActiveRows:
    """The step's rows by adapter: (slot, row indices (R,) int64 into the flat batch, or None for every row)."""

    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)


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

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, adapters={len(self.factors)}"


class AdapterRegistry:
    """The adapters an engine serves over its model, by name; slot 0 is the base (no adapter)."""

    adaptable: tuple[type, ...] = (nn.Linear, LoRAProjection)  # the projections an adapter may target

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.slots: dict[str, int] = {}
        self.paths: dict[str, str] = {}
        self.rows = ActiveRows()

    @property
    def names(self) -> list[str]:
        return list(self.slots)

    def slot(self, name: str | None) -> int:
        """The slot of adapter ``name`` (0 for None, the base); an unknown name is a ValueError."""
        if name is None:
            return 0
        if name not in self.slots:
            known = ", ".join(self.slots) or "none are registered"
            raise ValueError(f"unknown LoRA adapter '{name}' (the engine serves: {known})")
        return self.slots[name]

    def add(self, name: str, path: str | os.PathLike) -> None:
        """Serve the PEFT adapter in ``path`` as ``name``. It is checked against the model before anything changes:
        one whose base differs is a one-line :class:`LoRAError`. Names are never reused (the prefix cache keys K/V by
        adapter name, so another adapter under an old name would read stale K/V)."""
        self.install(name, str(path), self.read(name, path, self.model))

    def read(self, name: str, path: str | os.PathLike, model: Transformer) -> dict[str, tuple[torch.Tensor, ...]]:
        """The adapter in ``path`` checked against ``model`` (the served model's shapes) for serving as ``name``:
        its factors by projection (``layers.0.self_attn.q_proj`` -> (A, s * B in float32)); nothing changes."""
        if not isinstance(name, str) or not name:
            raise LoRAError(f"a LoRA adapter needs a non-empty name, got {name!r}")
        if name in self.slots:
            raise LoRAError(f"the engine serves an adapter named '{name}' already ({self.paths[name]})")
        if lora_layers(self.model):
            raise LoRAError(
                "the engine's model carries trained LoRA layers already: serve adapters by name on a plain base model"
            )
        config, tensors = read_adapter(model, path)
        targets = [(i, TARGETS[t]) for i in range(len(self.model.layers)) for t in config.targets]
        for i, target in targets:
            module = self.model.layers[i].get_submodule(target)
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

    def install(self, name: str, path: str, factors: dict[str, tuple[torch.Tensor, ...]]) -> None:
        """Serve ``factors`` (:meth:`read`'s) as adapter ``name`` in the next slot, on the projections they name."""
        slot = len(self.slots) + 1
        for key, (a, b) in factors.items():
            _, index, target = key.split(".", 2)
            proj = self._wrap(int(index), target)
            a, b = self.local_factors(proj, a, b)
            w = proj.weight
            proj.factors[slot] = (a.to(w.device, w.dtype), b.to(w.device, w.dtype))
        self.slots[name] = slot
        self.paths[name] = path

    def local_factors(self, proj: LoRAProjection, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The part of an adapter's (A, s * B) that ``proj`` applies (all of it here; a shard's slice under TP)."""
        return a, b

    def wrapper(self, module: nn.Module) -> LoRAProjection:
        """``module`` wrapped to apply the adapters (a tensor-parallel registry wraps its sharded layers)."""
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
