"""Fused CPU kernels of the engine, in C: paged decode attention and the element-wise ops of the CPU forward.

**Paged decode attention.** The plain-PyTorch decode path (:func:`spinwheel.engine.kernels.attention.paged_attention`)
gathers (copies) every sequence's cached blocks before ``scaled_dot_product_attention`` can read them, and SDPA's
CPU kernel spends most of its time on small-GEMM overhead for a one-token query. Decode attention is memory-bound,
so this kernel (written for this project after the fused kernels of the PagedAttention paper, Kwon et al., SOSP
2023) reads each cached K and V row exactly once, straight from the paged cache and in memory order, for all query
heads of a sequence together (grouped-query attention without repeating K/V), with an exact two-pass softmax. For
head dims that are a multiple of 16 it works on 16-float vectors (GCC/Clang vector extensions, so AVX-512, AVX2 or
SSE code as the target allows): query-key products of 16 keys are reduced together with shuffles instead of one
horizontal sum each, the softmax uses a vectorised exp (Cephes' range reduction and polynomial), and while a chunk
of 16 keys is processed the next chunk's rows are prefetched into L2 (blocks are scattered in the pool, and the
hardware prefetchers stop at every block). Sequences are split over ``torch.get_num_threads()`` threads by total
context length; with OpenMP the shares run in torch's own thread pool (the kernel library resolves to the
``libgomp`` torch has loaded) — a second pool of threads would compete with torch's spin-waiting workers, which in
a measurement erased most of the gain.

**Element-wise ops** for :mod:`spinwheel.engine.kernels.cpu_forward`: RMSNorm of rows; one pass that applies RoPE to the
fused q/k/v projection's rows, lays q/k/v out as (tokens, heads, head_dim) and writes k and v into their
paged-cache slots; and silu(gate) * up. Each replaces 3-15 small PyTorch ops per layer; rows are shared among
torch's OpenMP threads when there are many (prefill). For the sampler, greedy decoding's reduction of logits rows:
each row's argmax and that token's log-probability in two passes over the row (``argmax`` and ``logsumexp`` take
four or more in PyTorch; 32 rows of a 49,152-token vocabulary are 6 MiB a step). They follow the model's
arithmetic (fp32, gain after normalisation, rotate-half RoPE); summation order, fused multiply-adds and the exp
approximation differ at float rounding level.

The C source is ``cpu_kernels.c`` beside this module (package data, read with :mod:`importlib.resources`). It is
compiled with the system C compiler on first use (about a second) into a private per-user temporary directory, one
library per hash of source, compiler and flags, and loaded with :mod:`ctypes`. Without a compiler, or on a failed
build, the loader returns ``None`` and the engine keeps the PyTorch paths, which stay the tested
reference (``tests/test_engine_attention.py`` and ``tests/test_engine_cpu_forward.py`` check both).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources

import torch

logger = logging.getLogger(__name__)


def _source() -> str:
    """The kernels' C source, shipped beside this module as package data."""
    return resources.files("spinwheel.engine").joinpath("cpu_kernels.c").read_text(encoding="utf-8")


# -fassociative-math lets the compiler vectorise the dot-product reductions; no -ffinite-math-only (the softmax
# starts from -inf).
_FLAGS = ["-O3", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-shared", "-fPIC"]
# tried in order: OpenMP (run in torch's thread pool) and AVX where the compiler and the loader allow
_VARIANTS = (["-fopenmp", "-march=native"], ["-fopenmp"], ["-march=native"], [])


def _compile(source: str, compiler: str, flags: list[str], out_path: str) -> bool:
    src_dir = os.path.dirname(out_path)
    with tempfile.NamedTemporaryFile("w", suffix=".c", dir=src_dir, delete=False) as f:
        f.write(source)
        src = f.name
    tmp_out = f"{out_path}.{os.getpid()}.tmp"
    try:
        if (
            subprocess.run([compiler, *_FLAGS, *flags, src, "-o", tmp_out], capture_output=True, timeout=120).returncode
            != 0
        ):
            return False
        os.replace(tmp_out, out_path)  # atomic: concurrent builders never load a half-written file
        return True
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        for p in (src, tmp_out):
            if os.path.exists(p):
                os.remove(p)


@dataclass(frozen=True)
class Kernels:
    """The C functions of one built library (see the module docstring)."""

    paged_decode_attention: ctypes._CFuncPtr  # type: ignore[name-defined]
    rms_norm: ctypes._CFuncPtr  # type: ignore[name-defined]
    silu_mul: ctypes._CFuncPtr  # type: ignore[name-defined]
    rope_qkv: ctypes._CFuncPtr  # type: ignore[name-defined]
    greedy_rows: ctypes._CFuncPtr  # type: ignore[name-defined]


def _bind(lib: ctypes.CDLL) -> Kernels:
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    signatures = {
        "paged_decode_attention": [ptr] * 6 + [i64] * 6 + [f32, i64],
        "rms_norm": [ptr] * 3 + [i64] * 2 + [f32, i64],
        "silu_mul": [ptr] * 2 + [i64] * 3,
        "rope_qkv": [ptr] * 9 + [i64] * 5,
        "greedy_rows": [ptr, i64, i64, ptr, ptr, i64],
    }
    fns = {}
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
        fns[name] = fn
    return Kernels(**fns)


@functools.cache
def load_kernels() -> Kernels | None:
    """The compiled kernels, or ``None`` where no C compiler can build them (the engine then uses PyTorch ops)."""
    compiler = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if compiler is None:
        logger.info("no C compiler found: the engine uses its PyTorch paths on CPU")
        return None
    user = os.getuid() if hasattr(os, "getuid") else "user"
    cache_dir = os.path.join(tempfile.gettempdir(), f"spinwheel-kernels-{user}")
    try:
        os.makedirs(cache_dir, mode=0o700, exist_ok=True)
        st = os.stat(cache_dir)
    except OSError:
        return None
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        # a shared temporary directory: never load a library that another user could have placed there
        logger.info("%s is not private to this user: the engine uses its PyTorch paths on CPU", cache_dir)
        return None
    source = _source()
    for flags in _VARIANTS:
        key = hashlib.sha256("\0".join([source, compiler, *_FLAGS, *flags, platform.machine()]).encode())
        path = os.path.join(cache_dir, f"engine_kernels-{key.hexdigest()[:16]}.so")
        if not os.path.exists(path) and not _compile(source, compiler, flags, path):
            continue
        try:
            kernels = _bind(ctypes.CDLL(path))
        except (OSError, AttributeError):  # e.g. an OpenMP runtime the loader cannot resolve: next variant
            continue
        logger.debug("CPU engine kernels: %s (%s)", path, " ".join(flags) or "no extra flags")
        return kernels
    logger.info("building the CPU engine kernels failed: the engine uses its PyTorch paths on CPU")
    return None


def _require() -> Kernels:
    kernels = load_kernels()
    if kernels is None:
        raise RuntimeError("the CPU engine kernels are not available (no C compiler, or the build failed)")
    return kernels


def _check_f32(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 CPU tensor")


def check_decode_tables(
    block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """The C code trusts its indices: every block id must exist and every context fit its table."""
    if block_tables.numel() == 0:
        return
    if (
        int(block_tables.min()) < 0
        or int(block_tables.max()) >= num_blocks
        or int(context_lens.min()) < 1
        or int(context_lens.max()) > block_tables.shape[1] * block_size
    ):
        raise ValueError("paged_decode_attention: block table or context length out of range")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    checked: bool = False,
) -> None:
    """One query token per sequence: q (S, H, D), caches (num_blocks, block_size, G, D), block_tables
    (S, max_blocks) int64, context_lens (S,) int64 (keys per sequence, this step's token included) -> ``out``
    (S, H, D), written in place. q, caches and out: contiguous fp32 CPU tensors. ``checked``: the caller has run
    :func:`check_decode_tables` on these tables already (the runner does, once per step for all layers)."""
    fn = _require().paged_decode_attention
    s, h, d = q.shape
    num_blocks, bs, g, _ = k_cache.shape
    _check_f32(q=q, k_cache=k_cache, v_cache=v_cache, out=out)
    if (
        h % g
        or out.shape != q.shape
        or v_cache.shape != k_cache.shape
        or k_cache.shape[3] != d
        or block_tables.shape[0] != s
        or context_lens.shape != (s,)
    ):
        raise ValueError("paged_decode_attention: inconsistent shapes")
    if (
        block_tables.dtype != torch.int64
        or context_lens.dtype != torch.int64
        or not block_tables.is_contiguous()
        or not context_lens.is_contiguous()
    ):
        block_tables, context_lens = block_tables.to(torch.int64).contiguous(), context_lens.to(torch.int64)
        context_lens = context_lens.contiguous()
    if s == 0:
        return
    if not checked:
        check_decode_tables(block_tables, context_lens, num_blocks, bs)
    fn(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(),
        s,
        h,
        g,
        d,
        bs,
        block_tables.shape[1],
        d**-0.5,
        torch.get_num_threads(),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of x (N, C) with gain ``weight`` (C,) -> new (N, C)."""
    _check_f32(x=x, weight=weight)
    n, c = x.shape
    if weight.shape != (c,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} != ({c},)")
    out = torch.empty_like(x)
    _require().rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), n, c, eps, torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (N, 2I), each row ``gate | up`` -> silu(gate) * up (N, I)."""
    _check_f32(gate_up=gate_up)
    n, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(f"silu_mul: odd width {two_i}")
    out = gate_up.new_empty(n, two_i // 2)
    _require().silu_mul(gate_up.data_ptr(), out.data_ptr(), n, two_i // 2, torch.get_num_threads())
    return out


def rope_qkv(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection qkv (N, (H + 2G) * D) and cos/sin (N, D/2) -> q (N, H, D) and k (N, G, D) with
    rotate-half RoPE, v (N, G, D); with caches (num_blocks, block_size, G, D) and ``slot_mapping`` (N,) int64, k
    and v are also written to their cache slots (the slots must exist: the runner checks them once per step)."""
    _check_f32(qkv=qkv, cos=cos, sin=sin)
    n, half = cos.shape
    h, g, d = num_heads, num_kv_heads, 2 * half
    if qkv.shape != (n, (h + 2 * g) * d) or sin.shape != cos.shape:
        raise ValueError("rope_qkv: inconsistent shapes")
    q, k, v = qkv.new_empty(n, h, d), qkv.new_empty(n, g, d), qkv.new_empty(n, g, d)
    kc = vc = slots = 0
    if k_cache is not None and v_cache is not None and slot_mapping is not None:
        _check_f32(k_cache=k_cache, v_cache=v_cache)
        if (
            k_cache.shape[2:] != (g, d)
            or v_cache.shape != k_cache.shape
            or slot_mapping.shape != (n,)
            or slot_mapping.dtype != torch.int64
            or not slot_mapping.is_contiguous()
        ):
            raise ValueError("rope_qkv: cache or slot_mapping does not match")
        kc, vc, slots = k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr()
    _require().rope_qkv(
        qkv.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        kc,
        vc,
        slots,
        n,
        h,
        g,
        d,
        torch.get_num_threads(),
    )
    return q, k, v


def greedy_rows(logits: torch.Tensor) -> tuple[list[int], list[float]] | None:
    """logits (R, V) -> the argmax of each row (the first one, as ``torch.argmax``) and its log-probability
    (``x[argmax] - logsumexp(x)``); ``None`` when the kernels are unavailable, the tensor is not contiguous fp32 on
    CPU, or a row holds a NaN or an infinite maximum (the caller's PyTorch path defines those)."""
    kernels = load_kernels()
    if kernels is None or logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu":
        return None
    logits = logits.contiguous()
    r, v = logits.shape
    idx, lp = torch.empty(r, dtype=torch.int64), torch.empty(r, dtype=torch.float32)
    kernels.greedy_rows(logits.data_ptr(), r, v, idx.data_ptr(), lp.data_ptr(), torch.get_num_threads())
    if not bool(torch.isfinite(lp).all()):
        return None
    return idx.tolist(), lp.tolist()
