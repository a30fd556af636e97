"""Many trainable LoRA adapters on one frozen base, each row of a batch through its own client's adapter.

Reference: Hu et al., 2021 (LoRA) and, for running several adapters in one batch, S-LoRA / Punica (Sheng et al.,
2023; Chen et al., 2023) — the engine's :mod:`~spinwheel.engine.multi_lora` does the same for inference. Here the
factors are trainable: a projection with base weight W computes, for the rows ``rows_c`` of client c,

    y[rows_c] = x[rows_c] W^T + b + s_c (x[rows_c] A_c^T) B_c^T,     s_c = alpha_c / r_c

where a batch is ordered by client, so ``rows_c`` is one slice of the flattened activations: each client's low-rank
term is computed on its slice (a view, no gather) and the terms are concatenated and added once. Autograd through the
slices gives each client's A, B exactly the gradient of its own rows in one backward over a batch mixing clients.
A and B are drawn as :class:`~spinwheel.models.lora.LoRALinear` draws them (A kaiming-uniform from a seeded generator
in the order :func:`~spinwheel.models.lora.apply_lora` visits the layers, B = 0), so a client created with seed k
starts where ``apply_lora(model, config, seed=k)`` starts (the exactness test's reference).

:class:`MultiLoRAProjection` subclasses the engine's :class:`~spinwheel.engine.multi_lora.LoRAProjection`, so the
sampling engine serves saved adapters on the very same modules (one copy of the base for training and sampling).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from spinwheel.engine.multi_lora import ActiveRows, AdapterRegistry, LoRAProjection
from spinwheel.models.lora import ALL_TARGETS, TARGETS, LoRAConfig, LoRAError
from spinwheel.models.transformer import Transformer

ATTN_TARGETS = ("q", "k", "v", "o")
MLP_TARGETS = ("gate", "up", "down")


@dataclass
class TrainRows:
    """The rows of the current training batch by client: (client id, start, stop) — each client's sequences are
    consecutive in the batch, so its rows are one slice of the flattened (B * T, C) activations."""

    groups: list[tuple[str, int, int]] = field(default_factory=list)


class MultiLoRAProjection(LoRAProjection):
    """A frozen projection plus every client's trainable (A, B) on it, and the engine's served adapters."""

    def __init__(self, base: nn.Linear, rows: ActiveRows, train_rows: TrainRows) -> None:
        super().__init__(base, rows)
        self.train_rows = train_rows
        # client id -> (A (r, in), B (out, r), scaling); A and B are the client's Parameters
        self.clients: dict[str, tuple[nn.Parameter, nn.Parameter, float]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)  # base, plus the engine's adapters while it samples
        if not self.train_rows.groups:
            return y
        flat = x.reshape(-1, self.in_features)
        deltas = []
        for client, start, stop in self.train_rows.groups:
            factors = self.clients.get(client)
            if factors is None:  # this client does not adapt this projection
                deltas.append(torch.zeros(stop - start, self.out_features, dtype=y.dtype, device=y.device))
                continue
            a, b, scaling = factors
            deltas.append((F.linear(F.linear(flat[start:stop].to(a.dtype), a), b) * scaling).to(y.dtype))
        delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas)
        return (y.reshape(-1, self.out_features) + delta).view(y.shape)


def install(model: Transformer, registry: AdapterRegistry) -> TrainRows:
    """Wrap every adaptable projection of ``model`` (all of q k v o gate up down in every layer) in place, sharing
    the engine registry's row groups; make the registry accept the wrapped modules. Returns the training rows."""
    train_rows = TrainRows()
    for block in model.layers:
        for target in ALL_TARGETS:
            parent_name, _, attr = TARGETS[target].rpartition(".")
            parent = block.get_submodule(parent_name)
            base = getattr(parent, attr)
            if type(base) is not nn.Linear:
                raise LoRAError(f"{TARGETS[target]} is a {type(base).__name__}: the service adapts plain nn.Linear")
            setattr(parent, attr, MultiLoRAProjection(base, registry.rows, train_rows))
    for p in model.parameters():
        p.requires_grad_(False)
    registry.adaptable = (*AdapterRegistry.adaptable, MultiLoRAProjection)
    return train_rows


def targets_for(train_attn: bool, train_mlp: bool) -> tuple[str, ...]:
    """The Tinker LoRA switches -> spinwheel's target names (the unembedding is not adapted here)."""
    targets = (ATTN_TARGETS if train_attn else ()) + (MLP_TARGETS if train_mlp else ())
    if not targets:
        raise LoRAError("train_attn and train_mlp are both off: adapt at least one of them")
    return targets


def projections(model: Transformer, config: LoRAConfig) -> Iterator[tuple[str, MultiLoRAProjection]]:
    """The adapted projections in :func:`~spinwheel.models.lora.apply_lora`'s order (layer, then target)."""
    for idx, block in enumerate(model.layers):
        for target in config.targets:
            yield f"layers.{idx}.{TARGETS[target]}", block.get_submodule(TARGETS[target])


class ClientAdapter:
    """One training client's adapter: its factors by projection name and their AdamW state (adapters only)."""

    def __init__(self, client: str, model: Transformer, config: LoRAConfig, seed: int | None) -> None:
        self.client, self.config = client, config
        self.params: dict[str, nn.Parameter] = {}  # layers.0.self_attn.q_proj.lora_A.weight -> Parameter
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, proj in projections(model, config):
            if config.rank > min(proj.in_features, proj.out_features):
                raise LoRAError(
                    f"LoRA rank {config.rank} exceeds {name}'s dimensions ({proj.in_features} -> "
                    f"{proj.out_features}): use a rank of at most {min(proj.in_features, proj.out_features)}"
                )
            dtype = torch.float32 if proj.weight.dtype in (torch.float16, torch.bfloat16) else proj.weight.dtype
            init = torch.empty(config.rank, proj.in_features, dtype=torch.float32)
            nn.init.kaiming_uniform_(init, a=math.sqrt(5), generator=gen)
            a = nn.Parameter(init.to(device=proj.weight.device, dtype=dtype))
            b = nn.Parameter(torch.zeros(proj.out_features, config.rank, device=proj.weight.device, dtype=dtype))
            self.params[f"{name}.lora_A.weight"], self.params[f"{name}.lora_B.weight"] = a, b
            proj.clients[client] = (a, b, config.scaling)
        self.reset_optimizer()

    def reset_optimizer(self) -> None:
        """A fresh AdamW over the adapter's parameters (hyper-parameters come with each step)."""
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=1e-4, betas=(0.9, 0.95), eps=1e-12)
        self.num_steps = 0

    def detach(self, model: Transformer) -> None:
        """Take this client's factors off the model (the client is gone)."""
        for _, proj in projections(model, self.config):
            proj.clients.pop(self.client, None)

    def load_factors(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(tensors[name])


@contextmanager
def rows_of(train_rows: TrainRows, clients: list[str], seq_len: int) -> Iterator[None]:
    """Inside the block, sequence i of a (B, T = ``seq_len``) batch runs through ``clients[i]``'s adapter; each
    client's sequences must be consecutive (the trainer orders a batch by client)."""
    groups: list[tuple[str, int, int]] = []
    for i, c in enumerate(clients):
        if groups and groups[-1][0] == c:
            groups[-1] = (c, groups[-1][1], (i + 1) * seq_len)
        elif any(g[0] == c for g in groups):
            raise ValueError(f"rows_of: client '{c}' has sequences apart in the batch; order the batch by client")
        else:
            groups.append((c, i * seq_len, (i + 1) * seq_len))
    train_rows.groups = groups
    try:
        yield
    finally:
        train_rows.groups = []
