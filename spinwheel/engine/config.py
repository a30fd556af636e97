"""Engine configuration: KV-cache geometry and budget, scheduler limits, preemption policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from spinwheel.config import check_ranges, option


@dataclass
class EngineConfig:
    """Serving-engine settings (every field is also a ``spinwheel generate`` / ``serve`` option)."""

    block_size: int = option(16, help="tokens per KV-cache block (PagedAttention page size)")
    kv_cache_memory_mb: float = option(
        1024.0,
        help="KV-cache budget in MiB on the model's device: the pool gets what max_num_seqs sequences of "
        "max_model_len tokens could ever use, at most this (a block is 2 x layers x block_size x KV heads x "
        "head_dim x dtype bytes); on CPU the pool's memory is committed only as its blocks are first used",
    )
    num_kv_blocks: int | None = option(None, help="exact number of KV blocks (overrides kv_cache_memory_mb)")
    swap_space_mb: float = option(
        1024.0, help="CPU block pool for swap preemption, in MiB (allocated only with preemption_mode=swap)"
    )
    num_cpu_blocks: int | None = option(
        None, help="exact number of CPU swap blocks (overrides swap_space_mb); at most the KV pool's number of blocks"
    )
    max_num_seqs: int = option(256, help="most sequences in one step (the batch-size cap)")
    max_num_batched_tokens: int = option(2048, help="token budget of one step (prefill chunks + decodes)")
    max_num_batched_tokens_with_decodes: int | None = option(
        None,
        help="token budget of a step that also decodes, with chunked prefill (Sarathi-Serve's stall-free "
        "batching): prompts admitted while others decode are prefilled in chunks of at most this many tokens, "
        "which bounds the inter-token latency of the running requests; default: max_num_batched_tokens ("
        "`spinwheel serve`: fitted to --decode-step-ms by its warm-up)",
    )
    max_model_len: int | None = option(
        None, help="longest prompt + output; default: the model's max_position_embeddings"
    )
    enable_chunked_prefill: bool = option(True, help="split long prompts across steps under the token budget")
    enable_prefix_caching: bool = option(True, help="reuse KV blocks of identical prompt prefixes")
    kv_allocation: Literal["paged", "reserved"] = option(
        "paged",
        help="paged: KV blocks as tokens need them (PagedAttention); reserved: Orca's baseline, every block of "
        "prompt + max_tokens taken when a request is admitted (one sequence per request; for comparison only)",
    )
    preemption_mode: Literal["recompute", "swap"] = option(
        "recompute", help="when blocks run out: free and re-prefill later, or move the blocks to CPU"
    )
    flush_denormal: bool = option(
        True,
        help="flush denormal floats to zero while a step runs (CPU kernels slow down several-fold on them; "
        "the previous setting is restored after the step)",
    )
    cpu_packed_weights: bool = option(
        True,
        help="on CPU in fp32, run the projections on oneDNN-packed copies of the weights (faster GEMMs, one "
        "more copy of the projection weights in memory; repacked when the weights change)",
    )
    onednn_cache_capacity: int = option(
        128,
        help="oneDNN primitives (compiled kernels for one shape, 0.3-1 MiB each) kept by each of oneDNN's and "
        "PyTorch's caches on the packed CPU path; set for the whole process when its first engine is built, if "
        "no oneDNN primitive exists yet (always in serve's engine process); oneDNN's own default, 1024, costs up "
        "to ~1 GiB",
    )
    tensor_parallel_size: int = option(
        1,
        help="tensor-parallel degree: the engine spawns N - 1 worker processes (gloo on CPU, NCCL on GPUs 0..N-1) and "
        "each rank holds 1/N of the weights (Megatron split) and of every KV block; N must divide the heads, KV "
        "heads, MLP width and vocabulary",
    )
    pipeline_parallel_size: int = option(
        1,
        help="pipeline-parallel degree: the model's layers in P contiguous stages on P processes (gloo; on GPUs "
        "0..P-1 through host memory), P micro-batches in flight (Orca's inter-layer parallelism); P must divide the "
        "layers; with tensor_parallel_size T > 1 each stage is a T-rank tensor-parallel group (T·P processes)",
    )
    seed: int = option(0, help="seed of the engine's generator for requests without their own seed")
    dtype: str | None = option(None, help="model dtype when loading from a path (default: the checkpoint's)")
    device: str | None = option(None, help="device when loading from a path (default: cuda if available)")

    def __post_init__(self) -> None:
        # Field names in the messages: the commands spell them as their --engine-* options (config.from_args).
        check_ranges(
            self,
            at_least_1=(
                "block_size",
                "num_kv_blocks",
                "onednn_cache_capacity",
                "max_num_seqs",
                "tensor_parallel_size",
                "pipeline_parallel_size",
            ),
            non_negative=("num_cpu_blocks", "swap_space_mb"),
            positive=("kv_cache_memory_mb",),
            name=str,
        )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step"
            )
        with_decodes = self.max_num_batched_tokens_with_decodes
        if with_decodes is not None and not self.max_num_seqs <= with_decodes <= self.max_num_batched_tokens:
            raise ValueError(
                f"max_num_batched_tokens_with_decodes must be between max_num_seqs ({self.max_num_seqs}) and "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}), got {with_decodes}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_allocation not in ("paged", "reserved"):
            raise ValueError(f"kv_allocation must be 'paged' or 'reserved', got {self.kv_allocation!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.num_kv_blocks is not None:
            self.check_swap_space(self.num_kv_blocks, "num_kv_blocks")
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must "
                f"be >= max_model_len ({self.max_model_len}) so the longest prompt fits in one step"
            )

    def check_swap_space(self, num_kv_blocks: int, sized_by: str, name: str = "num_cpu_blocks") -> None:
        """Refuse a CPU swap pool larger than the device KV pool of ``num_kv_blocks`` blocks (``sized_by`` says what
        set its size): the swap space is bounded by the KV pool it backs (Kwon et al. 2023, §4.5); ``swap_space_mb``
        is capped there silently, an exact ``num_cpu_blocks`` must fit. ``name`` spells the option in the message."""
        if self.num_cpu_blocks is not None and self.num_cpu_blocks > num_kv_blocks:
            raise ValueError(
                f"{name} must be <= {num_kv_blocks}, the KV pool's size in blocks ({sized_by}), got "
                f"{self.num_cpu_blocks}: swap space is never larger than the pool it backs; lower it, or leave it "
                "unset to size the swap pool by swap_space_mb (capped at the pool)"
            )

    def kv_pool_blocks(self, block_bytes: int, max_model_len: int) -> tuple[int, str]:
        """The KV pool's size in blocks of ``block_bytes`` (the model's: :func:`~spinwheel.engine.model_runner.
        kv_block_bytes`) for contexts of ``max_model_len`` tokens, and what set it: ``num_kv_blocks``; else what
        ``max_num_seqs`` sequences of ``max_model_len`` tokens could use, at most ``kv_cache_memory_mb``."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks, "num_kv_blocks"
        workload = self.max_num_seqs * -(-max_model_len // self.block_size)
        budget = int(self.kv_cache_memory_mb * 2**20 // block_bytes)
        if workload <= budget:
            return workload, "sized by max_num_seqs x max_model_len"
        return max(1, budget), "sized by kv_cache_memory_mb"
