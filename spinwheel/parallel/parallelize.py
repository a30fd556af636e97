"""Apply the parallel techniques to a model from outside, in a fixed order (torchtitan's ``parallelize``):

1. **pipeline cut** — keep only this rank's stage (:class:`~spinwheel.parallel.pipeline.PipelineStage`); later steps
   see only the stage's layers;
2. **tensor parallelism** — swap in column/row/vocab-parallel layers (they must exist before anything flattens or
   wraps the parameters; LoRA projections get :mod:`~spinwheel.parallel.tensor_lora`'s, factors split with W); a
   lazily loaded model (:mod:`~spinwheel.parallel.io.lazy_load`, on the meta device) reads its weights here — its TP
   slices and its stage's layers, or under ZeRO-3 / FSDP each rank only its shard, unit by unit, in step 4;
3. **re-materialisation** — checkpoint each block, segments of k blocks or the whole stage (inside TP, so
   recomputation re-runs TP's collectives and may keep its checkpoints partitioned over the TP group, and inside the
   data-parallel wrapper, whose hooks sit around each block's call); optionally with every checkpoint in one
   contiguous buffer (ZeRO-R's MD, :mod:`~spinwheel.parallel.remat_buffer`);
4. **data parallelism** — exactly one of DDP (``zero=0``), ZeRO-1/2 (``zero=1|2``), ZeRO-3 (``zero=3``: FSDP units,
   no prefetch), FSDP (``fsdp``) or HSDP (``hsdp=F``) over the ``dp`` axis; it wraps last because it owns the final
   parameter storage (buckets, flat shards). The fully sharded ones take a mixed-precision policy and a
   constant buffer size.

The model (:class:`~spinwheel.models.transformer.Transformer`) knows none of this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from spinwheel.parallel.config import check_data_parallel, check_remat
from spinwheel.parallel.data.ddp import DistributedDataParallel
from spinwheel.parallel.data.fsdp import FullyShardedDataParallel
from spinwheel.parallel.data.mixed_precision import MixedPrecisionPolicy
from spinwheel.parallel.data.zero import ZeroDataParallel
from spinwheel.parallel.io.lazy_load import LoadPlan, lazy_source
from spinwheel.parallel.mesh import ParallelDims, ParallelError
from spinwheel.parallel.pipeline import PipelineSchedule, PipelineStage
from spinwheel.parallel.remat import apply_remat
from spinwheel.parallel.remat_buffer import CheckpointBuffer
from spinwheel.parallel.remat_partition import PartitionedInput, WholeInput
from spinwheel.parallel.tensor import apply_tensor_parallel
from spinwheel.parallel.tensor_lora import lora_column_layer, lora_row_layer


@dataclass
class ParallelModel:
    """A model after :func:`parallelize`.

    ``module`` is what to call (the data-parallel wrapper), ``stage`` the model or pipeline stage inside it,
    ``tp_shard_dims`` the tensor-parallel split of each sharded parameter, ``pipeline`` the schedule when pp > 1,
    ``remat_buffer`` the contiguous checkpoint buffer with ``remat_contiguous``.
    """

    module: nn.Module
    stage: nn.Module
    dims: ParallelDims
    dp_kind: str
    tp_shard_dims: dict[str, int] = field(default_factory=dict)
    pipeline: PipelineSchedule | None = None
    remat_buffer: CheckpointBuffer | None = None


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    *,
    zero: int = 0,
    fsdp: bool = False,
    remat: str | bool = "none",
    bucket_mb: float = 25.0,
    schedule: str = "1f1b",
    mixed_precision: MixedPrecisionPolicy | None = None,
    fsdp_buffer_mb: float | None = None,
    remat_k: int | None = None,
    remat_partition: str = "none",
    remat_contiguous: bool = False,
) -> ParallelModel:
    """Cut, shard and wrap ``model`` for the layout ``dims`` (see the module docstring for the order).

    ``mixed_precision`` and ``fsdp_buffer_mb`` (constant-size buffers) apply to the fully sharded layouts;
    ``remat``: none / block / every-k (``remat_k`` blocks per segment) / stage, ``True`` meaning block;
    ``remat_partition``: none / tp (Pa) / tp-cpu (Pa+cpu), see :mod:`~spinwheel.parallel.remat`;
    ``remat_contiguous``: checkpoints in one contiguous buffer (MD)."""
    dims.validate_model(model.config)
    comm = dims.comm
    dtype = next(model.parameters()).dtype
    check_data_parallel(zero, fsdp)
    if isinstance(remat, bool):
        remat = "block" if remat else "none"
    check_remat(remat, remat_k, remat_partition, dims.tp, dims.pp, remat_contiguous)
    if dims.dp_replicate > 1 and not fsdp:
        raise ParallelError("dp_replicate > 1 is hybrid sharding: it needs fsdp (--hsdp F)")
    stage: nn.Module = model
    if dims.pp > 1:
        tied = bool(model.config.tie_word_embeddings)
        if tied and (fsdp or zero >= 2):
            raise ParallelError(
                "tied embeddings across pipeline stages need zero 0 or 1 (their gradients are summed "
                "over the first and last stage before the data-parallel reduction); untie the "
                "embeddings or choose --zero 0/1"
            )
        stage = PipelineStage(model, dims.pp_axis.rank, dims.pp)
    shard_dims = apply_tensor_parallel(stage, dims.tp_axis, comm, lora_column_layer, lora_row_layer)
    loader = lazy_reads(model, stage, shard_dims, dims, fully_sharded=fsdp or zero == 3)
    buffer = CheckpointBuffer() if remat_contiguous else None
    if remat != "none":
        offload = remat_partition == "tp-cpu"
        partitioned = remat_partition != "none"
        store = PartitionedInput(dims.tp_axis, comm, offload, buffer) if partitioned else WholeInput(buffer)
        apply_remat(stage, remat, remat_k, store)
    sharded = dict(mixed_precision=mixed_precision, buffer_mb=fsdp_buffer_mb, broadcast=loader is None, loader=loader)
    if fsdp:
        replicate, dp_axis = dims.dp_replicate_axis, dims.dp_axis
        module: nn.Module = FullyShardedDataParallel(
            stage, dims.dp_shard_axis, comm, replicate_axis=replicate, dp_axis=dp_axis, **sharded
        )
        kind = "hsdp" if dims.dp_replicate > 1 else "fsdp"
    elif zero == 3:
        module = FullyShardedDataParallel(stage, dims.dp_axis, comm, prefetch=False, **sharded)
        kind = "zero3"
    elif zero in (1, 2):
        module = ZeroDataParallel(stage, dims.dp_axis, comm, stage=zero, bucket_mb=bucket_mb)
        kind = f"zero{zero}"
    else:
        module = DistributedDataParallel(stage, dims.dp_axis, comm, bucket_mb=bucket_mb)
        kind = "ddp"
    pipeline = PipelineSchedule(stage, dims.pp_axis, comm, schedule, dtype=dtype) if dims.pp > 1 else None
    return ParallelModel(module, stage, dims, kind, shard_dims, pipeline, buffer)


def lazy_reads(
    model: nn.Module, stage: nn.Module, shard_dims: dict[str, int], dims: ParallelDims, fully_sharded: bool
) -> LoadPlan | None:
    """A lazily loaded model (:mod:`~spinwheel.parallel.io.lazy_load`) reads its weights now, after the pipeline cut
    and the TP swap: the stage's TP slices and replicated pieces, or under ZeRO-3 / FSDP (the returned plan) each
    rank its shard of one unit at a time as the wrapper builds it. None for a model loaded whole."""
    source = lazy_source(model)
    if source is None:
        return None
    loader = source.plan(stage, shard_dims, dims.tp_axis.size, dims.tp_axis.rank)
    if not fully_sharded:
        loader.materialise(stage)
    return loader
