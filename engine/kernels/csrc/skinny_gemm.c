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
 * all of them (JB weight rows x up to MB rows of x accumulate in registers).
 *
 * Invariant: out[r][j] = bias[j] + dot(x[r], w[j]), summed in float32 in VEC lanes over k
 * (lane l takes the terms i = l mod VEC, in order), then the lanes added as a tree; each
 * (r, j) is written by exactly one thread. Software prefetch of the rows PREFETCH_ROWS ahead
 * keeps the memory stream busy while the FMAs run (without it 8 rows ran 1.4x slower).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VEC 16 /* floats per vector: one AVX-512 register */
#define MB 8   /* rows of x per block: JB x MB accumulators live in registers (16 of 32) */
#else
#define VEC 8  /* one AVX2 register: a 16-float type would take two and spill (2-3x slower) */
#define MB 4   /* 8 accumulators of the 16 registers */
#endif
#define JB 2   /* rows of w per block: their vectors are loaded once for all rows of x */
#define PREFETCH_ROWS 4 /* w's rows are prefetched this far ahead: the stream stays ahead of the FMAs */

typedef float vf __attribute__((vector_size(VEC * sizeof(float)), aligned(4), may_alias));

static inline vf load(const float *p) { return *(const vf *)p; }

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

/* out[r][j0 + b] for r in [0, mb), b in [0, JB); mb a compile-time constant after inlining. */
static inline __attribute__((always_inline)) void block(const float *restrict x, int mb, int64_t k,
                                                        const float *restrict w, int64_t j0,
                                                        const float *restrict bias, float *restrict out,
                                                        int64_t n) {
    vf acc[MB][JB];
    for (int r = 0; r < mb; r++)
        for (int b = 0; b < JB; b++) acc[r][b] = (vf){0};
    const int64_t kv = k / VEC * VEC;
    for (int64_t i = 0; i < kv; i += VEC) {
        vf wv[JB];
        for (int b = 0; b < JB; b++) {
            wv[b] = load(w + (j0 + b) * k + i);
            __builtin_prefetch(w + (j0 + b + PREFETCH_ROWS) * k + i);
        }
        for (int r = 0; r < mb; r++) {
            const vf xv = load(x + r * k + i);
            for (int b = 0; b < JB; b++) acc[r][b] += xv * wv[b];
        }
    }
    for (int r = 0; r < mb; r++)
        for (int b = 0; b < JB; b++) {
            float s = lanes_sum(acc[r][b]);
            const float *wr = w + (j0 + b) * k, *xr = x + r * k;
            for (int64_t i = kv; i < k; i++) s += xr[i] * wr[i];
            out[r * n + j0 + b] = bias != NULL ? s + bias[j0 + b] : s;
        }
}

/* One output column j for rows [0, m): the odd column left when n is not a multiple of JB. */
static void column(const float *x, int64_t m, int64_t k, const float *w, int64_t j, const float *bias,
                   float *out, int64_t n) {
    for (int64_t r = 0; r < m; r++) {
        float s = 0.0f;
        for (int64_t i = 0; i < k; i++) s += x[r * k + i] * w[j * k + i];
        out[r * n + j] = bias != NULL ? s + bias[j] : s;
    }
}

static void rows_block(const float *x, int64_t m, int64_t k, const float *w, int64_t j0, const float *bias,
                       float *out, int64_t n) {
    int64_t r0 = 0;
    for (; r0 + MB <= m; r0 += MB) block(x + r0 * k, MB, k, w, j0, bias, out + r0 * n, n);
    const float *xr = x + r0 * k;
    float *o = out + r0 * n;
    switch (m - r0) { /* each case is block() specialised for that many rows */
#if MB > 4
    case 7: block(xr, 7, k, w, j0, bias, o, n); break;
    case 6: block(xr, 6, k, w, j0, bias, o, n); break;
    case 5: block(xr, 5, k, w, j0, bias, o, n); break;
    case 4: block(xr, 4, k, w, j0, bias, o, n); break;
#endif
    case 3: block(xr, 3, k, w, j0, bias, o, n); break;
    case 2: block(xr, 2, k, w, j0, bias, o, n); break;
    case 1: block(xr, 1, k, w, j0, bias, o, n); break;
    default: break;
    }
}

/* x (m, k) rows contiguous; w (n, k) rows contiguous; bias (n,) or NULL; out (m, n) rows contiguous. */
void skinny_linear_f32(const float *x, int64_t m, int64_t k, const float *w, int64_t n, const float *bias,
                       float *out, int num_threads) {
    if (num_threads < 1) num_threads = 1;
    const int64_t pairs = n / JB;
    /* Each thread takes a contiguous run of w's rows: one sequential stream through memory. */
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t p = 0; p < pairs; p++) rows_block(x, m, k, w, p * JB, bias, out, n);
    for (int64_t j = pairs * JB; j < n; j++) column(x, m, k, w, j, bias, out, n);
}
