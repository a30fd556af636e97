"""Optimizer-side operations that need the whole model but see only this rank's shards: global gradient-norm
clipping and decoupled weight decay chosen by parameter name.

Each rank holds some elements of the model's (reduced) gradients and of the tensors its optimizer steps —
:func:`local_shards` lists them with a map from element ranges back to the original parameter names:

* DDP: every parameter of the rank's stage, whole;
* ZeRO-1/2: this rank's slice of each flat bucket (``bk.master`` / ``bk.shard_grad``);
* ZeRO-3 / FSDP / HSDP: this rank's slice of each unit's flat parameter (``unit.shard`` and its gradient).

**Clipping** (as ``torch.nn.utils.clip_grad_norm_``, Pascanu et al., 2013): the squared norm of the full gradient
is the sum, over every element of the model exactly once, of its square. A rank sums the elements it *owns*, then
the sum is all-reduced over the axes on which ownership is split: the sharding data-parallel axis (``dp`` for
ZeRO, ``dp_shard`` for FSDP/HSDP — HSDP's replicate groups hold equal copies, DDP replicas all hold everything, so
neither is summed over), the tensor-parallel axis and the pipeline axis. Parameters that tensor parallelism does not
split (norm gains, row-parallel biases) have equal gradients on every tp rank and count on tp rank 0 only; the tied
embedding's copy on the last pipeline stage counts on the first stage only. Every held gradient is then scaled by
``max_norm / (norm + 1e-6)`` when that is below 1.

**Weight decay** (AdamW's decoupled form, Loshchilov & Hutter, 2019): ``θ ← θ·(1 − lr·λ)`` before the Adam update,
on the elements of parameters the rule selects. A flat ZeRO/FSDP shard mixes weight matrices with norm gains, so an
optimizer's per-group ``weight_decay`` cannot select them; the trainer applies the decay here instead (the Adam
update does not depend on θ, so decaying first and stepping with ``weight_decay=0`` is the same AdamW step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from spinwheel.parallel.comm import Comm
from spinwheel.parallel.data.fsdp import FullyShardedDataParallel
from spinwheel.parallel.data.zero import ZeroDataParallel
from spinwheel.parallel.mesh import Axis
from spinwheel.parallel.parallelize import ParallelModel
from spinwheel.parallel.pipeline import tied_weight

DecayRule = Callable[[str, int], bool]  # (parameter name, number of dims) -> decayed?


@dataclass(frozen=True)
class Segment:
    """Elements [start, stop) of a local flat tensor belong to parameter ``name`` (``ndim`` dims in the model)."""

    name: str
    ndim: int
    start: int
    stop: int
    counted: bool  # whether this rank counts these elements toward the global gradient norm


@dataclass
class LocalShard:
    """A tensor this rank's optimizer steps, its reduced gradient (same number of elements; None before the first
    backward) and the parameters its elements belong to."""

    param: torch.Tensor
    grad: torch.Tensor | None
    segments: list[Segment]


Entry = tuple[str, int, int, int, bool]  # (name, ndim, offset, numel, counted) of a parameter in a flat layout


def _segments(entries: list[Entry], lo: int, hi: int) -> list[Segment]:
    """Intersect a flat layout with the owned range [lo, hi); offsets become relative to ``lo``."""
    out = []
    for name, ndim, offset, numel, counted in entries:
        a, b = max(offset, lo), min(offset + numel, hi)
        if a < b:
            out.append(Segment(name, ndim, a - lo, b - lo, counted))
    return out


def local_shards(pm: ParallelModel) -> tuple[list[LocalShard], Axis | None]:
    """This rank's optimizer tensors with their gradients, and the data-parallel axis that splits ownership (None
    when every data-parallel rank holds everything, as in DDP)."""
    stage, tp_axis = pm.stage, pm.dims.tp_axis
    tied = bool(stage.config.tie_word_embeddings)
    # The last pipeline stage's copy of the tied embedding: its gradient equals the first stage's.
    copy = tied_weight(stage) if getattr(stage, "tied", False) and stage.embed_tokens is None else None

    def entry(name: str, p_shape: torch.Size, offset: int, p: torch.Tensor | None = None) -> Entry:
        counted = (name in pm.tp_shard_dims or tp_axis.rank == 0) and (p is None or p is not copy)
        if tied and name == "lm_head.weight":  # the tied head is the embedding: one parameter, one decay rule
            name = "embed_tokens.weight"
        return name, len(p_shape), offset, p_shape.numel(), counted

    module = pm.module
    if isinstance(module, ZeroDataParallel):
        names = {id(p): n for n, p in stage.named_parameters()}
        shards = []
        for bk in module.buckets:
            entries = [entry(names[id(p)], p.shape, off, p) for p, off in zip(bk.params, bk.offsets)]
            lo = module.axis.rank * bk.shard_size
            shards.append(LocalShard(bk.master, bk.shard_grad, _segments(entries, lo, lo + bk.shard_size)))
        return shards, module.axis
    if isinstance(module, FullyShardedDataParallel):
        shards = []
        for unit in module.units:
            first_name: dict[int, str] = {}
            for name, _, _, i in unit.refs:
                first_name.setdefault(i, name)
            entries, offset = [], 0
            for i, shape in enumerate(unit.shapes):
                entries.append(entry(first_name[i], shape, offset))
                offset += shape.numel()
            lo = unit.axis.rank * unit.shard_size
            shards.append(LocalShard(unit.shard, unit.shard.grad, _segments(entries, lo, lo + unit.shard_size)))
        return shards, module.shard_axis
    shards = []
    for name, p in stage.named_parameters():
        if p.requires_grad:
            shards.append(LocalShard(p, p.grad, _segments([entry(name, p.shape, 0, p)], 0, p.numel())))
    return shards, None


def clip_grad_norm_(pm: ParallelModel, max_norm: float, comm: Comm) -> float:
    """Scale every held gradient so the global gradient norm is at most ``max_norm``; returns the norm before
    clipping (collective over the whole world; ``max_norm=inf`` only measures)."""
    shards, dp_axis = local_shards(pm)
    device = shards[0].param.device if shards else torch.device("cpu")
    square = torch.zeros(1, dtype=torch.float64, device=device)
    for sh in shards:
        if sh.grad is None:
            continue
        flat = sh.grad.reshape(-1)
        for seg in sh.segments:
            if seg.counted:
                square += flat[seg.start : seg.stop].float().square().sum().double()
    for axis in (pm.dims.tp_axis, pm.dims.pp_axis, dp_axis):
        if axis is not None:
            comm.all_reduce(square, axis)
    total = math.sqrt(float(square.item()))
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        with torch.no_grad():
            for sh in shards:
                if sh.grad is not None:
                    sh.grad.mul_(coef)
    return total


def apply_weight_decay(pm: ParallelModel, lr: float, weight_decay: float, rule: DecayRule) -> None:
    """``θ ← θ·(1 − lr·weight_decay)`` on the held elements of every parameter ``rule(name, ndim)`` selects."""
    factor = 1.0 - lr * weight_decay
    shards, _ = local_shards(pm)
    with torch.no_grad():
        for sh in shards:
            flat = sh.param.view(-1)
            for seg in sh.segments:
                if rule(seg.name, seg.ndim):
                    flat[seg.start : seg.stop].mul_(factor)
