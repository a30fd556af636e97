"""LoRA adapters and weight updates on the pipeline-parallel engine: each stage holds only its own layers' part.

Adapters (the stage's :class:`~spinwheel.engine.multi_lora.AdapterRegistry`, whose shard is its layers, as a
tensor-parallel rank's is its slices): the driver alone reads and checks a PEFT directory, against the whole model's
shapes (a meta-device model: a bad adapter is the same one-line :class:`~spinwheel.models.lora.LoRAError` as on one
device, and no stage has changed), installs the factors of its own layers at once, and queues the adapter; the next
message the driver sends each stage carries that stage's layers' factors (renumbered as the stage numbers its
layers), which the stage installs in the driver's slot before anything else in the message. Rows reach every stage
with their adapter slot: ``StepInputs.lora_slots`` travels in every :class:`~spinwheel.engine.parallel.tp_worker.Step`,
and
every stage (the last one too) applies its layers' adapters.

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

import torch

from spinwheel.engine.multi_lora import AdapterShipment, stage_factors
from spinwheel.engine.parallel.tp_update import checked_state
from spinwheel.models.transformer import Transformer


def stage_part(shipment: AdapterShipment, layers: range) -> AdapterShipment:
    """``shipment`` with the factors of the global ``layers`` only (renumbered), as one stage receives it."""
    return AdapterShipment(shipment.name, shipment.path, shipment.slot, stage_factors(shipment.factors, layers))


def checked_update(
    model_or_state_dict: Transformer | dict[str, torch.Tensor], whole: Transformer
) -> dict[str, torch.Tensor]:
    """The tensors an ``update_weights`` call gives (a model's: all but the rotary buffer, as one device takes them),
    checked against the whole model ``whole`` before anything changes, as the tensor-parallel engine checks them
    (:func:`~spinwheel.engine.parallel.tp_update.checked_state`: one device's KeyError for an unknown name and
    RuntimeError
    for a wrong shape, in one line)."""
    return checked_state(model_or_state_dict, {name: (t.shape, None) for name, t in whole.state_dict().items()})


@torch.no_grad()
def load_stage_weights(runner, part: dict[str, torch.Tensor]) -> None:
    """Copy a stage's ``part`` of an update into its weights in place (the adapters' wrappers share them) and
    re-install the runner (repacks the CPU path's packed copies)."""
    runner.model.load_state_dict(part, strict=False)
    runner.install()
