"""Turns a scheduled step into tensors and runs the model once over it (Orca's selective batching).

All scheduled tokens — decodes and prefill chunks mixed — are flattened into one ``(1, N)`` batch: embeddings,
projections, MLPs and norms run on the flat batch; only attention splits per sequence, through block tables and
context lengths (:mod:`spinwheel.engine.kernels.attention`). On a CPU in fp32 the step runs the engine's own forward
over
oneDNN-packed weights and fused kernels (:mod:`spinwheel.engine.kernels.cpu_forward`); elsewhere the model's forward
with
the paged attention kernel installed in its layers. A step is ``prepare_inputs`` (flat ids, positions, slots,
attention metadata, the rows to read back) -> ``forward`` (hidden states) -> ``select_rows`` (logits of the rows
that are sampled or scored). The runner also owns the KV-cache tensors (device pool and CPU swap pool) and
performs the block copies the block manager asks for.
"""

from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass

import torch

from spinwheel.engine.config import EngineConfig
from spinwheel.engine.kernels import cpu_forward
from spinwheel.engine.kernels.attention import DecodeBucket, PagedAttention, PagedAttentionMetadata, PrefillSpan
from spinwheel.engine.kernels.cpu_kernels import check_decode_tables, load_kernels
from spinwheel.engine.multi_lora import AdapterRegistry
from spinwheel.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from spinwheel.models.transformer import Transformer

logger = logging.getLogger(__name__)

DECODE_BUCKET_BYTES = 4 << 20  # gathered K+V per decode bucket per layer (see ModelRunner._decode_buckets)


@dataclass
class StepInputs:
    """One step's flat batch of N tokens and what to read back from it."""

    input_ids: torch.Tensor  # (N,) int64
    positions: torch.Tensor  # (N,) int64
    meta: PagedAttentionMetadata
    picks: list[int]  # rows of the batch whose logits are needed, in output order
    sample_rows: dict[int, int]  # seq_id -> index into picks of its next-token row
    prompt_rows: dict[int, tuple[int, int]]  # seq_id -> [start, end) into picks of its prompt-logprob rows
    lora_slots: list[int] | None = None  # the adapter slot of every row (None: no adapters registered)


@dataclass
class StepLogits:
    """Logits of the rows the engine asked for (one per sequence that completes, plus prompt rows)."""

    logits: torch.Tensor  # (R, V) float32
    sample_rows: dict[int, int]  # seq_id -> row of the logits for its next token
    prompt_rows: dict[int, tuple[int, int]]  # seq_id -> [start, end) rows predicting this chunk's tokens 1..n


def kv_block_bytes(model: Transformer, block_size: int) -> int:
    cfg = model.config
    elem = torch.empty((), dtype=model.dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem  # type: ignore


class ModelRunner:
    def __init__(self, model: Transformer, config: EngineConfig, max_model_len: int) -> None:
        self.model = model
        self.config = config
        self.block_size = bs = config.block_size
        cfg = model.config
        self.block_bytes = block_bytes = kv_block_bytes(model, bs)
        self.num_blocks, sized_by = config.kv_pool_blocks(block_bytes, max_model_len)
        if config.num_cpu_blocks is not None:
            # the config checked it against an exact num_kv_blocks; here against a pool sized by memory
            config.check_swap_space(self.num_blocks, sized_by, "num_cpu_blocks (--engine-num-cpu-blocks)")
            self.num_cpu_blocks = config.num_cpu_blocks
        elif config.preemption_mode != "swap":
            self.num_cpu_blocks = 0  # no swap pool unless swap preemption is configured
        else:
            self.num_cpu_blocks = min(self.num_blocks, int(config.swap_space_mb * 2**20 // block_bytes))
        shape = (bs, cfg.num_key_value_heads, cfg.head_dim)
        device, dtype = model.device, model.dtype
        layers = cfg.num_hidden_layers
        # on CPU the pool's pages are committed as blocks are first written (the block pool reuses blocks first)
        self.lazy_kv = device.type == "cpu"
        self.k_caches, self.v_caches, self._kv_buffer = _kv_pool(self.num_blocks, shape, layers, device, dtype)
        pin = device.type == "cuda"
        self.cpu_k_caches = [
            torch.zeros(self.num_cpu_blocks, *shape, dtype=dtype, pin_memory=pin) for _ in range(layers)
        ]
        self.cpu_v_caches = [
            torch.zeros(self.num_cpu_blocks, *shape, dtype=dtype, pin_memory=pin) for _ in range(layers)
        ]
        self.kv_cache_bytes = self.num_blocks * block_bytes
        # decodes go through the fused C kernel (one call per layer, blocks read in place) where it applies
        self.fused_decode = device.type == "cpu" and dtype == torch.float32 and load_kernels() is not None
        logger.info(
            "KV cache: %d blocks x %d tokens = %d bytes (%.1f MiB on %s%s; %d bytes a token: %d layers x 2 x %d KV "
            "heads x %d x %d bytes), %s; %d CPU swap blocks (%.1f MiB)",
            self.num_blocks,
            bs,
            self.kv_cache_bytes,
            self.kv_cache_bytes / 2**20,
            device,
            ", committed as blocks are first used" if self.lazy_kv else "",
            block_bytes // bs,
            layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            dtype.itemsize,
            sized_by,
            self.num_cpu_blocks,
            self.num_cpu_blocks * block_bytes / 2**20,
        )
        self.packed: cpu_forward.PackedWeights | None = None
        self.loras = AdapterRegistry(model)  # LoRA adapters served by name over the base (multi_lora)
        self.install()
        # on CPU: oneDNN-packed weights and fused element-wise kernels (see cpu_forward), its caches bounded first
        if config.cpu_packed_weights and device.type == "cpu":
            cpu_forward.bound_primitive_caches(config.onednn_cache_capacity)
        if config.cpu_packed_weights and cpu_forward.supports(model):
            self.packed = cpu_forward.PackedWeights(model)

    # ---- the attention backend is applied from outside the model ----
    def install(self) -> None:
        """Put :class:`PagedAttention` in every layer (idempotent; the original kernel stays as fallback) and
        repack the CPU weights (new weights were loaded)."""
        if self.packed is not None:
            self.packed.refresh(force=True)
        for i, layer in enumerate(self.model.layers):
            core = layer.self_attn.core
            fallback = core.fallback if isinstance(core, PagedAttention) else core
            layer.self_attn.core = PagedAttention(fallback, self.k_caches[i], self.v_caches[i])

    def uninstall(self) -> None:
        for layer in self.model.layers:
            if isinstance(layer.self_attn.core, PagedAttention):
                layer.self_attn.core = layer.self_attn.core.fallback

    # ---- block moves ----
    @torch.inference_mode()
    def move_blocks(self, out: SchedulerOutput) -> None:
        """Swap-out first (its device blocks may be reused by this very step), then swap-in, then copy-on-write."""
        dev = self.model.device
        if out.blocks_to_swap_out:
            src, dst = _indices(out.blocks_to_swap_out)
            for caches, cpu in ((self.k_caches, self.cpu_k_caches), (self.v_caches, self.cpu_v_caches)):
                for c, h in zip(caches, cpu):
                    h[dst] = c[src.to(dev)].cpu()
        if out.blocks_to_swap_in:
            src, dst = _indices(out.blocks_to_swap_in)
            for caches, cpu in ((self.k_caches, self.cpu_k_caches), (self.v_caches, self.cpu_v_caches)):
                for c, h in zip(caches, cpu):
                    c[dst.to(dev)] = h[src].to(dev, non_blocking=True)
        if out.blocks_to_copy:
            src, dst = (t.to(dev) for t in _indices(out.blocks_to_copy))
            for c in self.k_caches + self.v_caches:
                c[dst] = c[src]

    def _decode_buckets(self, ctx: list[int]) -> list[tuple[int, int]]:
        """Split decodes (sorted by context length) into [start, end) buckets whose gathered K/V stay around
        ``DECODE_BUCKET_BYTES`` per layer: small enough to stay in cache between the gather and the attention
        (on CPU this beats one big padded batch several-fold), large enough to amortise a kernel call."""
        cfg = self.model.config
        elem = torch.empty((), dtype=self.model.dtype).element_size()
        per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * elem  # type: ignore[operator]
        limit = max(1, DECODE_BUCKET_BYTES // per_token)
        if self.model.device.type != "cpu":
            limit = 1 << 62  # GPUs prefer one launch
        spans, start = [], 0
        for i in range(1, len(ctx) + 1):
            if i == len(ctx) or (i + 1 - start) * ctx[i] > limit:
                spans.append((start, i))
                start = i
        return spans

    # ---- one step: move blocks, prepare inputs, forward, select rows ----
    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> StepLogits | None:
        """Perform the step's block moves, then run the model over its scheduled tokens (None when there are
        none)."""
        if out.blocks_to_swap_out or out.blocks_to_swap_in or out.blocks_to_copy:
            self.move_blocks(out)
        if not out.scheduled:
            return None
        inputs = self.prepare_inputs(out.scheduled, out.block_tables)
        return self.select_rows(self.forward(inputs), inputs)

    @torch.inference_mode()
    def prepare_inputs(self, scheduled: list[ScheduledSequence], block_tables: dict[int, list[int]]) -> StepInputs:
        """Flatten the step into one batch: decodes first (sorted by context length, so buckets of neighbours pad
        little), then prefill chunks; attention metadata; and the rows whose logits are needed."""
        bs, dev = self.block_size, self.model.device
        decodes = sorted((s for s in scheduled if s.num_new_tokens == 1), key=lambda s: s.seq.num_computed_tokens)
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for s in decodes:
            pos = s.seq.num_computed_tokens
            input_ids.append(s.seq.token_ids[pos])
            positions.append(pos)
            table = block_tables[s.seq.seq_id]
            slots.append(table[pos // bs] * bs + pos % bs)
        spans: list[PrefillSpan] = []
        for s in prefills:
            start, n = s.seq.num_computed_tokens, s.num_new_tokens
            table = block_tables[s.seq.seq_id]
            spans.append(
                PrefillSpan(
                    len(input_ids),
                    n,
                    start + n,
                    torch.tensor(table[: -(-(start + n) // bs)], dtype=torch.long, device=dev),
                )
            )
            input_ids += s.seq.token_ids[start : start + n]
            positions += range(start, start + n)
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        meta = PagedAttentionMetadata(
            torch.tensor(slots, dtype=torch.long, device=dev), self._decode_metadata(decodes, block_tables), spans
        )
        if self.fused_decode:  # the C code trusts indices: check this step's tables and slots once, for all layers
            for b in meta.decodes:
                check_decode_tables(b.block_tables, b.context_lens, self.num_blocks, bs)  # type: ignore[arg-type]
            if slots and not 0 <= min(slots) <= max(slots) < self.num_blocks * bs:
                raise ValueError("KV slot out of range")
            meta.tables_checked = True

        # rows whose logits are needed: the last token of each sequence that completes; whole prompt chunks for
        # prompt logprobs
        picks: list[int] = []
        sample_rows: dict[int, int] = {}
        prompt_rows: dict[int, tuple[int, int]] = {}
        row = 0
        for s in decodes + prefills:
            n = s.num_new_tokens
            if s.scores_prompt:
                prompt_rows[s.seq.seq_id] = (len(picks), len(picks) + n)
                picks += range(row, row + n)
                if s.completes:
                    sample_rows[s.seq.seq_id] = len(picks) - 1
            elif s.completes:
                sample_rows[s.seq.seq_id] = len(picks)
                picks.append(row + n - 1)
            row += n
        lora_slots = None
        if self.loras.slots:  # each row through its request's adapter (S-LoRA / Punica: mixed in one batch)
            lora_slots = [
                self.loras.slot(s.group.params.lora) for s in decodes + prefills for _ in range(s.num_new_tokens)
            ]
        return StepInputs(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
            picks,
            sample_rows,
            prompt_rows,
            lora_slots,
        )

    def _decode_metadata(
        self, decodes: list[ScheduledSequence], block_tables: dict[int, list[int]]
    ) -> list[DecodeBucket]:
        """Decode buckets: padded block tables, context lengths and (for the PyTorch path) the additive mask."""
        bs, dev = self.block_size, self.model.device
        buckets: list[DecodeBucket] = []
        all_ctx = [s.seq.num_computed_tokens + 1 for s in decodes]
        spans = [(0, len(decodes))] if self.fused_decode and decodes else self._decode_buckets(all_ctx)
        for start, end in spans:
            part, ctx = decodes[start:end], all_ctx[start:end]
            max_blocks = -(-max(ctx) // bs)
            rows = [block_tables[s.seq.seq_id][:max_blocks] for s in part]
            tables = torch.tensor([r + [0] * (max_blocks - len(r)) for r in rows], dtype=torch.long, device=dev)
            lens = torch.tensor(ctx, dtype=torch.long, device=dev)
            if self.fused_decode:
                buckets.append(DecodeBucket(start, tables, None, lens))
                continue
            missing = torch.arange(max_blocks * bs, device=dev)[None, :] >= lens[:, None]
            bias = torch.zeros(missing.shape, dtype=self.model.dtype, device=dev).masked_fill_(missing, float("-inf"))
            buckets.append(DecodeBucket(start, tables, bias[:, None, None, :], lens))
        return buckets

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model over the flat batch -> hidden states (N, C) before the LM head; each row through its adapter."""
        with self.loras.active(inputs.lora_slots, self.model.device):
            if self.packed is not None:
                return self.packed_forward(inputs)
            return self.model(
                inputs.input_ids[None], positions=inputs.positions[None], attn_metadata=inputs.meta, return_hidden=True
            )[0]

    def packed_forward(self, inputs: StepInputs, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The oneDNN-packed CPU path over the flat batch (from ``hidden`` (N, C) instead of the tokens: a pipeline
        stage), the packed weights refreshed first: a trainer sharing the model may have changed them in place."""
        self.packed.refresh()  # type: ignore[union-attr]
        args = (inputs.input_ids, inputs.positions, inputs.meta, self.k_caches, self.v_caches, self.fused_decode)
        return cpu_forward.hidden_states(self.model, self.packed, *args, hidden)  # type: ignore[arg-type]

    @torch.inference_mode()
    def select_rows(self, hidden: torch.Tensor, inputs: StepInputs) -> StepLogits:
        """Logits (float32) of only the rows that are sampled or scored: hidden (N, C) -> (R, V)."""
        if len(inputs.picks) != hidden.shape[0]:  # pure decode steps need every row: no gather
            hidden = hidden[torch.tensor(inputs.picks, dtype=torch.long, device=hidden.device)]
        logits = self.packed.lm_head(hidden) if self.packed is not None else self.model.lm_head(hidden)
        return StepLogits(logits.float(), inputs.sample_rows, inputs.prompt_rows)


def _kv_pool(
    num_blocks: int, shape: tuple[int, ...], layers: int, device: torch.device, dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[torch.Tensor], mmap.mmap | None]:
    """Zeroed K and V caches (num_blocks, *shape) for every layer. On CPU all of them are views of one private
    anonymous mapping: its pages are zero and take memory only once written (``torch.zeros`` would write them all),
    so a process's RSS holds the blocks used, not the budget."""
    if device.type != "cpu":
        return (
            [torch.zeros(num_blocks, *shape, device=device, dtype=dtype) for _ in range(layers)],
            [torch.zeros(num_blocks, *shape, device=device, dtype=dtype) for _ in range(layers)],
            None,
        )
    nbytes = 2 * layers * num_blocks * math.prod(shape) * dtype.itemsize
    flags = getattr(mmap, "MAP_PRIVATE", None)
    buffer = mmap.mmap(-1, nbytes) if flags is None else mmap.mmap(-1, nbytes, flags=flags)
    caches = torch.frombuffer(buffer, dtype=dtype).view(2 * layers, num_blocks, *shape)
    return list(caches[:layers]), list(caches[layers:]), buffer


def _indices(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    src, dst = zip(*pairs)
    return torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)
