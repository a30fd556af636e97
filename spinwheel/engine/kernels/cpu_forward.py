"""The engine's forward on CPU: oneDNN-packed projection weights and fused element-wise kernels.

``nn.Linear`` on a CPU runs MKL's sgemm, which packs the weight operand anew on every call; for the few-row GEMMs
of decode steps (M = the batch, against weights that stream from DRAM every step) that is a large share of the work.
oneDNN, which PyTorch ships, can reorder a weight once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``) and then run ``_linear_pointwise`` on it. Measured on this project's
benchmark machine (2 threads, the 28M-parameter benchmark model's 57 projections in sequence, weights cold): M = 8
rows 5.0 ms against 11-14 ms, M = 48 14.6-15.7 ms against 18-28 ms, M = 64 17.4-18.0 against 22-34 ms, and M = 2048
(a prefill step) 450-480 ms against 520-560 ms.

:class:`PackedWeights` keeps the packed copies (q/k/v fused into one matrix, gate/up into another, as vLLM's
``QKVParallelLinear`` / ``MergedColumnParallelLinear`` do, so each layer runs four GEMMs) and repacks a group as soon as
one of its parameters changes: every step compares the parameters' identities and in-place version counters, so an
optimizer step on a model shared with a trainer, ``update_weights`` or a ``load_state_dict`` reaches the next
generation step. The copies cost one more copy of the projection weights in memory (``EngineConfig.cpu_packed_weights``
turns the path off). A model shared with a LoRA trainer (:class:`~spinwheel.models.lora.LoRALinear` projections) is
packed merged, W + s B A, and re-merged when an adapter's factors (their version counters), scale or on/off switch
change: one GEMM per projection, as for the plain model, instead of the base's and two small ones unpacked. On the
RL loop's real recipe (SmolLM2-135M, LoRA r16 on every projection, 8 prompts x 4 x 64 tokens) generation took
24-40 s against 64-77 s unpacked, in turns in one run at load 7-9.

oneDNN creates a primitive (JIT-compiled kernels, 0.3-1 MiB each) for every new shape and keeps it in two LRU caches,
its own and PyTorch's ideep layer's, 1024 entries each by default. A server's steps have ever more distinct row
counts, so the packed path pads rows up to :func:`bucket_rows` (at most 73 shapes per projection up to 2304 rows,
<= 12.5% padding) and :func:`bound_primitive_caches` caps both caches: without either, a soak of ``spinwheel serve``
grew its engine process by ~0.6 GiB in four minutes before the caches evicted anything.

:func:`hidden_states` is the model's own forward (:mod:`spinwheel.models.transformer`: RMSNorm in fp32 with the gain
applied last, rotate-half RoPE, SwiGLU, optional q/k norms and biases) over those weights; residual adds ride on the
GEMMs as oneDNN post-ops, and with the C kernels of :mod:`spinwheel.engine.kernels.cpu_kernels` RMSNorm, RoPE (with the
K/V
cache writes) and silu * up are one call each. Tests check it against the model's forward, dense attention and HF
``generate``.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from spinwheel.engine.kernels import cpu_kernels
from spinwheel.engine.kernels.attention import PagedAttentionMetadata, paged_attention, write_kv
from spinwheel.engine.multi_lora import LoRAProjection
from spinwheel.models.lora import LoRALinear
from spinwheel.models.transformer import RMSNorm, Transformer, apply_rope

logger = logging.getLogger(__name__)

# rows the packed layout is tuned for; on the serving benchmark 64 ran faster than 2048 (6.7-6.9 s against 6.9-7.3 s)
_BATCH_HINT = 64
# the capacities of oneDNN's primitive cache and of ideep's (PyTorch's oneDNN layer); each is read once, when the
# process creates its first primitive
_CACHE_CAPACITY_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bucket_rows(m: int) -> int:
    """The row count a GEMM of ``m`` rows runs at: ``m`` up to 16, else ``m`` rounded up to a multiple of 1/8 of its
    power of two (18, 20, ..., 32, 36, ..., 64, 72, ...). Few shapes, so oneDNN's primitives are reused."""
    if m <= 16:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


def bound_primitive_caches(capacity: int) -> bool:
    """Keep at most ``capacity`` oneDNN primitives in each of the two caches (see the module docstring). They read
    their capacity from the environment when the process creates its first primitive, so this takes effect only
    before that (in the engine process of ``spinwheel serve``: always); returns False, leaving them as they are,
    when this process has run the packed path already with another capacity."""
    value = str(capacity)
    if all(os.environ.get(name) == value for name in _CACHE_CAPACITY_ENV):
        return True
    if onednn_linear_available.cache_info().currsize:
        logger.warning("oneDNN's caches exist already in this process; onednn_cache_capacity=%d not applied", capacity)
        return False
    os.environ.update(dict.fromkeys(_CACHE_CAPACITY_ENV, value))
    return True


@functools.cache
def onednn_linear_available() -> bool:
    """True when this PyTorch build has oneDNN's packed linear and it agrees with ``F.linear``."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        w, x, b = torch.randn(24, 16), torch.randn(3, 16), torch.randn(24)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, _BATCH_HINT)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
        y2 = torch.ops.mkldnn._linear_pointwise.binary(x, y, packed, b, "add")
        ref = F.linear(x, w, b)
        return bool(torch.allclose(y, ref, atol=1e-4) and torch.allclose(y2, 2 * ref, atol=1e-4))
    except (AttributeError, RuntimeError):
        return False


def supports(model: Transformer) -> bool:
    """True for the plain model (no wrapped or sharded projections but the engine's own multi-LoRA ones and a
    trainer's :class:`LoRALinear`, served merged) in fp32 on a CPU with oneDNN's packed linear."""
    if model.device.type != "cpu" or model.dtype != torch.float32 or not onednn_linear_available():
        return False
    if type(model.lm_head) not in (nn.Linear, type(None)) or type(model.norm) not in (RMSNorm, type(None)):
        return False  # None: a pipeline stage without the output end (spinwheel.engine.parallel.pp_stage)
    for layer in model.layers:
        att, mlp = layer.self_attn, layer.mlp
        linears = (att.q_proj, att.k_proj, att.v_proj, att.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(type(m) not in (nn.Linear, LoRAProjection, LoRALinear) for m in linears):
            return False
        if type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm:
            return False
    return True


def _version(t: torch.Tensor) -> int:
    """The in-place version counter (-1 for inference-mode tensors, which keep none: those are repacked only by
    :meth:`PackedWeights.refresh` with ``force``, as ``update_weights`` does)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _merged_weight(m: nn.Linear) -> torch.Tensor:
    """The weight a projection computes with: W, or W + s B A for a :class:`LoRALinear` whose adapter is on (in
    inference mode the engine applies no adapter dropout, so the merged GEMM is the same function)."""
    w = m.weight.detach()
    if isinstance(m, LoRALinear) and m.enabled:
        return w + m.delta_weight().detach()
    return w


def _factors(m: LoRALinear) -> tuple[torch.Tensor, torch.Tensor]:
    return m.lora_A.weight, m.lora_B.weight


class _Packed:
    """One packed (possibly fused) projection and the parameters it was built from. A :class:`LoRALinear` (a model
    shared with a LoRA trainer) is packed merged, W + s B A: one GEMM instead of three, and its adapter factors,
    scale and on/off switch are part of what :meth:`stale` compares."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.linears = linears
        self.source: list[tuple[torch.Tensor, int]] = []
        self.adapters: list[tuple[bool, float]] = []
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def _params(self) -> list[torch.Tensor]:
        params = [t for m in self.linears for t in (m.weight, m.bias) if t is not None]
        return params + [t for m in self.linears if isinstance(m, LoRALinear) for t in _factors(m)]

    def _adapters(self) -> list[tuple[bool, float]]:
        return [(m.enabled, m.scaling) for m in self.linears if isinstance(m, LoRALinear)]

    def stale(self) -> bool:
        params = self._params()
        return (
            len(params) != len(self.source)
            or any(p is not q or _version(p) != v for p, (q, v) in zip(params, self.source))
            or self._adapters() != self.adapters
        )

    @torch.no_grad()
    def pack(self) -> None:
        ws = [_merged_weight(m) for m in self.linears]
        w = ws[0] if len(ws) == 1 else torch.cat(ws)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _BATCH_HINT)
        del ws, w
        if any(m.bias is not None for m in self.linears):
            self.bias = torch.cat(
                [m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in self.linears]
            )
        else:
            self.bias = None
        self.source = [(p, _version(p)) for p in self._params()]
        self.adapters = self._adapters()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, K) -> (M, N), run on :func:`bucket_rows` rows (zero rows appended, their outputs dropped)."""
        m = x.shape[0]
        pad = bucket_rows(m) - m
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")[:m]

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual (M, N) + projection(x (M, K)), the add done by oneDNN as a post-op; rows bucketed as above."""
        m = x.shape[0]
        pad = bucket_rows(m) - m
        if pad:
            x, residual = F.pad(x, (0, 0, 0, pad)), F.pad(residual, (0, 0, 0, pad))
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")[:m]


class PackedWeights:
    """oneDNN-packed copies of a model's projections: per layer qkv, o, gate|up, down; and the LM head."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.layers: list[tuple[_Packed, _Packed, _Packed, _Packed]] = []
        for layer in model.layers:
            att, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                (
                    _Packed([att.q_proj, att.k_proj, att.v_proj]),
                    _Packed([att.o_proj]),
                    _Packed([mlp.gate_proj, mlp.up_proj]),
                    _Packed([mlp.down_proj]),
                )
            )
        self.lm_head = _Packed([model.lm_head]) if model.lm_head is not None else None  # None: a pipeline stage's
        self.refresh()
        nbytes = sum(p.weight.numel() * 4 for p in self._all())  # type: ignore[union-attr]
        logger.info("oneDNN-packed projection weights: %.1f MiB", nbytes / 2**20)

    def _all(self) -> list[_Packed]:
        return [q for group in self.layers for q in group] + ([self.lm_head] if self.lm_head is not None else [])

    def refresh(self, force: bool = False) -> int:
        """Repack every group whose parameters changed since it was packed (all with ``force``); returns how many
        were repacked."""
        n = 0
        for p in self._all():
            if force or p.weight is None or p.stale():
                p.pack()
                n += 1
        return n


def _add_lora(y: torch.Tensor, x: torch.Tensor, *projections: nn.Module) -> torch.Tensor:
    """``y`` (N, sum of out) holds the outputs of ``projections`` side by side (a fused GEMM's): add the adapters'
    updates of those wrapped for multi-LoRA serving to their columns, in place; their input is ``x`` (N, in)."""
    col = 0
    for m in projections:
        if isinstance(m, LoRAProjection) and m.rows.groups:
            m.add_delta(x, y[:, col : col + m.out_features])
        col += m.out_features  # type: ignore[operator]
    return y


def _rms_norm(x: torch.Tensor, norm: RMSNorm, fused: bool) -> torch.Tensor:
    if fused:
        return cpu_kernels.rms_norm(x, norm.weight, norm.eps)
    return norm(x)


def hidden_states(
    model: Transformer,
    packed: PackedWeights,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: PagedAttentionMetadata,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    fused: bool,
    x: torch.Tensor | None = None,
) -> torch.Tensor:
    """input_ids, positions (N,) -> final normalised hidden states (N, C). New K/V go to the caches at
    ``meta.slot_mapping`` (the runner has checked those slots). ``fused``: use the C kernels of
    :mod:`spinwheel.engine.kernels.cpu_kernels` for RMSNorm, RoPE + K/V writes and silu * up, else PyTorch ops.
    Projections
    wrapped for multi-LoRA serving add their adapters' updates to the packed GEMMs' outputs. A pipeline stage
    (:mod:`~spinwheel.engine.parallel.pp_stage`) passes ``x``, the hidden states (N, C) entering its first layer, and
    one
    without the final norm (None) gets its last layer's output."""
    n = input_ids.shape[0]
    x = model.embed_tokens.weight.index_select(0, input_ids) if x is None else x  # (N, C)
    freqs = positions.float()[:, None] * model.rotary.inv_freq.float()  # (N, D/2)
    cos, sin = freqs.cos(), freqs.sin()
    for i, (layer, (qkv_p, o_p, gate_up_p, down_p)) in enumerate(zip(model.layers, packed.layers)):
        att = layer.self_attn
        d = att.head_dim
        h_dim, g_dim = att.q_proj.out_features, att.k_proj.out_features
        h = _rms_norm(x, layer.input_layernorm, fused)
        qkv = _add_lora(qkv_p(h), h, att.q_proj, att.k_proj, att.v_proj)  # (N, (H + 2G) * D)
        if fused and att.q_norm is None:
            q, k, v = cpu_kernels.rope_qkv(
                qkv, h_dim // d, g_dim // d, cos, sin, k_caches[i], v_caches[i], meta.slot_mapping
            )
        else:
            q, k, v = (t.view(n, -1, d) for t in qkv.split([h_dim, g_dim, g_dim], dim=1))
            if att.q_norm is not None and att.k_norm is not None:
                q, k = att.q_norm(q), att.k_norm(k)
            full_cos, full_sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # the model's layout
            q, k = apply_rope(q, full_cos, full_sin), apply_rope(k, full_cos, full_sin)
            write_kv(k_caches[i], v_caches[i], k, v, meta.slot_mapping)
        out = paged_attention(q, k, v, k_caches[i], v_caches[i], meta, kv_written=True)  # (N, H, D)
        x = _add_lora(o_p.add_to(out.view(n, -1), x), out.view(n, -1), att.o_proj)
        h = _rms_norm(x, layer.post_attention_layernorm, fused)
        gate_up = _add_lora(gate_up_p(h), h, layer.mlp.gate_proj, layer.mlp.up_proj)  # (N, 2I)
        if fused:
            act = cpu_kernels.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=1)
            act = F.silu(gate) * up
        x = _add_lora(down_p.add_to(act, x), act, layer.mlp.down_proj)
    return x if model.norm is None else _rms_norm(x, model.norm, fused)
