"""Weight sync by resharding: a trainer's layout written straight into a tensor-parallel engine's shard, so no rank
ever holds the whole model (verl's "3D-HybridEngine" reshards its actor into the rollout engine's layout the same
way, instead of gathering it).

The engine's shard on rank r of an N-way group is the Megatron split of
:func:`~spinwheel.parallel.tensor.apply_tensor_parallel` (column layers: rows r·out/N..; row layers: columns
r·in/N..; vocabulary rows r·V/N..; norms and row-layer biases whole). :func:`empty_shard` builds it without any
full weight (on the meta device, then only the shard's storage). :class:`Resharder` fills it from the trainer, per
source layout (a world of M·N ranks holds M engines; global rank g·N + r is engine rank r of engine g):

* trainer ``--tp N`` (× any dp, the TP groups being the engines): the trainer's tensor-parallel slices *are* the
  engine's — each rank copies its own, no communication (under ZeRO-3 / FSDP over the dp ranks the slices are
  gathered over them as below, whole);
* DDP / ZeRO-1/2 over any dp: every rank holds the full weights already — it copies its slice of each;
* ZeRO-3 / FSDP / HSDP over any dp (``dp W``, or ``dp_shard`` under HSDP): unit by unit (one block, or the root:
  embedding, norm, head) and within a unit bucket by bucket (``bucket_mb``), the flat shards are all-gathered over
  the trainer's sharding group into one temporary buffer, the rank keeps the parts of its engine rank's slices the
  buffer holds and frees it before the next — the most a rank materialises at once is one bucket (at most its
  largest unit), never the model.

:meth:`Resharder.sync` returns the largest temporary it materialised (bytes): the per-rank peak the RL loop logs.
A LoRA trainer's adapter factors are skipped (:func:`is_adapter_factor`): the shard gets the frozen base, once, and
the RL loop serves the adapters as an adapter slot it updates after each step (``engine_tp.PolicyAdapter``).
"""

from __future__ import annotations

import dataclasses

import torch

from spinwheel.models.config import ModelConfig
from spinwheel.models.transformer import RotaryEmbedding, Transformer
from spinwheel.parallel.comm import Comm
from spinwheel.parallel.data.flat_param import FlatParamUnit
from spinwheel.parallel.data.fsdp import FullyShardedDataParallel
from spinwheel.parallel.mesh import Axis
from spinwheel.parallel.parallelize import ParallelModel
from spinwheel.parallel.tensor import apply_tensor_parallel

DEFAULT_BUCKET_MB = 16.0  # the most a ZeRO-3/FSDP sync gathers at once (all ranks' pieces together)


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
    over ``axis`` with ``shard_dims``). Collective under ZeRO-3 / FSDP: every rank calls :meth:`sync`. Their units
    are gathered in buckets of at most ``bucket_mb`` (all ranks' pieces together): a unit larger than that (the
    root's embedding and head, a wide block) never exists whole on any rank either."""

    def __init__(
        self,
        pm: ParallelModel,
        shard: Transformer,
        shard_dims: dict[str, int],
        axis: Axis,
        bucket_mb: float = DEFAULT_BUCKET_MB,
    ) -> None:
        n, d = axis.size, pm.dims
        if d.pp > 1 or d.tp not in (1, n) or d.world_size % n:
            raise ValueError(
                f"resharding into engine TP {n} needs no pipeline stages, the trainer's tp 1 or {n} and a world "
                f"that {n} divides; got dp {d.dp}, tp {d.tp}, pp {d.pp}, world {d.world_size}"
            )
        if pm.dims.tp > 1 and (pm.dims.tp_axis.ranks != axis.ranks or pm.dims.tp_axis.rank != axis.rank):
            raise ValueError("the trainer's tensor-parallel ranks must be the engine's, in the same order")
        self.pm, self.shard_dims, self.axis = pm, shard_dims, axis
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.sliced = pm.dims.tp > 1  # the trainer's tensors are tensor-parallel slices already
        self.targets = dict(shard.named_parameters(remove_duplicate=False))

    @torch.no_grad()
    def sync(self) -> int:
        """Write the trainer's current weights into the shard; returns the largest temporary buffer (bytes)."""
        module, peak, done = self.pm.module, 0, set()
        if isinstance(module, FullyShardedDataParallel):
            for unit in module.units:
                peak = max(peak, self._sync_unit(unit, done))
        else:  # DDP, ZeRO-1/2 (full weights on every rank) or the trainer's TP slices
            for name, p in self.pm.stage.named_parameters(remove_duplicate=False):
                if not is_adapter_factor(name):  # LoRA: the shard holds the base; its adapter slot the factors
                    self._copy(name, p.detach(), done)
        missing = sorted(set(self.targets) - done)
        if missing:
            raise RuntimeError(f"resharding left engine parameters unwritten: {missing[:3]}")
        return peak

    def _sync_unit(self, unit: FlatParamUnit, done: set[str]) -> int:
        """All-gather ``unit``'s flat shards bucket by bucket; each rank writes the parts of its slices a bucket
        holds and drops the rest. Returns the bucket's bytes."""
        n, s, shard = unit.axis.size, unit.shard_size, unit.shard.detach()
        width = max(1, min(s, self.bucket_bytes // (n * shard.element_size())))  # elements of each rank's shard
        starts = [sum(unit.sizes[:i]) for i in range(len(unit.sizes))]  # where each parameter begins in the flat
        peak = 0
        for offset in range(0, s, width):
            w = min(width, s - offset)
            out = torch.empty(n, w, dtype=shard.dtype, device=shard.device)  # row j: flat [j·s + offset, + w)
            self.pm.dims.comm.all_gather(out.view(-1), shard[offset : offset + w], unit.axis)
            peak = max(peak, out.numel() * out.element_size())
            for j in range(n):
                lo = j * s + offset
                for name, _, _, i in unit.refs:
                    a, b = max(lo, starts[i]), min(lo + w, starts[i] + unit.sizes[i])
                    if a < b:
                        self._write(name, unit.shapes[i], out[j, a - lo : b - lo], a - starts[i], done)
            del out  # freed before the next bucket is gathered
        return peak

    def _write(self, name: str, shape: torch.Size, seg: torch.Tensor, start: int, done: set[str]) -> None:
        """Elements [start, start + len(seg)) of parameter ``name`` (``shape``, row-major): the part of them in
        this rank's slice goes to the engine's shard."""
        dst = self._target(name)
        rows, cols = shape[0], shape.numel() // shape[0]  # a 1-D parameter as one column
        dim = None if self.sliced else self.shard_dims.get(name)
        r, n = self.axis.rank, self.axis.size
        keep_rows = (r * rows // n, (r + 1) * rows // n) if dim == 0 else (0, rows)
        keep_cols = (r * cols // n, (r + 1) * cols // n) if dim == 1 else (0, cols)
        view = dst.view(keep_rows[1] - keep_rows[0], keep_cols[1] - keep_cols[0])
        write_block(view, seg, start, cols, keep_rows, keep_cols)
        done.add(name)

    def _target(self, name: str) -> torch.Tensor:
        dst = self.targets.get(name)
        if dst is None:
            raise KeyError(f"the trainer's parameter {name!r} has no place in the engine's shard")
        return dst

    def _copy(self, name: str, src: torch.Tensor, done: set[str]) -> None:
        dst = self._target(name)
        if not self.sliced and name in self.shard_dims:
            src = src.chunk(self.axis.size, dim=self.shard_dims[name])[self.axis.rank]  # a view: nothing copied
        if src.shape != dst.shape:
            raise ValueError(f"{name}: the trainer's slice {tuple(src.shape)} is not the engine's {tuple(dst.shape)}")
        dst.copy_(src)
        done.add(name)


def is_adapter_factor(name: str) -> bool:
    """Whether trainer parameter ``name`` is a LoRA factor (the engine serves those as an adapter slot,
    :class:`~spinwheel.rl.llm.rollouts.engine_tp.PolicyAdapter`, not as shard weights)."""
    return ".lora_A." in name or ".lora_B." in name


def write_block(
    dst: torch.Tensor, seg: torch.Tensor, start: int, cols: int, rows_kept: tuple[int, int], cols_kept: tuple[int, int]
) -> None:
    """Copy the elements of ``seg`` (a run of a (R, ``cols``) matrix's row-major elements beginning at ``start``)
    that fall in rows ``rows_kept`` × columns ``cols_kept`` into ``dst`` (that block). The run is a partial first
    row, whole rows, a partial last row: at most three copies, no index tensors."""
    pos, end = start, start + seg.numel()
    while pos < end:
        row, col = divmod(pos, cols)
        if col == 0 and end - pos >= cols:  # whole rows
            count = (end - pos) // cols
            block = seg[pos - start : pos - start + count * cols].view(count, cols)
            lo, hi = max(row, rows_kept[0]), min(row + count, rows_kept[1])
            if lo < hi:
                dst[lo - rows_kept[0] : hi - rows_kept[0]].copy_(
                    block[lo - row : hi - row, cols_kept[0] : cols_kept[1]]
                )
            pos += count * cols
        else:  # part of one row
            stop = min(end, (row + 1) * cols)
            c0, c1 = max(col, cols_kept[0]), min(stop - row * cols, cols_kept[1])
            if rows_kept[0] <= row < rows_kept[1] and c0 < c1:
                piece = seg[row * cols + c0 - start : row * cols + c1 - start]
                dst[row - rows_kept[0], c0 - cols_kept[0] : c1 - cols_kept[0]].copy_(piece)
            pos = stop
