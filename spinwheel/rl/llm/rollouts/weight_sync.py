"""What one update sends to an engine that holds its own copy of the policy (the ``--max-staleness`` producer's).

Without LoRA every weight changes at every update, so the trainer publishes the whole state dict. With LoRA
(``--lora-rank``) the base is frozen and the engine copy already holds it (a copy taken at the start, adapters
included, unmerged): after each update only the adapters' factors (``lora_A`` / ``lora_B``) and any other
parameter that trains are sent, and the engine loads them into its own LoRA layers in place
(:meth:`~spinwheel.engine.llm_engine.LLMEngine.update_weights` takes a partial state dict), so it serves base +
adapter without ever merging them.

The figures of each update go to ``metrics.jsonl``: ``sync_bytes`` (what the update sent: the adapters' bytes under
LoRA, every weight's otherwise), ``sync_load_s`` (the producer's seconds to load the newest version into its
engine, prefix-cache drop included) beside the trainer's own copy time ``time/sync``. With ``--rollout-engine
process`` the child builds the same LoRA layers and the shared-memory copy moves the adapters alone as well
(``weight_publish_mb``). Under ``--engine-tp N`` the synchronous loop's tensor-parallel engine does the same for
LoRA: its shards keep the base and each update writes every rank's slice of the adapters
(:class:`~spinwheel.rl.llm.rollouts.engine_tp.PolicyAdapter`, ``sync_bytes`` per step).
"""

from __future__ import annotations

import torch
from torch import nn

from spinwheel.models.lora import lora_layers


def sync_keys(model: nn.Module) -> list[str]:
    """The state-dict names an update changes in an engine copy of ``model``: with LoRA layers the tensors that
    train (the adapters; the frozen base never changes), else every tensor but the rotary tables (derived)."""
    if lora_layers(model):
        return [k for k, p in model.named_parameters() if p.requires_grad]
    return [k for k in model.state_dict() if not k.startswith("rotary.")]


def sync_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of the :func:`sync_keys` tensors of ``model``: what one update sends to an engine copy (the
    trainer goes on updating its own tensors in place)."""
    if lora_layers(model):  # the parameters that train, without building the whole state dict
        return {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.startswith("rotary.")}


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """The bytes of a state dict's tensors: what one sync moves."""
    return sum(t.numel() * t.element_size() for t in state.values())
