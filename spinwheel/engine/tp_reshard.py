"""Weight sync by resharding: a trainer's layout written straight into a tensor-parallel engine's shard, so no rank
ever holds the whole model (verl's "3D-HybridEngine" reshards its actor into the rollout engine's layout the same
way, instead of gathering it).

The engine's shard on rank r of an N-way group is the Megatron split of
:func:`~spinwheel.parallel.tensor.apply_tensor_parallel` (column layers: rows r·out/N..; row layers: columns
r·in/N..; vocabulary rows r·V/N..; norms and row-layer biases whole). :func:`empty_shard` builds it without any
full weight (on the meta device, then only the shard's storage). :class:`Resharder` fills it from the trainer, per
source layout (the world is the engine's N ranks, rank r = engine rank r):

* trainer ``--tp N``: the trainer's tensor-parallel slices *are* the engine's — each rank copies its own, no
  communication;
* DDP / ZeRO-1/2 over ``dp N``: every rank holds the full weights already — it copies its slice of each;
* ZeRO-3 / FSDP / HSDP over ``dp N``: unit by unit (one block, or the root: embedding, norm, head), the flat
  shards are all-gathered into one temporary buffer, the rank keeps its slice of each parameter and frees the
  buffer before the next unit — the most a rank materialises at once is its largest unit, never the model.

:meth:`Resharder.sync` returns the largest temporary it materialised (bytes): the per-rank peak the RL loop logs.
"""

from __future__ import annotations

import dataclasses

import torch

from spinwheel.models.config import ModelConfig
from spinwheel.models.transformer import RotaryEmbedding, Transformer
from spinwheel.parallel.comm import Comm
from spinwheel.parallel.fsdp import FullyShardedDataParallel
from spinwheel.parallel.mesh import Axis
from spinwheel.parallel.parallelize import ParallelModel
from spinwheel.parallel.tensor import apply_tensor_parallel


def local_config(config: ModelConfig, n: int) -> ModelConfig:
    """``config`` with one rank's head counts (they size its KV cache); the head size stays the model's."""
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // n,
        num_key_value_heads=config.num_key_value_heads // n,  # type: ignore[operator]
        head_dim=config.head_dim,
    )


def empty_shard(
    config: ModelConfig, axis: Axis, comm: Comm, device: torch.device, dtype: torch.dtype
) -> tuple[Transformer, dict[str, int]]:
    """This rank's engine shard with uninitialised weights (only the shard's storage is allocated) and the dim
    each sharded parameter is split on; fill it with :class:`Resharder`."""
    with torch.device("meta"):
        model = Transformer(config).to(dtype)
        shard_dims = apply_tensor_parallel(model, axis, comm)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = RotaryEmbedding(config).to(device)  # its buffer is computed, not loaded
    model.requires_grad_(False)
    model.config = local_config(config, axis.size)
    return model.eval(), shard_dims


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters, tied ones once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


class Resharder:
    """Copies the trainer's weights (``pm``, the trainer's parallel model) into ``shard`` (``empty_shard``'s, split
    over ``axis`` with ``shard_dims``). Collective under ZeRO-3 / FSDP: every rank calls :meth:`sync`."""

    def __init__(self, pm: ParallelModel, shard: Transformer, shard_dims: dict[str, int], axis: Axis) -> None:
        if pm.dims.pp > 1 or pm.dims.tp not in (1, axis.size) or pm.dims.tp * pm.dims.dp != axis.size:
            raise ValueError(
                f"resharding into engine TP {axis.size} needs the trainer on dp {axis.size} or tp {axis.size} alone, "
                f"got dp {pm.dims.dp}, tp {pm.dims.tp}, pp {pm.dims.pp}"
            )
        if pm.dims.tp > 1 and (pm.dims.tp_axis.ranks != axis.ranks or pm.dims.tp_axis.rank != axis.rank):
            raise ValueError("the trainer's tensor-parallel ranks must be the engine's, in the same order")
        self.pm, self.shard_dims, self.axis = pm, shard_dims, axis
        self.sliced = pm.dims.tp > 1  # the trainer's tensors are tensor-parallel slices already
        self.targets = dict(shard.named_parameters(remove_duplicate=False))

    @torch.no_grad()
    def sync(self) -> int:
        """Write the trainer's current weights into the shard; returns the largest temporary buffer (bytes)."""
        module, peak, done = self.pm.module, 0, set()
        if isinstance(module, FullyShardedDataParallel):
            comm = self.pm.dims.comm
            for unit in module.units:
                flat = torch.empty(unit.padded_numel, dtype=unit.shard.dtype, device=unit.shard.device)  # (N·s,)
                comm.all_gather(flat, unit.shard.detach(), unit.axis)
                peak = max(peak, flat.numel() * flat.element_size())
                pieces = torch.split(flat, unit.split_sizes)
                for name, _, _, i in unit.refs:
                    self._copy(name, pieces[i].view(unit.shapes[i]), done)
                del flat, pieces  # freed before the next unit is gathered
        else:  # DDP, ZeRO-1/2 (full weights on every rank) or the trainer's TP slices
            for name, p in self.pm.stage.named_parameters(remove_duplicate=False):
                self._copy(name, p.detach(), done)
        missing = sorted(set(self.targets) - done)
        if missing:
            raise RuntimeError(f"resharding left engine parameters unwritten: {missing[:3]}")
        return peak

    def _copy(self, name: str, src: torch.Tensor, done: set[str]) -> None:
        dst = self.targets.get(name)
        if dst is None:
            raise KeyError(f"the trainer's parameter {name!r} has no place in the engine's shard")
        if not self.sliced and name in self.shard_dims:
            src = src.chunk(self.axis.size, dim=self.shard_dims[name])[self.axis.rank]  # a view: nothing copied
        if src.shape != dst.shape:
            raise ValueError(f"{name}: the trainer's slice {tuple(src.shape)} is not the engine's {tuple(dst.shape)}")
        dst.copy_(src)
        done.add(name)
