/* out = x @ (scale * w)^T (+ bias): per-output-channel int8 weights, per-token int8 activations.
 *
 * Where it sits: kvfleet/engine/kernels/native/int8_gemm.py calls int8_linear through ctypes for
 * every linear of a model served with --quantization int8 (engine/model/int8_loader.py): w is
 * (n, k) int8, row j's real values scale[j] * w[j][:] (symmetric, scale = amax / 127 per row).
 *
 * How: each row r of x is quantised with its own scale dx_r = amax_r / 127, qx = round(x / dx_r)
 * (dynamic per token, as vLLM's W8A8); then out[r][j] = dx_r * scale[j] * sum_k qx[r][k] w[j][k]
 * + bias[j]: one exact int32 dot per (r, j) (AVX2: |w| maddubs (x * sign(w)) then madd into int32;
 * 2 * 127 * 127 fits the int16 pair sum and k * 127^2 an int32 up to k = 133 000) and one float
 * multiply. A per-channel format needs its own kernel rather than quant_gemm.c's Q8_0 blocks: a
 * Q8_0 row carries an f16 scale per 32 values (34 bytes per 32: 6% more than 1 byte per weight,
 * and an f16 scale underflows for tiny rows), while here a row is k bytes and one float.
 *
 * Paths: 0 portable C, 1 AVX2 (above), 2 AVX-512 VNNI (int8_vnni.c: dpbusd on the weights made
 * unsigned in register, 128 x each activation row's byte sum taken off exactly; one activation row
 * runs 16 weight rows a pass), chosen once by int8_gemm.py.
 *
 * Invariant: every path computes the same integer dots; the results differ only in the order of
 * two float multiplies. Each (r, j) is written by one thread; threads own tiles of
 * JT rows of w, which stay in cache while every MB rows of x pass over them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__)
#include <immintrin.h>
#define I8_AVX2 1
#else
#define I8_AVX2 0
#endif

#define MB 4
#define JT 16

void int8_dots_vnni(const int8_t *w, int nj, const int8_t *q, const int32_t *qsum, int64_t k, int mb,
                    int32_t *d);
void int8_row16_vnni(const int8_t *w, int nj, const int8_t *q, int32_t qsum, int64_t k, int32_t *d);
int int8_vnni_built(void);

static int32_t dot_c(const int8_t *a, const int8_t *b, int64_t k) {
    int32_t s = 0;
    for (int64_t l = 0; l < k; l++) s += (int32_t)a[l] * (int32_t)b[l];
    return s;
}

#if I8_AVX2
static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* mb rows of qx (stride k) against one row of w: int32 dots into d. */
static inline void dots_avx2(const int8_t *w, const int8_t *qx, int64_t k, int mb, int32_t *d) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[MB];
    for (int r = 0; r < mb; r++) acc[r] = _mm256_setzero_si256();
    const int64_t k32 = k & ~(int64_t)31;
    for (int64_t l = 0; l < k32; l += 32) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + l));
        const __m256i wa = _mm256_sign_epi8(wv, wv);
        for (int r = 0; r < mb; r++) {
            const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(qx + r * k + l)), wv);
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xv), ones));
        }
    }
    for (int r = 0; r < mb; r++) d[r] = hsum_i32(acc[r]) + dot_c(w + k32, qx + r * k + k32, k - k32);
}
#endif

/* Each row of x to int8 with its own scale: dx = amax / 127, q = round(x / dx). */
static void quantize_tokens(const float *x, int64_t m, int64_t k, int8_t *q, float *dx, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && m * k > 65536)
    for (int64_t r = 0; r < m; r++) {
        const float *v = x + r * k;
        float amax = 0.0f;
        for (int64_t l = 0; l < k; l++) amax = fmaxf(amax, fabsf(v[l]));
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int64_t l = 0; l < k; l++) q[r * k + l] = (int8_t)lrintf(v[l] * id);
        dx[r] = d;
    }
}

/* q: the activations' int8; qsum: each row's byte sum (the VNNI path's, else NULL). */
static void tile(const int8_t *q, const int32_t *qsum, const float *dx, int64_t m, int64_t k, const int8_t *w,
                 const float *scale, const float *bias, float *out, int64_t n, int64_t j0, int64_t j1, int path) {
    int32_t d[MB], dv[4 * MB], d16[16];
    for (int64_t r0 = 0; r0 < m; r0 += MB) {
        const int mb = m - r0 < MB ? (int)(m - r0) : MB;
        if (path == 2 && mb == 1) { /* one activation row: 16 weight rows per pass, summed across at once */
            for (int64_t j = j0; j < j1; j += 16) {
                const int nj = j1 - j < 16 ? (int)(j1 - j) : 16;
                int8_row16_vnni(w + j * k, nj, q + r0 * k, qsum[r0], k, d16);
                for (int i = 0; i < nj; i++)
                    out[r0 * n + j + i] = (float)d16[i] * (dx[r0] * scale[j + i]) + (bias ? bias[j + i] : 0.0f);
            }
            continue;
        }
        if (path == 2) { /* 4 weight rows at a time: each chunk loaded once for 16 dots */
            for (int64_t j = j0; j < j1; j += 4) {
                const int nj = j1 - j < 4 ? (int)(j1 - j) : 4;
                int8_dots_vnni(w + j * k, nj, q + r0 * k, qsum + r0, k, mb, dv);
                for (int i = 0; i < nj; i++)
                    for (int r = 0; r < mb; r++)
                        out[(r0 + r) * n + j + i] =
                            (float)dv[i * MB + r] * (dx[r0 + r] * scale[j + i]) + (bias ? bias[j + i] : 0.0f);
            }
            continue;
        }
        for (int64_t j = j0; j < j1; j++) {
#if I8_AVX2
            if (path == 1)
                dots_avx2(w + j * k, q + r0 * k, k, mb, d);
            else
#endif
                for (int r = 0; r < mb; r++) d[r] = dot_c(w + j * k, q + (r0 + r) * k, k);
            for (int r = 0; r < mb; r++)
                out[(r0 + r) * n + j] = (float)d[r] * (dx[r0 + r] * scale[j]) + (bias ? bias[j] : 0.0f);
        }
    }
}

/* Bit p set where path p runs here: 1 portable, 2 AVX2 (built and on this CPU), 4 AVX-512 VNNI. */
int int8_paths(void) {
    int paths = 1;
#if I8_AVX2
    if (__builtin_cpu_supports("avx2")) paths |= 2;
#endif
    if (int8_vnni_built()) paths |= 4;
    return paths;
}

/* x (m, k) float32; w (n, k) int8; scale (n,) float32; bias (n,) or NULL; out (m, n); path 0
 * portable, 1 AVX2, 2 AVX-512 VNNI. Returns 0, -3 out of memory, or -4 a path this build or CPU
 * does not run. */
int int8_linear(const float *x, int64_t m, int64_t k, const int8_t *w, int64_t n, const float *scale,
                const float *bias, float *out, int num_threads, int path) {
    if (path < 0 || path > 2 || !(int8_paths() & (1 << path))) return -4;
    if (num_threads < 1) num_threads = 1;
    int8_t *q = malloc((size_t)(m * k) + 1);
    int32_t *qsum = path == 2 ? malloc((size_t)m * sizeof(int32_t) + 1) : NULL;
    float *dx = malloc((size_t)m * sizeof(float) + 1);
    int rc = 0;
    if (q == NULL || dx == NULL || (path == 2 && qsum == NULL)) {
        rc = -3;
    } else {
        quantize_tokens(x, m, k, q, dx, num_threads);
        if (qsum != NULL)
            for (int64_t r = 0; r < m; r++) {
                int32_t sum = 0;
                for (int64_t l = 0; l < k; l++) sum += q[r * k + l];
                qsum[r] = sum;
            }
        const int64_t tiles = (n + JT - 1) / JT;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
        for (int64_t p = 0; p < tiles; p++) {
            const int64_t j1 = (p + 1) * JT < n ? (p + 1) * JT : n;
            tile(q, qsum, dx, m, k, w, scale, bias, out, n, p * JT, j1, path);
        }
    }
    free(q);
    free(qsum);
    free(dx);
    return rc;
}
