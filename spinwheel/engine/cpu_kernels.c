/* Fused CPU kernels of the spinwheel engine: paged decode attention, RMSNorm, RoPE + q/k/v layout + KV-cache
 * write, silu(gate) * up. Loaded by spinwheel/engine/cpu_kernels.py (whose docstring describes the kernels),
 * which compiles this file on first use; by hand:
 *   cc -O3 -fno-math-errno -fassociative-math -fno-signed-zeros -fno-trapping-math -shared -fPIC \
 *      -fopenmp -march=native cpu_kernels.c -o engine_kernels.so
 */
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

/* ---- the same computation on 16-float vectors (GCC/Clang vector extensions: AVX-512, AVX2 or SSE code as the
   target allows) for head dims that are a multiple of 16 ---- */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16 vld(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void vst(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline v16 vsplat(float x) { v16 v = {x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; return v; }
static inline float vsum(v16 v) {
    float t[16]; memcpy(t, &v, sizeof t);
    for (int w = 8; w > 0; w /= 2) for (int i = 0; i < w; i++) t[i] += t[i + w];
    return t[0];
}
static inline float vmax(v16 v) {
    float t[16]; memcpy(t, &v, sizeof t);
    for (int w = 8; w > 0; w /= 2) for (int i = 0; i < w; i++) t[i] = t[i] > t[i + w] ? t[i] : t[i + w];
    return t[0];
}
/* exp(x) for x <= 0 (scores minus their maximum): Cephes' expf range reduction and polynomial (about 1 ulp);
   below -87 the result is clamped to exp(-87) ~ 1.6e-38, i.e. zero against the maximum's exp(0) = 1 */
static inline v16 vexp_nonpos(v16 x) {
    const v16i lo = (v16i)(x < vsplat(-87.f));
    x = (v16)((lo & (v16i)vsplat(-87.f)) | (~lo & (v16i)x));
    const v16i n = __builtin_convertvector(x * vsplat(1.44269504088896341f) - vsplat(0.5f), v16i);
    const v16 fn = __builtin_convertvector(n, v16);
    x = x - fn * vsplat(0.693359375f) - fn * vsplat(-2.12194440e-4f);
    const v16 z = x * x;
    v16 y = vsplat(1.9875691500e-4f);
    y = y * x + vsplat(1.3981999507e-3f);
    y = y * x + vsplat(8.3334519073e-3f);
    y = y * x + vsplat(4.1665795894e-2f);
    y = y * x + vsplat(1.6666665459e-1f);
    y = y * x + vsplat(5.0000001201e-1f);
    y = y * z + x + vsplat(1.f);
    return y * (v16)((n + 127) << 23);
}

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
/* lane t of the result = the sum of the lanes of a[t] (16 dot products reduced together, 30 shuffles) */
static inline v16 vsum16(const v16 *a) {
    v16 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                       30, 31);
    for (int i = 0; i < 4; i++)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                       31);
    for (int i = 0; i < 2; i++)
        d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                       31);
    return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#else
static inline v16 vsum16(const v16 *a) {
    v16 r; for (int t = 0; t < 16; t++) r[t] = vsum(a[t]); return r;
}
#endif

/* One sequence, all heads; D a multiple of 16 (a literal at the call sites below, so the loops over D unroll and
   the accumulators stay in registers). scores (H, LS) with LS >= L rounded up to 16. */
static inline __attribute__((always_inline)) void attend_vec(const job_t *j, int64_t s, float *scores, int64_t LS,
                                                             float *qs, float *sum, int64_t *rowoff,
                                                             v16 *partial, const int64_t D) {
    const int64_t H = j->H, G = j->G, bs = j->bs, rep = H / G, L = j->lens[s];
    const int64_t *table = j->tables + s * j->max_blocks;
    for (int64_t i = 0; i < H * D; i++) qs[i] = j->q[s * H * D + i] * j->scale;
    for (int64_t t = 0, b = 0, off = 0; t < L; t++) {  /* cache row of each key: no division per access */
        rowoff[t] = (table[b] * bs + off) * G * D;
        if (++off == bs) { off = 0; b++; }
    }
    /* scores, 16 keys (one chunk) at a time, reading the key rows in memory order (the prefetchers stream them);
       the unreduced products wait in partial (H, 16) and are reduced 16 at a time */
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const int64_t nt = L - t0 < 16 ? L - t0 : 16;
        for (int64_t u = 0; u < 16; u++) {
            if (u >= nt) { for (int64_t h = 0; h < H; h++) partial[h * 16 + u] = vsplat(0.f); continue; }
            const float *k = j->kc + rowoff[t0 + u];
            if (t0 + 16 + u < L)  /* the same row of the next chunk (usually another block) is fetched into L2
                                     meanwhile: measured 1.45x faster on scattered blocks, no loss on contiguous */
                for (int64_t i = 0; i < G * D; i += 16) __builtin_prefetch(j->kc + rowoff[t0 + 16 + u] + i, 0, 1);
            for (int64_t g = 0; g < G; g++) {
                v16 kg[16];  /* D <= 256 */
                for (int64_t i = 0; i < D / 16; i++) kg[i] = vld(k + g * D + 16 * i);
                for (int64_t r = 0; r < rep; r++) {
                    const int64_t h = g * rep + r;
                    const float *qh = qs + h * D;
                    v16 a = vld(qh) * kg[0];
                    for (int64_t i = 1; i < D / 16; i++) a += vld(qh + 16 * i) * kg[i];
                    partial[h * 16 + u] = a;
                }
            }
        }
        for (int64_t h = 0; h < H; h++) vst(scores + h * LS + t0, vsum16(partial + h * 16));
    }
    for (int64_t h = 0; h < H; h++) {  /* softmax numerators, 16 scores at a time */
        float *row = scores + h * LS;
        for (int64_t t = L; t < LS; t++) row[t] = -INFINITY;  /* padding: exp gives ~0, never added below */
        v16 m = vld(row);
        for (int64_t t = 16; t < LS; t += 16) {
            const v16 x = vld(row + t); const v16i gt = (v16i)(x > m);
            m = (v16)((gt & (v16i)x) | (~gt & (v16i)m));
        }
        const v16 mx = vsplat(vmax(m));
        v16 tot = vsplat(0.f);
        for (int64_t t = 0; t + 16 <= L; t += 16) {
            const v16 e = vexp_nonpos(vld(row + t) - mx); vst(row + t, e); tot += e;
        }
        float total = vsum(tot);
        if (L % 16) {
            const int64_t t0 = L / 16 * 16;
            float e[16]; vst(e, vexp_nonpos(vld(row + t0) - mx));
            for (int64_t t = t0; t < L; t++) { row[t] = e[t - t0]; total += e[t - t0]; }
        }
        sum[h] = total;
    }
    /* values, in memory order; the output rows (H * D floats) accumulate in L1 */
    float *o = j->out + s * H * D;
    memset(o, 0, sizeof(float) * H * D);
    for (int64_t t = 0; t < L; t++) {
        const float *v = j->vc + rowoff[t];
        if (t + 16 < L)
            for (int64_t i = 0; i < G * D; i += 16) __builtin_prefetch(j->vc + rowoff[t + 16] + i, 0, 1);
        for (int64_t g = 0; g < G; g++) {
            v16 vg[16];
            for (int64_t i = 0; i < D / 16; i++) vg[i] = vld(v + g * D + 16 * i);
            for (int64_t r = 0; r < rep; r++) {
                const int64_t h = g * rep + r;
                const v16 pt = vsplat(scores[h * LS + t]);
                float *oh = o + h * D;
                for (int64_t i = 0; i < D / 16; i++) vst(oh + 16 * i, vld(oh + 16 * i) + pt * vg[i]);
            }
        }
    }
    for (int64_t h = 0; h < H; h++) {
        const v16 inv = vsplat(1.f / sum[h]);
        for (int64_t i = 0; i < D / 16; i++) vst(o + h * D + 16 * i, vld(o + h * D + 16 * i) * inv);
    }
}

static void run_vec(const job_t *j) {
    const int64_t H = j->H, D = j->D;
    int64_t maxlen = 1;
    for (int64_t s = j->begin; s < j->end; s++) if (j->lens[s] > maxlen) maxlen = j->lens[s];
    const int64_t LS = (maxlen + 15) / 16 * 16;
    float *scores = malloc(sizeof(float) * H * LS), *qs = malloc(sizeof(float) * H * D);
    float *sum = malloc(sizeof(float) * H);
    int64_t *rowoff = malloc(sizeof(int64_t) * LS);
    v16 *partial = aligned_alloc(64, sizeof(v16) * H * 16);
    for (int64_t s = j->begin; s < j->end; s++) {
        if (D == 64) attend_vec(j, s, scores, LS, qs, sum, rowoff, partial, 64);
        else if (D == 128) attend_vec(j, s, scores, LS, qs, sum, rowoff, partial, 128);
        else attend_vec(j, s, scores, LS, qs, sum, rowoff, partial, D);
    }
    free(scores); free(qs); free(sum); free(rowoff); free(partial);
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
        if (D % 16 == 0 && D <= 256) run_vec(&jobs[n]); else run(&jobs[n]);
    }
}

/* RMSNorm of the rows of x (N, C): out[n, c] = w[c] * (x[n, c] / sqrt(mean_c x[n, c]^2 + eps)) */
void rms_norm(const float *x, const float *w, float *out, int64_t N, int64_t C, float eps, int64_t threads) {
    const unsigned int csr = GET_CSR();
    #pragma omp parallel if (N >= 64) num_threads(threads)
    {
        SET_CSR(csr);  /* the caller's denormal flushing, in every thread */
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const float *xn = x + n * C; float *on = out + n * C;
            float ss = 0.f;
            for (int64_t c = 0; c < C; c++) ss += xn[c] * xn[c];
            const float inv = 1.f / sqrtf(ss / (float)C + eps);
            for (int64_t c = 0; c < C; c++) on[c] = w[c] * (xn[c] * inv);
        }
    }
}

/* SwiGLU's element-wise half: gu (N, 2I) holds gate | up per row -> out (N, I) = silu(gate) * up, with
   silu(x) = x * sigmoid(x) and sigmoid from exp(-|x|) (never overflows) */
void silu_mul(const float *gu, float *out, int64_t N, int64_t I, int64_t threads) {
    const unsigned int csr = GET_CSR();
    #pragma omp parallel if (N >= 16) num_threads(threads)
    {
        SET_CSR(csr);
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const float *g = gu + n * 2 * I, *u = g + I; float *o = out + n * I;
            int64_t i = 0;
            for (; i + 16 <= I; i += 16) {
                const v16 x = vld(g + i);
                const v16i neg = (v16i)(x < vsplat(0.f));
                const v16 e = vexp_nonpos((v16)(((v16i)x) | (v16i)vsplat(-0.f)));  /* exp(-|x|) */
                const v16 inv = vsplat(1.f) / (vsplat(1.f) + e);
                const v16 sig = (v16)((neg & (v16i)(e * inv)) | (~neg & (v16i)inv));
                vst(o + i, x * sig * vld(u + i));
            }
            for (; i < I; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
        }
    }
}

/* Rotate-half RoPE over the `heads` heads starting at column c0 of the rows of x (N, row stride sx):
   out (N, heads, D); cos/sin (N, D/2). With a cache, row n is also written to cache slot slots[n]. */
static void rope_heads(const float *x, int64_t sx, int64_t c0, const float *cos_, const float *sin_, float *out,
                       float *cache, const int64_t *slots, int64_t N, int64_t heads, int64_t D, int rotate,
                       int64_t threads) {
    const int64_t half = D / 2, W = heads * D;
    const unsigned int csr = GET_CSR();
    #pragma omp parallel if (N >= 64) num_threads(threads)
    {
        SET_CSR(csr);
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const float *xn = x + n * sx + c0, *c = cos_ + n * half, *s = sin_ + n * half;
            float *o = out + n * W;
            if (!rotate) memcpy(o, xn, sizeof(float) * W);
            else for (int64_t h = 0; h < heads; h++) {
                const float *x1 = xn + h * D, *x2 = x1 + half;
                float *o1 = o + h * D, *o2 = o1 + half;
                for (int64_t i = 0; i < half; i++) {
                    o1[i] = x1[i] * c[i] - x2[i] * s[i];
                    o2[i] = x2[i] * c[i] + x1[i] * s[i];
                }
            }
            if (cache) memcpy(cache + slots[n] * W, o, sizeof(float) * W);
        }
    }
}

/* qkv (N, (H + 2G) * D): the fused projection's rows -> q (N, H, D) and k (N, G, D) with RoPE, v (N, G, D);
   with caches, k and v are also written to their slots */
void rope_qkv(const float *qkv, const float *cos_, const float *sin_, float *q, float *k, float *v, float *kc,
              float *vc, const int64_t *slots, int64_t N, int64_t H, int64_t G, int64_t D, int64_t threads) {
    const int64_t sx = (H + 2 * G) * D;
    rope_heads(qkv, sx, 0, cos_, sin_, q, NULL, NULL, N, H, D, 1, threads);
    rope_heads(qkv, sx, H * D, cos_, sin_, k, kc, slots, N, G, D, 1, threads);
    rope_heads(qkv, sx, (H + G) * D, cos_, sin_, v, vc, slots, N, G, D, 0, threads);
}

/* Greedy sampling's reduction of logits rows x (N, V): idx[n] = the first index of the row's maximum and lp[n] its
   log-probability, -log(sum_v exp(x[n, v] - max)), in two passes over the row (max, then the exp sum; argmax and
   logsumexp each take two or more in PyTorch). A row with a NaN or an infinite maximum gets lp = NaN: the caller
   falls back to PyTorch, which defines those cases. */
void greedy_rows(const float *x, int64_t N, int64_t V, int64_t *idx, float *lp, int64_t threads) {
    const unsigned int csr = GET_CSR();
    #pragma omp parallel if (N >= 4) num_threads(threads)
    {
        SET_CSR(csr);
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const float *row = x + n * V;
            int64_t v = 0, nan = 0;
            float m = -INFINITY;
            if (V >= 16) {
                v16 mv = vld(row); v16i bad = (v16i)(mv != mv);
                for (v = 16; v + 16 <= V; v += 16) {
                    const v16 a = vld(row + v); const v16i gt = (v16i)(a > mv);
                    bad |= (v16i)(a != a);
                    mv = (v16)((gt & (v16i)a) | (~gt & (v16i)mv));
                }
                m = vmax(mv);
                for (int i = 0; i < 16; i++) nan |= bad[i];
            }
            for (; v < V; v++) { if (row[v] > m) m = row[v]; nan |= row[v] != row[v]; }
            int64_t arg = 0;
            while (arg < V && row[arg] != m) arg++;
            idx[n] = arg < V ? arg : 0;
            if (nan || isinf(m)) { lp[n] = NAN; continue; }
            const v16 mx = vsplat(m);
            v16 tot = vsplat(0.f);
            for (v = 0; v + 16 <= V; v += 16) tot += vexp_nonpos(vld(row + v) - mx);
            float total = vsum(tot);
            for (; v < V; v++) total += expf(row[v] - m);
            lp[n] = -logf(total);
        }
    }
}
