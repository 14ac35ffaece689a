/* out = x @ w^T (+ bias) with w's GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) repacked in
 * groups of 16 output rows (quant_layout.h); the portable and the AVX2 path, and the driver.
 *
 * Where it sits: kvfleet/engine/kernels/native/quant_gemm.py calls quant_linear through ctypes for
 * every linear of a model served with --quantization gguf, with the path it chose once from
 * native/cpu_features.py and quant_paths(): 2 AVX-512 VNNI (quant_vnni.c), 1 AVX2, 0 portable.
 *
 * How: x's rows are quantised once per call to int8 in blocks of 32 (llama.cpp's Q8_0/Q8_1
 * activations: dx = amax / 127, q = round(x / dx), and dx times the sum of q per 16, Q8_1's s),
 * then every group of 16 weight rows passes over the activation rows MB at a time. Per 32-value
 * sub-block a chunk (4 values of 8 or 16 rows) is unpacked once and dotted with the broadcast 4
 * activation bytes of each of the MB rows: int32 lane i is row i's dot. Then per sub-block, in float:
 *   out[r][i] += dx * a_i * dot_i + b_i * dx * sum(q)   (Q6_K: per half of 16, its own a).
 *
 * Invariant: every path computes out[r][j] = bias[j] + sum over sub-blocks of the same integer
 * dots with gguf's (a, b); they differ only in float rounding order. Each (r, j) is written by
 * one thread; threads own whole groups.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "quant_layout.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QG_AVX2 1
#else
#define QG_AVX2 0
#endif
#define MB 4 /* activation rows per pass over a group */

int quant_vnni_built(void);
void quant_group_vnni(int t, const Act *a, int64_t m, const uint8_t *gp, int64_t j0, int64_t n, const float *bias,
                      float *out);

/* x's rows quantised in blocks of 32: dx = amax / 127, q = round(x / dx), dx * (sum of q) per 16. */
static void quantize_rows(const float *x, int64_t m, int64_t k, Act *a, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && m * k > 65536)
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < k / 32; b++) {
            const float *v = x + r * k + b * 32;
            float amax = 0.0f;
            for (int l = 0; l < 32; l++) amax = fmaxf(amax, fabsf(v[l]));
            const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            int8_t *q = a->q + r * k + b * 32;
            int s0 = 0, s1 = 0;
            for (int l = 0; l < 32; l++) {
                q[l] = (int8_t)lrintf(v[l] * id);
                if (l < 16) s0 += q[l]; else s1 += q[l];
            }
            a->d[r * (k / 32) + b] = d;
            a->ds[r * (k / 16) + 2 * b] = d * (float)s0;
            a->ds[r * (k / 16) + 2 * b + 1] = d * (float)s1;
            a->sq[r * (k / 32) + b] = s0 + s1;
        }
    }
}

/* Portable: all rows of x against the group at gp (its rows j0.. below n). */
static void group_c(int t, const Act *a, int64_t m, const uint8_t *gp, int64_t j0, int64_t n, const float *bias,
                    float *out) {
    const int subs = qk_of(t) / 32, rows = n - j0 < QG ? (int)(n - j0) : QG;
    const int64_t k = a->k, nsb = k / qk_of(t);
    float ab[4];
    for (int64_t r = 0; r < m; r++) {
        for (int i = 0; i < rows; i++) {
            float acc = 0.0f;
            for (int64_t sb = 0; sb < nsb; sb++) {
                const uint8_t *base = gp + sb * sb_bytes(t);
                for (int s = 0; s < subs; s++) {
                    const int64_t kb = sb * subs + s;
                    const int8_t *xq = a->q + r * k + 32 * kb;
                    const uint8_t *D = base + hdr_bytes(t) + s * sub_bytes(t);
                    int32_t s0 = 0, s1 = 0;
                    for (int e = 0; e < 16; e++) s0 += packed_q(t, D, i, e) * xq[e];
                    for (int e = 16; e < 32; e++) s1 += packed_q(t, D, i, e) * xq[e];
                    row_params(t, base, s, i, ab);
                    const float dx = a->d[r * (k / 32) + kb], *ds = a->ds + r * (k / 16) + 2 * kb;
                    acc += dx * (ab[0] * (float)s0 + ab[1] * (float)s1) + ab[2] * ds[0] + ab[3] * ds[1];
                }
            }
            out[r * n + j0 + i] = acc + (bias ? bias[j0 + i] : 0.0f);
        }
    }
}

#if QG_AVX2
#define LD(p) _mm256_loadu_si256((const __m256i *)(p))
/* Chunk c of 8 rows (half h of the group) as 32 bytes: row i's 4 values at 4i. */
static inline __attribute__((always_inline)) __m256i chunk_avx2(int t, const uint8_t *D, int c, int h) {
    if (t == T_Q8_0) return LD(D + 64 * c + 32 * h);
    const __m256i low4 = _mm256_set1_epi8(15), v = LD(D + 64 * (c % 4) + 32 * h);
    __m256i q = _mm256_and_si256(c < 4 ? v : _mm256_srli_epi16(v, 4), low4);
    if (t == T_Q5_K) {
        const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(LD(D + 256 + 32 * h), c), _mm256_set1_epi8(1));
        q = _mm256_or_si256(q, _mm256_slli_epi16(hb, 4));
    } else if (t == T_Q6_K) {
        const __m256i hv = LD(D + 256 + 64 * (c / 4) + 32 * h);
        const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * (c % 4)), _mm256_set1_epi8(3));
        q = _mm256_or_si256(q, _mm256_slli_epi16(hb, 4));
    }
    return q;
}

static inline __m256 bytes_ps(const uint8_t *p, int is_signed) {
    const __m128i v = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}

/* (a0, a1, b0, b1) of the 8 rows of half h, sub-block s: w = a * q + b (a1, b1: Q6_K's second half). */
static inline __attribute__((always_inline)) void params_avx2(int t, const uint8_t *base, int s, int h, __m256 *p) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(base + 16 * h)));
    if (t == T_Q8_0 || t == T_Q4_0 || t == T_Q4_1) {
        p[0] = p[1] = d;
        p[2] = t == T_Q4_1   ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(base + 32 + 16 * h)))
               : t == T_Q4_0 ? _mm256_mul_ps(d, _mm256_set1_ps(-8.0f))
                             : _mm256_setzero_ps();
    } else if (t == T_Q6_K) {
        p[0] = _mm256_mul_ps(d, bytes_ps(base + 32 + 16 * (2 * s) + 8 * h, 1));
        p[1] = _mm256_mul_ps(d, bytes_ps(base + 32 + 16 * (2 * s + 1) + 8 * h, 1));
        p[2] = _mm256_mul_ps(p[0], _mm256_set1_ps(-32.0f));
        p[3] = _mm256_mul_ps(p[1], _mm256_set1_ps(-32.0f));
    } else {
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(base + 32 + 16 * h)));
        p[0] = p[1] = _mm256_mul_ps(d, bytes_ps(base + 64 + 16 * s + 8 * h, 0));
        p[2] = _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), dmin), bytes_ps(base + 192 + 16 * s + 8 * h, 0));
    }
}

/* Activation rows [r0, r0 + mb) against half h of the group: res (mb x 8). */
static inline __attribute__((always_inline)) void rows_avx2(int t, const Act *a, int64_t r0, int mb,
                                                            const uint8_t *gp, int h, float *res) {
    const int subs = qk_of(t) / 32;
    const int64_t k = a->k, nsb = k / qk_of(t);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MB], p[4];
    for (int r = 0; r < mb; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *base = gp + sb * sb_bytes(t);
        for (int s = 0; s < subs; s++) {
            const int64_t kb = sb * subs + s;
            const uint8_t *D = base + hdr_bytes(t) + s * sub_bytes(t);
            /* maddubs' int16 pairs are summed over `span` chunks before one madd: 4-bit values
             * reach 8 * 2 * 15 * 127 = 30480, Q5_K 4 * 2 * 31 * 127, Q6_K 2 * 2 * 63 * 127 < 2^15 */
            const int span = t == T_Q8_0 ? 1 : t == T_Q6_K ? 2 : t == T_Q5_K ? 4 : 8;
            __m256i lo[MB], hi[MB], p16[MB];
            for (int r = 0; r < mb; r++) lo[r] = hi[r] = p16[r] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i w = chunk_avx2(t, D, c, h), wa = t == T_Q8_0 ? _mm256_sign_epi8(w, w) : w;
                for (int r = 0; r < mb; r++) {
                    int32_t xv;
                    memcpy(&xv, a->q + (r0 + r) * k + 32 * kb + 4 * c, 4);
                    __m256i x = _mm256_set1_epi32(xv);
                    if (t == T_Q8_0) x = _mm256_sign_epi8(x, w); /* |w| * x sign(w) = w * x */
                    p16[r] = _mm256_add_epi16(p16[r], _mm256_maddubs_epi16(wa, x));
                    if ((c + 1) % span) continue;
                    const __m256i dot = _mm256_madd_epi16(p16[r], ones);
                    p16[r] = _mm256_setzero_si256();
                    if (t == T_Q6_K && c >= 4) hi[r] = _mm256_add_epi32(hi[r], dot);
                    else lo[r] = _mm256_add_epi32(lo[r], dot);
                }
            }
            params_avx2(t, base, s, h, p);
            for (int r = 0; r < mb; r++) {
                const __m256 dx = _mm256_set1_ps(a->d[(r0 + r) * (k / 32) + kb]);
                const float *ds = a->ds + (r0 + r) * (k / 16) + 2 * kb;
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[r]), _mm256_mul_ps(p[0], dx), acc[r]);
                if (t == T_Q6_K) {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[r]), _mm256_mul_ps(p[1], dx), acc[r]);
                    acc[r] = _mm256_fmadd_ps(p[2], _mm256_set1_ps(ds[0]), acc[r]);
                    acc[r] = _mm256_fmadd_ps(p[3], _mm256_set1_ps(ds[1]), acc[r]);
                } else if (t != T_Q8_0) {
                    acc[r] = _mm256_fmadd_ps(p[2], _mm256_set1_ps(ds[0] + ds[1]), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < mb; r++) _mm256_storeu_ps(res + 8 * r, acc[r]);
}

#define GROUP_AVX2(NAME, TY)                                                                                  \
    static void NAME(const Act *a, int64_t m, const uint8_t *gp, int64_t j0, int64_t n, const float *bias,  \
                     float *out) {                                                                          \
        float res[MB * 8];                                                                                  \
        for (int h = 0; h < 2 && j0 + 8 * h < n; h++) {                                                     \
            const int64_t jb = j0 + 8 * h;                                                                  \
            const int rows = n - jb < 8 ? (int)(n - jb) : 8;                                                \
            for (int64_t r0 = 0; r0 < m; r0 += MB) {                                                        \
                const int mb = m - r0 < MB ? (int)(m - r0) : MB;                                            \
                switch (mb) {                                                                               \
                case 1: rows_avx2(TY, a, r0, 1, gp, h, res); break;                                         \
                case 2: rows_avx2(TY, a, r0, 2, gp, h, res); break;                                         \
                case 3: rows_avx2(TY, a, r0, 3, gp, h, res); break;                                         \
                default: rows_avx2(TY, a, r0, MB, gp, h, res);                                              \
                }                                                                                           \
                for (int r = 0; r < mb; r++)                                                                \
                    for (int i = 0; i < rows; i++)                                                          \
                        out[(r0 + r) * n + jb + i] = res[8 * r + i] + (bias ? bias[jb + i] : 0.0f);         \
            }                                                                                               \
        }                                                                                                   \
    }
GROUP_AVX2(group_q8_0_avx2, T_Q8_0)
GROUP_AVX2(group_q4_0_avx2, T_Q4_0)
GROUP_AVX2(group_q4_1_avx2, T_Q4_1)
GROUP_AVX2(group_q4_k_avx2, T_Q4_K)
GROUP_AVX2(group_q5_k_avx2, T_Q5_K)
GROUP_AVX2(group_q6_k_avx2, T_Q6_K)

static void group_avx2(int t, const Act *a, int64_t m, const uint8_t *gp, int64_t j0, int64_t n, const float *bias,
                       float *out) {
    switch (t) {
    case T_Q8_0: group_q8_0_avx2(a, m, gp, j0, n, bias, out); break;
    case T_Q4_0: group_q4_0_avx2(a, m, gp, j0, n, bias, out); break;
    case T_Q4_1: group_q4_1_avx2(a, m, gp, j0, n, bias, out); break;
    case T_Q4_K: group_q4_k_avx2(a, m, gp, j0, n, bias, out); break;
    case T_Q5_K: group_q5_k_avx2(a, m, gp, j0, n, bias, out); break;
    default: group_q6_k_avx2(a, m, gp, j0, n, bias, out);
    }
}
#endif

/* Bit p set where path p runs here: 1 portable, 2 AVX2 (built and on this CPU), 4 AVX-512 VNNI. */
int quant_paths(void) {
    int paths = 1;
#if QG_AVX2
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) paths |= 2;
#endif
    if (quant_vnni_built()) paths |= 4;
    return paths;
}

typedef void (*group_fn)(int, const Act *, int64_t, const uint8_t *, int64_t, int64_t, const float *, float *);

/* x (m, k) float32 rows; packed: n rows of type t repacked (quant_repack); bias (n,) or NULL; out
 * (m, n); path 0 portable, 1 AVX2, 2 AVX-512 VNNI. Returns 0, or -1 for a type not handled, -2 for
 * k not a whole number of blocks, -3 out of memory, -4 a path this build or CPU does not run. */
int quant_linear(const float *x, int64_t m, int64_t k, const uint8_t *packed, int64_t n, int t, const float *bias,
                 float *out, int num_threads, int path) {
    if (!known_type(t)) return -1;
    if (k % qk_of(t) != 0) return -2;
    if (path < 0 || path > 2 || !(quant_paths() & (1 << path))) return -4;
    group_fn group = group_c;
#if QG_AVX2
    if (path == 1) group = group_avx2;
#endif
    if (path == 2) group = quant_group_vnni;
    if (num_threads < 1) num_threads = 1;
    Act a = {malloc((size_t)(m * k)), malloc((size_t)(m * (k / 32)) * sizeof(float)),
             malloc((size_t)(m * (k / 16)) * sizeof(float)), malloc((size_t)(m * (k / 32)) * sizeof(int32_t)), k};
    int rc = 0;
    if (a.q == NULL || a.d == NULL || a.ds == NULL || a.sq == NULL) {
        rc = -3;
    } else {
        quantize_rows(x, m, k, &a, num_threads);
        const int64_t groups = (n + QG - 1) / QG, gb = group_bytes(t, k);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
        for (int64_t g = 0; g < groups; g++) group(t, &a, m, packed + g * gb, g * QG, n, bias, out);
    }
    free(a.q);
    free(a.d);
    free(a.ds);
    free(a.sq);
    return rc;
}
