"""A fused paged decode-attention kernel for CPU: each sequence's K/V are read in place through its block table.

The plain-PyTorch decode path (:func:`spinwheel.engine.attention.paged_attention`) gathers (copies) every
sequence's cached blocks before ``scaled_dot_product_attention`` can read them, and SDPA's CPU kernel spends most of
its time on small-GEMM overhead for a one-token query. Decode attention is memory-bound, so this kernel (written for
this project in ~80 lines of C, after the fused kernels of the PagedAttention paper, Kwon et al., SOSP 2023) reads
each cached K and V row exactly once, straight from the paged cache, for all query heads of a sequence together
(grouped-query attention without repeating K/V), with an exact two-pass softmax. Sequences are split over
``torch.get_num_threads()`` threads by total context length; with OpenMP the shares run in torch's own thread pool
(the kernel library resolves to the ``libgomp`` torch has loaded) — a second pool of threads would compete with
torch's spin-waiting workers, which in a measurement erased most of the gain.

The C source is compiled with the system C compiler on first use (about a second) into a private per-user temporary
directory, one library per hash of source, compiler and flags, and loaded with :mod:`ctypes`. Without a compiler,
or on a failed build, the loader returns ``None`` and the engine keeps the PyTorch path, which stays the tested
reference (``tests/test_engine_attention.py`` checks both against dense attention).
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

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define GET_CSR() _mm_getcsr()
#define SET_CSR(c) _mm_setcsr(c)
#else
#define GET_CSR() 0u
#define SET_CSR(c) ((void)(c))
#endif

typedef struct {
    const float *q, *kc, *vc; const int64_t *tables, *lens; float *out;
    int64_t H, G, D, bs, max_blocks; float scale; int64_t begin, end; unsigned int csr;
} job_t;

/* sequences [begin, end): q (S, H, D); caches (num_blocks, bs, G, D); tables (S, max_blocks); out (S, H, D) */
static void run(const job_t *j) {
    const int64_t H = j->H, G = j->G, D = j->D, bs = j->bs, rep = H / G;
    int64_t maxlen = 1;
    for (int64_t s = j->begin; s < j->end; s++) if (j->lens[s] > maxlen) maxlen = j->lens[s];
    float *scores = malloc(sizeof(float) * H * maxlen);  /* (T, H) */
    float *acc = malloc(sizeof(float) * H * D);
    float *mx = malloc(sizeof(float) * H), *sum = malloc(sizeof(float) * H);
    for (int64_t s = j->begin; s < j->end; s++) {
        const int64_t L = j->lens[s];
        const int64_t *table = j->tables + s * j->max_blocks;
        const float *q = j->q + s * H * D;
        for (int64_t h = 0; h < H; h++) { mx[h] = -INFINITY; sum[h] = 0.f; }
        for (int64_t t = 0; t < L; t++) {  /* scores: one pass over the keys, all heads of a token together */
            const float *k = j->kc + (table[t / bs] * bs + t % bs) * G * D;
            float *sc = scores + t * H;
            for (int64_t h = 0; h < H; h++) {
                const float *qh = q + h * D, *kh = k + (h / rep) * D;
                float d = 0.f;
                for (int64_t i = 0; i < D; i++) d += qh[i] * kh[i];
                sc[h] = d * j->scale;
                if (sc[h] > mx[h]) mx[h] = sc[h];
            }
        }
        for (int64_t t = 0; t < L; t++) for (int64_t h = 0; h < H; h++) {
            const float e = expf(scores[t * H + h] - mx[h]);
            scores[t * H + h] = e; sum[h] += e;
        }
        memset(acc, 0, sizeof(float) * H * D);
        for (int64_t t = 0; t < L; t++) {  /* one pass over the values */
            const float *v = j->vc + (table[t / bs] * bs + t % bs) * G * D;
            const float *p = scores + t * H;
            for (int64_t h = 0; h < H; h++) {
                const float *vh = v + (h / rep) * D; float *a = acc + h * D; const float ph = p[h];
                for (int64_t i = 0; i < D; i++) a[i] += ph * vh[i];
            }
        }
        float *o = j->out + s * H * D;
        for (int64_t h = 0; h < H; h++) {
            const float inv = 1.f / sum[h];
            for (int64_t i = 0; i < D; i++) o[h * D + i] = acc[h * D + i] * inv;
        }
    }
    free(scores); free(acc); free(mx); free(sum);
}

void paged_decode_attention(const float *q, const float *kc, const float *vc, const int64_t *tables,
                            const int64_t *lens, float *out, int64_t S, int64_t H, int64_t G, int64_t D,
                            int64_t bs, int64_t max_blocks, float scale, int64_t num_threads) {
    enum { MAX_THREADS = 256 };
    job_t jobs[MAX_THREADS];
    if (num_threads > S) num_threads = S;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    int64_t total = 0;
    for (int64_t s = 0; s < S; s++) total += lens[s];
    const unsigned int csr = GET_CSR();
    int64_t s0 = 0, c = 0;
    for (int64_t n = 0; n < num_threads; n++) {  /* contiguous ranges of about equal total context */
        const int64_t target = total * (n + 1) / num_threads;
        int64_t s1 = s0;
        while (s1 < S && (c < target || n == num_threads - 1)) c += lens[s1++];
        job_t j = {q, kc, vc, tables, lens, out, H, G, D, bs, max_blocks, scale, s0, s1, csr};
        jobs[n] = j; s0 = s1;
    }
    /* torch's own OpenMP pool runs the shares (the library resolves to the libgomp torch loaded), so no second
       set of threads competes with torch's spinning workers; every thread takes the caller's control word
       (denormal flushing). Built without OpenMP, the loop runs serially. */
    #pragma omp parallel for num_threads(num_threads) schedule(static, 1)
    for (int64_t n = 0; n < num_threads; n++) {
        SET_CSR(jobs[n].csr);
        run(&jobs[n]);
    }
}
"""

# -fassociative-math lets the compiler vectorise the dot-product reductions; no -ffinite-math-only (the softmax
# starts from -inf).
_FLAGS = ["-O3", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-shared",
          "-fPIC"]
# tried in order: OpenMP (run in torch's thread pool) and AVX where the compiler and the loader allow
_VARIANTS = (["-fopenmp", "-march=native"], ["-fopenmp"], ["-march=native"], [])


def _compile(compiler: str, flags: list[str], out_path: str) -> bool:
    src_dir = os.path.dirname(out_path)
    with tempfile.NamedTemporaryFile("w", suffix=".c", dir=src_dir, delete=False) as f:
        f.write(_SOURCE)
        src = f.name
    tmp_out = f"{out_path}.{os.getpid()}.tmp"
    try:
        if subprocess.run([compiler, *_FLAGS, *flags, src, "-o", tmp_out], capture_output=True,
                          timeout=120).returncode != 0:
            return False
        os.replace(tmp_out, out_path)  # atomic: concurrent builders never load a half-written file
        return True
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        for p in (src, tmp_out):
            if os.path.exists(p):
                os.remove(p)


@functools.cache
def load_decode_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The compiled ``paged_decode_attention`` function, or ``None`` where no C compiler can build it."""
    compiler = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if compiler is None:
        logger.info("no C compiler found: paged decode attention uses the PyTorch path")
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
        logger.info("%s is not private to this user: paged decode attention uses the PyTorch path", cache_dir)
        return None
    for flags in _VARIANTS:
        key = hashlib.sha256("\0".join([_SOURCE, compiler, *_FLAGS, *flags, platform.machine()]).encode())
        path = os.path.join(cache_dir, f"paged_decode_attention-{key.hexdigest()[:16]}.so")
        if not os.path.exists(path) and not _compile(compiler, flags, path):
            continue
        try:
            fn = ctypes.CDLL(path).paged_decode_attention
        except OSError:  # e.g. an OpenMP runtime the loader cannot resolve: try the next variant
            continue
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64]
        fn.restype = None
        logger.debug("CPU paged-attention kernel: %s (%s)", path, " ".join(flags) or "no extra flags")
        return fn
    logger.info("building the CPU paged-attention kernel failed: paged decode attention uses the PyTorch path")
    return None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor) -> None:
    """One query token per sequence: q (S, H, D), caches (num_blocks, block_size, G, D), block_tables
    (S, max_blocks) int64, context_lens (S,) int64 (keys per sequence, this step's token included) -> ``out``
    (S, H, D), written in place. q, caches and out: contiguous fp32 CPU tensors."""
    fn = load_decode_kernel()
    if fn is None:
        raise RuntimeError("the CPU paged-attention kernel is not available")
    s, h, d = q.shape
    num_blocks, bs, g, _ = k_cache.shape
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 CPU tensor")
    if (h % g or out.shape != q.shape or v_cache.shape != k_cache.shape or k_cache.shape[3] != d
            or block_tables.shape[0] != s or context_lens.shape != (s,)):
        raise ValueError("paged_decode_attention: inconsistent shapes")
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    if s == 0:
        return
    # the C code trusts its indices: check them here (two reductions over small tensors)
    if int(tables.min()) < 0 or int(tables.max()) >= num_blocks or int(lens.min()) < 1 or \
            int(lens.max()) > tables.shape[1] * bs:
        raise ValueError("paged_decode_attention: block table or context length out of range")
    fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
       s, h, g, d, bs, tables.shape[1], d ** -0.5, torch.get_num_threads())
