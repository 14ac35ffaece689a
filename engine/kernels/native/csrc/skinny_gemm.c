/* out = x @ w^T (+ bias) for the few rows of a decode step, streaming the weight once, in order.
 *
 * Where it sits: kvfleet/engine/kernels/cpu_linear.py calls skinny_linear_f32 through ctypes
 * for the model's matmuls (engine/model/llama.py) whose input has at most a few dozen rows;
 * larger inputs (prefill chunks) go to torch's GEMM. w is the nn.Linear weight as stored,
 * (n, k) row-major: output column j is the dot product of x's row with w's row j.
 *
 * Why: at decode the weight is read from memory once per step and each element does only a
 * few FMAs, so a step is bound by memory bandwidth, and the BLAS GEMM's panel walk does not
 * keep the bandwidth busy at a few rows (on SmolLM2 it ran 8 rows at half the bandwidth of 1).
 * Here each thread owns a contiguous run of w's rows and reads them start to end, one
 * sequential stream; the few rows of x stay in L1 and every weight vector loaded is used for
 * all of them (up to JB weight rows x MB rows of x accumulate in registers: four weight rows
 * for a few rows of x, more independent FMA chains, two past that so nothing spills).
 *
 * Invariant: out[r][j] = bias[j] + dot(x[r], w[j]), summed in float32 in VEC lanes over k
 * (lane l takes the terms i = l mod VEC, in order), then the lanes added as a tree, the last
 * k mod VEC terms after it, for every (r, j) whatever the block shape; each (r, j) is written
 * by exactly one thread. Software prefetch of the rows PREFETCH_ROWS ahead
 * keeps the memory stream busy while the FMAs run (without it 8 rows ran 1.4x slower).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VEC 16 /* floats per vector: one AVX-512 register */
#define MB 8   /* rows of x per block: at most 16 accumulators (4 x 4 or 8 x 2) of 32 registers */
#else
#define VEC 8  /* one AVX2 register: a 16-float type would take two and spill (2-3x slower) */
#define MB 4   /* 8 accumulators (4 x 2) of the 16 registers; 4 x 4 spills a few, still faster */
#endif
#define JB 4   /* rows of w per block at most: their vectors are loaded once for all rows of x */
#define PREFETCH_ROWS 8 /* w's rows are prefetched this far ahead: the stream stays ahead of the FMAs */

typedef float vf __attribute__((vector_size(VEC * sizeof(float)), aligned(4), may_alias));

static inline vf load(const float *p) { return *(const vf *)p; }

/* acc + a * b, one rounding where the machine has FMA. Spelled out, not left to the compiler's
 * contraction, which fused some of these and not others depending on the block shape it inlined
 * (then an output's bits depended on which block its weight row fell in). */
static inline vf fma_v(vf acc, vf a, vf b) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    return acc + a * b;
#endif
}

static inline float fma_s(float acc, float a, float b) {
#if defined(__FMA__) || defined(__AVX512F__)
    return __builtin_fmaf(a, b, acc);
#else
    return acc + a * b;
#endif
}

typedef float vh __attribute__((vector_size(VEC * sizeof(float) / 2)));
typedef float vq __attribute__((vector_size(VEC * sizeof(float) / 4)));

/* The lanes of v added as a tree: halves, then quarters, then the last four. */
static inline float lanes_sum(vf v) {
    vh lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    const vh h = lo + hi;
    vq a, b;
    memcpy(&a, &h, sizeof a);
    memcpy(&b, (const char *)&h + sizeof a, sizeof b);
    const vq q = a + b;
    float s = 0.0f;
    for (int l = 0; l < VEC / 4; l++) s += q[l];
    return s;
}

/* out[r][j0 + b] for r in [0, mb), b in [0, jb); mb and jb compile-time constants after inlining. */
static inline __attribute__((always_inline)) void block(const float *restrict x, int mb, int64_t k,
                                                        const float *restrict w, int jb, int64_t j0,
                                                        const float *restrict bias, float *restrict out,
                                                        int64_t n) {
    vf acc[MB][JB];
    for (int r = 0; r < mb; r++)
        for (int b = 0; b < jb; b++) acc[r][b] = (vf){0};
    const int64_t kv = k / VEC * VEC;
    for (int64_t i = 0; i < kv; i += VEC) {
        vf wv[JB];
        for (int b = 0; b < jb; b++) {
            wv[b] = load(w + (j0 + b) * k + i);
            __builtin_prefetch(w + (j0 + b + PREFETCH_ROWS) * k + i);
        }
        for (int r = 0; r < mb; r++) {
            const vf xv = load(x + r * k + i);
            for (int b = 0; b < jb; b++) acc[r][b] = fma_v(acc[r][b], xv, wv[b]);
        }
    }
    for (int r = 0; r < mb; r++)
        for (int b = 0; b < jb; b++) {
            float s = lanes_sum(acc[r][b]);
            const float *wr = w + (j0 + b) * k, *xr = x + r * k;
            for (int64_t i = kv; i < k; i++) s = fma_s(s, xr[i], wr[i]);
            out[r * n + j0 + b] = bias != NULL ? s + bias[j0 + b] : s;
        }
}

/* Rows [0, m) of x against w's rows [j0, j0 + jb): MB rows of x at a time, then the rest. */
static inline __attribute__((always_inline)) void rows_block(const float *x, int64_t m, int64_t k, const float *w,
                                                             int jb, int64_t j0, const float *bias, float *out,
                                                             int64_t n) {
    int64_t r0 = 0;
    for (; r0 + MB <= m; r0 += MB) block(x + r0 * k, MB, k, w, jb, j0, bias, out + r0 * n, n);
    const float *xr = x + r0 * k;
    float *o = out + r0 * n;
    switch (m - r0) { /* each case is block() specialised for that many rows */
#if MB > 4
    case 7: block(xr, 7, k, w, jb, j0, bias, o, n); break;
    case 6: block(xr, 6, k, w, jb, j0, bias, o, n); break;
    case 5: block(xr, 5, k, w, jb, j0, bias, o, n); break;
    case 4: block(xr, 4, k, w, jb, j0, bias, o, n); break;
#endif
    case 3: block(xr, 3, k, w, jb, j0, bias, o, n); break;
    case 2: block(xr, 2, k, w, jb, j0, bias, o, n); break;
    case 1: block(xr, 1, k, w, jb, j0, bias, o, n); break;
    default: break;
    }
}

/* rows_block specialised for 4, 2 and 1 rows of w (the accumulators stay in registers). */
static void rows_block4(const float *x, int64_t m, int64_t k, const float *w, int64_t j0, const float *bias,
                        float *out, int64_t n) {
    rows_block(x, m, k, w, 4, j0, bias, out, n);
}
static void rows_block2(const float *x, int64_t m, int64_t k, const float *w, int64_t j0, const float *bias,
                        float *out, int64_t n) {
    rows_block(x, m, k, w, 2, j0, bias, out, n);
}
static void rows_block1(const float *x, int64_t m, int64_t k, const float *w, int64_t j0, const float *bias,
                        float *out, int64_t n) {
    rows_block(x, m, k, w, 1, j0, bias, out, n);
}

/* x (m, k) rows contiguous; w (n, k) rows contiguous; bias (n,) or NULL; out (m, n) rows contiguous. */
void skinny_linear_f32(const float *x, int64_t m, int64_t k, const float *w, int64_t n, const float *bias,
                       float *out, int num_threads) {
    if (num_threads < 1) num_threads = 1;
    /* Four w rows per block while their accumulators fit in registers with all of x's rows (a
     * few rows: more independent FMA chains, 1-4 rows 22-24 -> 20 ms a SmolLM2 pass), else two. */
    const int jb = m <= JB ? JB : 2;
    const int64_t blocks = n / jb;
    /* Each thread takes a contiguous run of w's rows: one sequential stream through memory. */
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t p = 0; p < blocks; p++) {
        if (jb == JB)
            rows_block4(x, m, k, w, p * JB, bias, out, n);
        else
            rows_block2(x, m, k, w, p * 2, bias, out, n);
    }
    /* The last n mod jb rows of w one at a time: the same sums, lane for lane. */
    for (int64_t j = blocks * jb; j < n; j++) rows_block1(x, m, k, w, j, bias, out, n);
}
