"""Multi-LoRA serving on the tensor-parallel engine: every rank applies its shard's slice of each adapter.

The split follows the base layer's (:mod:`spinwheel.parallel.tensor_lora` does the same for training): on a
column-parallel projection (q, k, v, gate, up: W split on its output features) A is whole and s·B split on its rows
like W, so a rank computes its own output features, adapter included; on a row-parallel one (o, down: W split on
its input features) A is split on its columns like W and s·B is whole, and the rank's term ``s B (A_r x_r)`` joins
its partial output BEFORE the layer's all-reduce, whose sum is then ``W x + s B A x`` exactly as on one device —
no collective is added. Rows of different adapters and of the base share a step as on one device
(:class:`~spinwheel.engine.multi_lora.AdapterRegistry`'s row groups, from the ``lora_slots`` every rank receives
with the step).

Adding an adapter: the driver alone reads and checks the PEFT directory (against the full model's shapes, so a bad
adapter is the same one-line :class:`~spinwheel.models.lora.LoRAError` as on one device, and no rank has changed),
installs its own slice at once, and queues the full factors; they travel to the other ranks with the next step the
driver ships (:class:`~spinwheel.engine.tp_worker.Step`'s ``adapters``), which every rank installs, in the same
slot, before that step's forward. Shipping rather than having each rank read the directory keeps the check in one
place (ranks cannot disagree on whether an adapter is valid, nor on its slot), needs no reply from the workers, and
works for both executors (the spawned workers' pipes and the RL engine's broadcasts) through the one message they
already carry; an adapter is r·(in + out) numbers per projection, sent once.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spinwheel.engine.multi_lora import ActiveRows, AdapterRegistry, LoRAProjection
from spinwheel.models.config import ModelConfig
from spinwheel.models.transformer import Transformer
from spinwheel.parallel.mesh import Axis
from spinwheel.parallel.tensor import ColumnParallelLinear, RowParallelLinear, reduce_from_tp


@dataclass
class AdapterShipment:
    """One adapter as the driver ships it to the other ranks: its name, the slot every rank gives it, and its full
    factors by projection (``layers.0.self_attn.q_proj`` -> (A, s·B)), on CPU."""

    name: str
    path: str
    slot: int
    factors: dict[str, tuple[torch.Tensor, ...]]


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


def full_config(local: ModelConfig, tp: int) -> ModelConfig:
    """The whole model's config from a rank's (whose head counts are 1/tp of the model's)."""
    return dataclasses.replace(
        local,
        num_attention_heads=local.num_attention_heads * tp,
        num_key_value_heads=local.num_key_value_heads * tp,  # type: ignore[operator]
    )


class TPAdapterRegistry(AdapterRegistry):
    """The adapters a tensor-parallel rank serves over its shard, each sliced like the layer it adapts; on the
    driver, :meth:`add` also queues the adapter for the other ranks (:meth:`take_pending`)."""

    adaptable = (ColumnParallelLinear, RowParallelLinear, LoRAProjection, RowParallelLoRAProjection)

    def __init__(self, model: Transformer, axis: Axis) -> None:
        super().__init__(model)
        self.axis = axis
        self.pending: list[AdapterShipment] = []
        self._full: Transformer | None = None
        self.default: str | None = None  # the adapter requests naming none run through (the RL policy's); None: base

    def slot(self, name: str | None) -> int:
        """:meth:`AdapterRegistry.slot`, where a request naming no adapter runs through :attr:`default` if set."""
        return super().slot(self.default if name is None else name)

    def update(self, name: str, factors: dict[str, tuple[torch.Tensor, ...]], sliced: bool = False) -> None:
        """New full factors (:meth:`read`'s form) for served adapter ``name``, or (``sliced``) this rank's slices of
        them already: they overwrite its slot's in place (no shipping: the caller runs on every rank, as the RL
        engine's adapter sync does)."""
        slot = self.slot(name)
        for key, (a, b) in factors.items():
            _, index, target = key.split(".", 2)
            proj = self._wrap(int(index), target)
            for old, new in zip(proj.factors[slot], (a, b) if sliced else self.local_factors(proj, a, b), strict=True):
                old.copy_(new)

    def full_model(self) -> Transformer:
        """The whole model on the meta device (no storage): what an adapter's shapes are checked against."""
        if self._full is None:
            with torch.device("meta"):
                self._full = Transformer(full_config(self.model.config, self.axis.size))
        return self._full

    def add(self, name: str, path: str | os.PathLike) -> None:
        """Serve the PEFT adapter in ``path`` as ``name`` on this rank now, and on the others from the next step."""
        factors = self.read(name, path, self.full_model())
        shipment = AdapterShipment(name, str(path), len(self.slots) + 1, factors)
        self.install(name, str(path), factors)
        self.pending.append(shipment)

    def receive(self, shipment: AdapterShipment) -> None:
        """On a rank other than the driver: serve an adapter the driver added, in the driver's slot."""
        if shipment.slot != len(self.slots) + 1:
            raise RuntimeError(
                f"adapter '{shipment.name}' arrived for slot {shipment.slot}, this rank's next is {len(self.slots) + 1}"
            )
        self.install(shipment.name, shipment.path, shipment.factors)

    def take_pending(self) -> list[AdapterShipment]:
        """The adapters added since the last step shipped (the driver sends them with the next one)."""
        pending, self.pending = self.pending, []
        return pending

    def wrapper(self, module) -> LoRAProjection:
        if isinstance(module, RowParallelLinear):
            return RowParallelLoRAProjection(module, self.rows)
        if module.gather_output:
            raise RuntimeError(f"a column-parallel projection that gathers its output is no LoRA target: {module}")
        return LoRAProjection(module, self.rows)

    def local_factors(self, proj: LoRAProjection, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Column-parallel: A whole, s·B's rows of this shard; row-parallel: A's columns of this shard, s·B whole."""
        n, r = self.axis.size, self.axis.rank
        if isinstance(proj, RowParallelLoRAProjection):
            return a.chunk(n, dim=1)[r].clone(), b
        return a, b.chunk(n, dim=0)[r].clone()  # a copy: the slice alone stays
