/* Fused element-wise ops of the Llama decoder on the CPU: residual add + RMSNorm, and SiLU(gate) * up.
 *
 * Where it sits: kvfleet/engine/kernels/cpu_decode.py compiles this file with paged_decode.c into one
 * library (cc -O3 -march=native -fopenmp); kvfleet/engine/kernels/cpu_fused.py calls these through
 * ctypes from the model's RMSNorm and MLP (engine/model/llama.py) for float32 CPU tensors. In torch
 * each is three to five passes over the activations, each allocating its result; here it is one
 * pass per row, written in place or into one output.
 *
 * Layout (float32, rows contiguous): x and residual (rows, n); weight (n,); gate_up (rows, 2 * m)
 * with the gate in the first m columns of each row and up in the last m (the packed gate/up matmul);
 * out (rows, n) or (rows, m).
 *
 * Invariant: each row is computed alone, from its own inputs only, with the arithmetic of the
 * torch reference (RMSNorm: mean of squares in float32, times rsqrt(mean + eps), times weight;
 * SiLU: x / (1 + e^-x)); only the order of the float32 sum of squares differs, so results agree to
 * a few ulp. Rows are shared among the OpenMP threads when there are enough of them to pay for it.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "fast_exp.h"

/* Below this many floats a call runs on the calling thread: waking the team costs more. */
#define PARALLEL_MIN_FLOATS 32768

/* residual[r] += x[r] (when x is not NULL), then out[r] = weight * residual[r] * rsqrt(mean(residual[r]^2) + eps). */
void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t n,
                      float eps, int num_threads) {
    const int parallel = num_threads > 1 && rows > 1 && rows * n >= PARALLEL_MIN_FLOATS;
#pragma omp parallel for num_threads(num_threads) if (parallel) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *h = residual + r * n;
        float *o = out + r * n;
        float sum = 0.0f;
        if (x != NULL) {
            const float *a = x + r * n;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < n; i++) {
                h[i] += a[i];
                sum += h[i] * h[i];
            }
        } else {
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < n; i++) sum += h[i] * h[i];
        }
        const float inv = 1.0f / sqrtf(sum / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = weight[i] * (h[i] * inv);
    }
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, m + i]. */
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t m, int num_threads) {
    const int parallel = num_threads > 1 && rows > 1 && rows * m >= PARALLEL_MIN_FLOATS;
#pragma omp parallel for num_threads(num_threads) if (parallel) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * m;
        const float *u = g + m;
        float *o = out + r * m;
#pragma omp simd
        for (int64_t i = 0; i < m; i++) o[i] = g[i] / (1.0f + exp_clamped(-g[i])) * u[i];
    }
}

/* Rotary embedding in place on the first `heads` heads of each row (q and k heads side by side in the
 * packed q/k/v output): x[i] = x[i] cos[i] - x[i + D/2] sin[i] and x[i + D/2] = x[i + D/2] cos[i + D/2]
 * + x[i] sin[i + D/2] for i < D/2, transformers' rotate-half layout. cos and sin are (rows, D); row r of
 * x starts at x + r * row_stride. */
void rope_f32(float *x, const float *cos_, const float *sin_, int64_t rows, int64_t row_stride, int heads, int D,
              int num_threads) {
    const int half = D / 2;
    const int parallel = num_threads > 1 && rows > 1 && rows * heads * D >= PARALLEL_MIN_FLOATS;
#pragma omp parallel for num_threads(num_threads) if (parallel) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_ + r * D, *s = sin_ + r * D;
        for (int h = 0; h < heads; h++) {
            float *a = x + r * row_stride + (int64_t)h * D, *b = a + half;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float lo = a[i], hi = b[i];
                a[i] = lo * c[i] - hi * s[i];
                b[i] = hi * c[half + i] + lo * s[half + i];
            }
        }
    }
}
