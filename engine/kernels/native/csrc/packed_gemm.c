/* out = x @ w^T (+ bias) over a weight packed once at load into column panels: the float32 GEMM
 * of decode batches past the few-row kernel, and of prefill chunks.
 *
 * Where it sits: kvfleet/engine/kernels/native_packed.py packs each linear's (n, k) weight with
 * pack_weight_f32 at load and calls packed_linear_f32 through ctypes from cpu_linear.linear
 * (engine/model/llama.py's q/k/v, o, gate/up, down and the LM head).
 *
 * Why: on an AMD EPYC (Zen 2, AVX2) MKL runs a generic path and oneDNN's JIT kernel reached
 * about 100-150 GFLOP/s at 32-64 rows, where the FMA units allow 215. The layout here is the
 * GotoBLAS one: a panel holds NR = 2 vectors of output columns for every k, so the micro-kernel
 * keeps an MR x NR block of out in registers (MR * 2 accumulators, 2 weight vectors and a
 * broadcast: 15 of AVX2's 16 registers) and does MR * 2 FMAs per 2 vector loads.
 *
 * Invariant: out[r][j] = bias[j] + sum over i in order 0..k-1 of x[r][i] * w[j][i], accumulated
 * in float32 one FMA at a time (so any row count gives the same bits for a row); every (r, j)
 * is written by exactly one thread, once.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define LANES 8           /* floats per vector: one AVX2 register (AVX-512 machines use two) */
#define NR (2 * LANES)    /* output columns per panel */
#define MR 6              /* rows of x per micro-kernel call */
#define L2_ROWS_BYTES (160 * 1024) /* the block of x rows kept in L2 while every panel passes */
/* The first row block streams the panel from memory: it asks for the line this many floats ahead
 * into L2 (prefetcht2). SmolLM2's linears, weights streamed, 2 threads: 32 rows 65.1 -> 58.5 ms a
 * pass, 256 rows 410 -> 390; a whole next panel ahead, or into L1, gained less or lost. */
#define PREFETCH_FLOATS 256

typedef float vf __attribute__((vector_size(LANES * sizeof(float)), aligned(4), may_alias));

static inline vf load(const float *p) { return *(const vf *)p; }
static inline void store(float *p, vf v) { *(vf *)p = v; }

/* Floats in the packed copy of an (n, k) weight: n rounded up to whole panels. */
int64_t packed_size_f32(int64_t n, int64_t k) { return (n + NR - 1) / NR * NR * k; }

/* wp[p][i][c] = w[p * NR + c][i], zero past n. */
void pack_weight_f32(const float *w, int64_t n, int64_t k, float *wp) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = wp + p * k * NR;
        for (int64_t i = 0; i < k; i++)
            for (int c = 0; c < NR; c++) {
                const int64_t j = p * NR + c;
                dst[i * NR + c] = j < n ? w[j * k + i] : 0.0f;
            }
    }
}

/* out[r][0..cols) for r in [0, mr): mr a compile-time constant after inlining. */
static inline __attribute__((always_inline)) void micro(const float *restrict x, int mr, int64_t k,
                                                        const float *restrict panel, int stream,
                                                        const float *restrict bias, float *restrict out,
                                                        int64_t ldo, int cols) {
    vf a0[MR], a1[MR];
    for (int r = 0; r < mr; r++) a0[r] = a1[r] = (vf){0};
    for (int64_t i = 0; i < k; i++) {
        const vf w0 = load(panel + i * NR), w1 = load(panel + i * NR + LANES);
        if (stream) __builtin_prefetch(panel + i * NR + PREFETCH_FLOATS, 0, 1);
        for (int r = 0; r < mr; r++) {
            const float s = x[r * k + i];
            a0[r] += s * w0;
            a1[r] += s * w1;
        }
    }
    vf b0 = (vf){0}, b1 = (vf){0};
    if (bias != NULL) {
        float tmp[NR] = {0};
        memcpy(tmp, bias, (size_t)cols * sizeof(float));
        b0 = load(tmp);
        b1 = load(tmp + LANES);
    }
    for (int r = 0; r < mr; r++) {
        const vf o0 = a0[r] + b0, o1 = a1[r] + b1;
        if (cols == NR) {
            store(out + r * ldo, o0);
            store(out + r * ldo + LANES, o1);
        } else {
            float tmp[NR];
            store(tmp, o0);
            store(tmp + LANES, o1);
            memcpy(out + r * ldo, tmp, (size_t)cols * sizeof(float));
        }
    }
}

/* Rows [0, m) of x against one panel: MR at a time, then the remainder. */
static void rows_panel(const float *x, int64_t m, int64_t k, const float *panel, const float *bias,
                       float *out, int64_t ldo, int cols) {
    int64_t r0 = 0;
    for (; r0 + MR <= m; r0 += MR) micro(x + r0 * k, MR, k, panel, r0 == 0, bias, out + r0 * ldo, ldo, cols);
    const int stream = r0 == 0;
    const float *xr = x + r0 * k;
    float *o = out + r0 * ldo;
    switch (m - r0) { /* each case is micro() specialised for that many rows */
    case 5: micro(xr, 5, k, panel, stream, bias, o, ldo, cols); break;
    case 4: micro(xr, 4, k, panel, stream, bias, o, ldo, cols); break;
    case 3: micro(xr, 3, k, panel, stream, bias, o, ldo, cols); break;
    case 2: micro(xr, 2, k, panel, stream, bias, o, ldo, cols); break;
    case 1: micro(xr, 1, k, panel, stream, bias, o, ldo, cols); break;
    default: break;
    }
}

/* x (m, k) rows contiguous; wp from pack_weight_f32; bias (n,) or NULL; out (m, n) rows contiguous. */
void packed_linear_f32(const float *x, int64_t m, int64_t k, const float *wp, int64_t n, const float *bias,
                       float *out, int num_threads) {
    if (num_threads < 1) num_threads = 1;
    const int64_t panels = (n + NR - 1) / NR;
    int64_t mc = L2_ROWS_BYTES / (k * (int64_t)sizeof(float)) / MR * MR;
    if (mc < MR) mc = MR;
    /* Rows in blocks that stay in L2; each thread keeps the same run of panels for every block. */
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    for (int64_t m0 = 0; m0 < m; m0 += mc) {
        const int64_t rows = m - m0 < mc ? m - m0 : mc;
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < panels; p++) {
            const int64_t j0 = p * NR;
            const int cols = n - j0 < NR ? (int)(n - j0) : NR;
            rows_panel(x + m0 * k, rows, k, wp + p * k * NR, bias != NULL ? bias + j0 : NULL,
                       out + m0 * n + j0, n, cols);
        }
    }
}
