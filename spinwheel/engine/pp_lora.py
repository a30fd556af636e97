"""LoRA adapters and weight updates on the pipeline-parallel engine: each stage holds only its own layers' part.

Adapters (as :mod:`~spinwheel.engine.tp_lora` does for tensor parallelism): the driver alone reads and checks a PEFT
directory, against the whole model's shapes (a meta-device model: a bad adapter is the same one-line
:class:`~spinwheel.models.lora.LoRAError` as on one device, and no stage has changed), installs the factors of its
own layers at once, and queues the adapter; the next message the driver sends each stage carries that stage's
layers' factors (renumbered as the stage numbers its layers), which the stage installs in the driver's slot before
anything else in the message. Rows reach every stage with their adapter slot: ``StepInputs.lora_slots`` travels in
every :class:`~spinwheel.engine.pp_stage.PPStep`, and every stage (the last one too) applies its layers' adapters.

Why an adapter is always there in time: a stage reads its pipe in order and runs each iteration before reading the
next message, and the driver ships the queued adapters with the first message it sends after the adapter was
added; an iteration that uses the adapter is scheduled after that, so its message comes later in every stage's
pipe. Iterations still in flight on the stages carry no rows of the new slot, so installing it under them changes
nothing they compute.

Weight updates follow the same order: the driver checks the names and shapes against the whole model (one device's
one-line errors: a KeyError for an unknown name, a RuntimeError for a wrong shape; names missing from a state dict
keep their weights, as on one device), loads its own part at once and sends each stage its part in a message of its
own. Every iteration already launched is ahead of that message in each pipe (and past stage 0), so it runs on the
old weights everywhere; every later one on the new weights everywhere.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from spinwheel.engine.multi_lora import AdapterRegistry
from spinwheel.engine.tp_lora import AdapterShipment
from spinwheel.engine.tp_update import checked_state
from spinwheel.models.config import ModelConfig
from spinwheel.models.lora import LoRAError, lora_layers
from spinwheel.models.transformer import Transformer


def full_model(config: ModelConfig) -> Transformer:
    """The whole model on the meta device (no storage): what adapters and weight updates are checked against."""
    with torch.device("meta"):
        return Transformer(config)


def stage_factors(factors: dict[str, tuple[torch.Tensor, ...]], layers: range) -> dict[str, tuple[torch.Tensor, ...]]:
    """An adapter's factors (``layers.5.self_attn.q_proj`` -> (A, s·B)) of the global ``layers``, renumbered from 0."""
    out = {}
    for key, value in factors.items():
        _, index, target = key.split(".", 2)
        if int(index) in layers:
            out[f"layers.{int(index) - layers.start}.{target}"] = value
    return out


class PPAdapterRegistry(AdapterRegistry):
    """The adapters a pipeline stage serves over its layers; on the driver, :meth:`add` also queues each adapter
    for the other stages (:meth:`take_pending`)."""

    def __init__(self, model: nn.Module, layers: range) -> None:
        super().__init__(model)  # type: ignore[arg-type]
        self.layers = layers  # this stage's global layer indices
        self.pending: list[AdapterShipment] = []  # whole adapters, not yet shipped to the other stages
        self._full: Transformer | None = None

    def full_model(self) -> Transformer:
        if self._full is None:
            self._full = full_model(self.model.full_config)  # type: ignore[attr-defined]
        return self._full

    def read(self, name: str, path: str | os.PathLike, model: Transformer) -> dict[str, tuple[torch.Tensor, ...]]:
        """:meth:`AdapterRegistry.read` over the whole (meta) model ``model``: every layer's factors."""
        if lora_layers(self.model):  # type: ignore[arg-type]
            raise LoRAError(
                "the engine's model carries trained LoRA layers already: serve adapters by name on a plain base model"
            )
        whole = AdapterRegistry(model)
        whole.slots, whole.paths = self.slots, self.paths  # the name checks see the adapters served
        return whole.read(name, path, model)

    def add(self, name: str, path: str | os.PathLike) -> None:
        """Serve the PEFT adapter in ``path`` as ``name`` on this stage now, on the others from the next message."""
        factors = self.read(name, path, self.full_model())
        shipment = AdapterShipment(name, str(path), len(self.slots) + 1, factors)
        self.install(name, str(path), stage_factors(factors, self.layers))
        self.pending.append(shipment)

    def take_pending(self) -> list[AdapterShipment]:
        """The adapters added since the last message to the stages (whole: :func:`stage_part` splits them)."""
        pending, self.pending = self.pending, []
        return pending

    def receive(self, shipment: AdapterShipment) -> None:
        """On a stage other than the driver: serve an adapter the driver added (its part already), in its slot."""
        if shipment.slot != (slot := len(self.slots) + 1):
            raise RuntimeError(f"adapter '{shipment.name}' came for slot {shipment.slot}, this stage's next is {slot}")
        self.install(shipment.name, shipment.path, shipment.factors)


def stage_part(shipment: AdapterShipment, layers: range) -> AdapterShipment:
    """``shipment`` with the factors of the global ``layers`` only (renumbered), as one stage receives it."""
    return AdapterShipment(shipment.name, shipment.path, shipment.slot, stage_factors(shipment.factors, layers))


def checked_update(
    model_or_state_dict: Transformer | dict[str, torch.Tensor], whole: Transformer
) -> dict[str, torch.Tensor]:
    """The tensors an ``update_weights`` call gives (a model's: all but the rotary buffer, as one device takes them),
    checked against the whole model ``whole`` before anything changes, as the tensor-parallel engine checks them
    (:func:`~spinwheel.engine.tp_update.checked_state`: one device's KeyError for an unknown name and RuntimeError
    for a wrong shape, in one line)."""
    return checked_state(model_or_state_dict, {name: (t.shape, None) for name, t in whole.state_dict().items()})


@torch.no_grad()
def load_stage_weights(runner, part: dict[str, torch.Tensor]) -> None:
    """Copy a stage's ``part`` of an update into its weights in place (the adapters' wrappers share them) and
    re-install the runner (repacks the CPU path's packed copies)."""
    runner.model.load_state_dict(part, strict=False)
    runner.install()
