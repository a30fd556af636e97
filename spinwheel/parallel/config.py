"""The distributed-training layout as a typed config (``--dp --tp --pp --zero --fsdp ...``), validated once here,
and turned into the rank grid by :meth:`ParallelConfig.make_dims`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from spinwheel.config import check_ranges, option
from spinwheel.models.hf import resolve_dtype
from spinwheel.parallel.comm import Comm
from spinwheel.parallel.data.mixed_precision import MixedPrecisionPolicy
from spinwheel.parallel.mesh import ParallelDims, ParallelError
from spinwheel.parallel.remat import PARTITION_MODES, REMAT_MODES, PartitionMode, RematMode


def check_data_parallel(zero: int, fsdp: bool) -> None:
    """The one check of the data-parallel choice (the config and :func:`~spinwheel.parallel.parallelize` call it)."""
    if zero not in (0, 1, 2, 3):
        raise ParallelError(f"--zero must be 0, 1, 2 or 3, got {zero}")
    if fsdp and zero:
        raise ParallelError("--fsdp/--hsdp and --zero are alternatives (ZeRO-3 is FSDP without prefetch); pick one")


def check_remat(remat: str, k: int | None, partition: str, tp: int, pp: int, contiguous: bool = False) -> None:
    """The one check of the re-materialisation choice (the config and :func:`~spinwheel.parallel.parallelize`)."""
    if remat not in REMAT_MODES:
        raise ParallelError(f"--remat must be one of {', '.join(REMAT_MODES)}, got {remat!r}")
    if partition not in PARTITION_MODES:
        raise ParallelError(f"--remat-partition must be one of {', '.join(PARTITION_MODES)}, got {partition!r}")
    if k is not None and (remat != "every-k" or k < 1):
        raise ParallelError(f"--remat-k {k} needs --remat every-k and k ≥ 1 (blocks per checkpointed segment)")
    if remat == "stage" and pp == 1:
        raise ParallelError(
            "--remat stage keeps only each pipeline stage's input: it needs --pp > 1 (without a pipeline use "
            "--remat block or every-k)"
        )
    if partition != "none" and remat == "none":
        raise ParallelError(f"--remat-partition {partition} partitions checkpoints: choose a --remat mode too")
    if contiguous and remat == "none":
        raise ParallelError("--remat-contiguous keeps checkpoints in one buffer: choose a --remat mode too")
    if partition != "none" and tp == 1:
        raise ParallelError(
            f"--remat-partition {partition} splits checkpoints across the tensor-parallel group: it needs --tp > 1"
        )


@dataclass
class ParallelConfig:
    """Distributed training layout (run under torchrun; the product dp·tp·pp must equal the number of processes)."""

    dp: int = option(-1, help="data-parallel degree; -1 = world size / (tp·pp)")
    tp: int = option(1, help="tensor-parallel degree (Megatron): splits heads, MLP and vocabulary")
    pp: int = option(1, help="pipeline-parallel degree: number of stages the layers are cut into")
    zero: int = option(
        0,
        help="ZeRO stage over the data-parallel axis: 0 = DDP, 1 = optimizer state sharded, "
        "2 = + gradients, 3 = + parameters",
        choices=(0, 1, 2, 3),
    )
    fsdp: bool = option(False, help="fully sharded data parallel (units per block, prefetch) instead of DDP/ZeRO")
    hsdp: int = option(
        0,
        help="hybrid sharding: shard within groups of this many data-parallel ranks and "
        "replicate across groups (implies --fsdp); 0 = off",
    )
    microbatches: int = option(
        1, help="micro-batches per step: pipeline micro-batches with pp > 1, gradient accumulation otherwise"
    )
    micro_batch_tokens: int | None = option(
        None,
        help="one process: rows packed without padding into micro-batches of at most this many tokens, each "
        "forward and backward on one at a time (bounds activation memory; a longer row goes alone); default: as "
        "many as keep one micro-batch's activations near 1 GiB (from the model's shape); 0: the whole minibatch",
    )
    schedule: Literal["gpipe", "1f1b"] = option("1f1b", help="pipeline schedule")
    remat: RematMode = option(
        "none",
        help="re-materialise activations in backward: block = keep each block's input (--remat alone), every-k = "
        "segments of --remat-k blocks, stage = only each pipeline stage's input per micro-batch (needs --pp > 1)",
        bare="block",
        negated="none",
    )
    remat_k: int | None = option(
        None, help="blocks per segment for --remat every-k (default: round(√L), L = a stage's blocks)"
    )
    remat_partition: PartitionMode = option(
        "none",
        help="ZeRO-R: keep each checkpoint as this rank's 1/tp slice, all-gathered before recomputation (tp), "
        "and in host memory (tp-cpu); needs --tp > 1",
    )
    remat_contiguous: bool = option(
        False,
        help="ZeRO-R memory defragmentation: keep every checkpoint in one contiguous buffer, sized from the first "
        "step and reused (one copy per checkpoint; grows when a later step needs more)",
    )
    bucket_mb: float = option(25.0, help="gradient bucket size cap in MiB (DDP, ZeRO-1/2)")
    fsdp_param_dtype: Literal["bf16", "fp16", "fp32"] | None = option(
        None,
        help="FSDP/ZeRO-3 mixed precision: gather the fp32 master shards in this dtype for forward and backward "
        "(unset: the model's dtype)",
    )
    fsdp_reduce_dtype: Literal["bf16", "fp16", "fp32"] | None = option(
        None, help="dtype of the FSDP/ZeRO-3 gradient reduce-scatter and HSDP all-reduce (unset: --fsdp-param-dtype)"
    )
    fsdp_buffer_mb: float = option(
        0.0,
        help="constant-size buffers: FSDP/ZeRO-3 all-gathers and reduce-scatters run in pieces through fixed "
        "staging buffers of this many MiB, whatever the model size (0 = one collective per unit)",
    )
    timeout_s: float = option(600.0, help="collective timeout in seconds: a dead rank fails the job after this")

    def __post_init__(self) -> None:
        check_ranges(
            self,
            at_least_1=("tp", "pp", "microbatches"),
            non_negative=("hsdp", "fsdp_buffer_mb", "micro_batch_tokens"),
            ge="≥",
            error=ParallelError,
        )
        if self.dp == 0 or self.dp < -1:
            raise ParallelError(f"--dp must be ≥ 1 or -1 (fill the world), got {self.dp}")
        if self.hsdp:
            self.fsdp = True
        check_data_parallel(self.zero, self.fsdp)
        sharded = self.fsdp or self.zero == 3
        for name in ("fsdp_param_dtype", "fsdp_reduce_dtype", "fsdp_buffer_mb"):
            if getattr(self, name) and not sharded:
                flag = "--" + name.replace("_", "-")
                raise ParallelError(f"{flag} applies to fully sharded layouts: add --fsdp, --hsdp F or --zero 3")
        if self.schedule not in ("gpipe", "1f1b"):
            raise ParallelError(f"--schedule must be gpipe or 1f1b, got {self.schedule!r}")
        if isinstance(self.remat, bool):  # remat=True / False from code written before the modes
            self.remat = "block" if self.remat else "none"
        check_remat(self.remat, self.remat_k, self.remat_partition, self.tp, self.pp, self.remat_contiguous)

    def check_one_process(self) -> list[str]:
        """For a run that is not launched with several processes: refuse degrees that need more of them, and return
        the flags that then have nothing to act on (the caller warns), so neither is silently dropped."""
        degrees = {"dp": max(self.dp, 1), "tp": self.tp, "pp": self.pp}
        if (need := math.prod(degrees.values())) > 1:
            layout = " × ".join(f"{k}={v}" for k, v in degrees.items() if v > 1)
            raise ParallelError(
                f"{layout} needs {need} processes but this run is one: launch it with "
                f"`spinwheel launch --nproc-per-node {need} ...` (or torchrun), or drop --dp/--tp/--pp"
            )
        ignored = {
            "--zero": self.zero > 0,
            "--fsdp": self.fsdp and not self.hsdp,
            "--hsdp": self.hsdp > 0,
            "--microbatches": self.microbatches > 1,
            "--remat": self.remat != "none",
            "--remat-contiguous": self.remat_contiguous,
        }
        return [flag for flag, on in ignored.items() if on]

    def mixed_precision(self) -> MixedPrecisionPolicy | None:
        """The FSDP/ZeRO-3 mixed-precision policy these options ask for (None: parameters' own dtype throughout)."""
        if self.fsdp_param_dtype is None and self.fsdp_reduce_dtype is None:
            return None
        return MixedPrecisionPolicy(resolve_dtype(self.fsdp_param_dtype), resolve_dtype(self.fsdp_reduce_dtype))

    def make_dims(self) -> ParallelDims:
        """Build the rank grid (and process groups) for this layout from the initialised world."""
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        dp = self.dp if self.dp != -1 else world // (self.tp * self.pp)
        if dp < 1 or dp * self.tp * self.pp != world:
            degrees = f"tp={self.tp} × pp={self.pp}"
            layout = f"dp={self.dp} × {degrees}" if self.dp != -1 else f"{degrees} (dp: the rest)"
            raise ParallelError(
                f"{layout} does not match the world of {world} "
                "processes; change the degrees or the number of processes (torchrun "
                "--nproc-per-node N)"
            )
        shard = self.hsdp if self.hsdp else dp
        if dp % shard:
            raise ParallelError(f"--hsdp {self.hsdp} must divide the data-parallel degree {dp}")
        return ParallelDims.create(
            dp_replicate=dp // shard,
            dp_shard=shard,
            tp=self.tp,
            pp=self.pp,
            timeout_s=self.timeout_s,
            comm=Comm(self.timeout_s),
        )

    def check_batch(self, batch_size: int, dp: int, what: str = "--batch-size") -> None:
        """The one batch-divisibility rule: every data-parallel rank gets whole micro-batches of equal size."""
        m = self.microbatches
        if batch_size % (dp * m):
            raise ParallelError(
                f"{what} {batch_size} must be divisible by the data-parallel degree × "
                f"--microbatches = {dp} × {m}; change one of them"
            )
