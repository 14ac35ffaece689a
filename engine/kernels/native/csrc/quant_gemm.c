/* out = x @ w^T (+ bias) with w kept in its GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K).
 *
 * Where it sits: kvfleet/engine/kernels/native/quant_gemm.py calls quant_linear through ctypes
 * for every linear of a model served with --quantization gguf (engine/model/quant_loader.py);
 * w is the tensor's raw bytes as the .gguf file stores them: n rows, each k / QK blocks of the
 * ggml layout (ggml-common.h), so a row is a whole number of blocks.
 *
 * How: x's rows are quantised first to int8 in blocks of 32 (as llama.cpp's Q8_0/Q8_K for the
 * activations): per block a float scale dx = amax / 127, q = round(x / dx), and dx times the sum
 * of q over each half of 16 (s_0, s_1 below). Every weight format is then read as 32-element sub-blocks of small
 * unsigned ints (signed for Q8_0) with an affine map per half of 16: w = a_g * q + b_g. One
 * sub-block against one activation block is an integer dot (AVX2: maddubs + madd, 32 products
 * in two instructions) and a float fused multiply-add:
 *   dot = dx * (a_0 * sum_{0..15} q*qx + a_1 * sum_{16..31} q*qx) + b_0 * s_0 + b_1 * s_1.
 *
 * Invariant: out[r][j] = bias[j] + sum over the 32-blocks of row j of that dot with x's row r,
 * where q and (a, b) are exactly gguf.quants.dequantize's values; the portable and the AVX2 path
 * compute the same integer dots and differ only in float rounding order. Each (r, j) is written
 * by one thread; threads own contiguous tiles of w's rows (one sequential stream each).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define QG_AVX2 1
#else
#define QG_AVX2 0
#endif

/* ggml type ids (gguf GGMLQuantizationType) */
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };
#define MB 4  /* rows of x per weight block unpacked: each sub-block is dotted with MB rows */
#define JT 16 /* rows of w per tile: the tile stays in cache while all rows of x pass over it */

typedef struct { /* x's rows quantised: q (m, k), d (m, k/32), ds (m, k/16): d * (sum of q per 16) */
    int8_t *q;
    float *d;
    float *ds;
    int64_t k;
} Act;

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
    uint32_t bits;
    if (e == 0) { /* zero or subnormal: m * 2^-24 */
        float f = (float)m * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (e == 31) {
        bits = sign | 0x7f800000u | (m << 13);
    } else {
        bits = sign | ((e + 112) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline int qk_of(int t) { return t >= T_Q4_K ? 256 : 32; }
static inline int64_t block_bytes(int t) {
    switch (t) {
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

/* Q4_K/Q5_K's 6-bit scale and min of sub-block j (ggml's get_scale_min_k4). */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* The affine map (a_0, a_1, b_0, b_1) of sub-block s of block blk: w = a_g * q + b_g. */
static inline __attribute__((always_inline)) void sub_params(int t, const uint8_t *blk, int s, float *ab) {
    if (t == T_Q8_0 || t == T_Q4_0 || t == T_Q4_1) {
        const float d = h2f(blk);
        const float b = t == T_Q4_1 ? h2f(blk + 2) : t == T_Q4_0 ? -8.0f * d : 0.0f;
        ab[0] = ab[1] = d;
        ab[2] = ab[3] = b;
    } else if (t == T_Q4_K || t == T_Q5_K) {
        int sc, mn;
        scale_min_k4(s, blk + 4, &sc, &mn);
        const float a = h2f(blk) * (float)sc, b = -h2f(blk + 2) * (float)mn;
        ab[0] = ab[1] = a;
        ab[2] = ab[3] = b;
    } else { /* Q6_K: ql[128] qh[64] scales[16] d; int8 scale per 16, q - 32 */
        const float d = h2f(blk + 208);
        const int8_t *sc = (const int8_t *)(blk + 192) + 8 * (s / 4) + 2 * (s % 4);
        ab[0] = d * (float)sc[0];
        ab[1] = d * (float)sc[1];
        ab[2] = -32.0f * ab[0];
        ab[3] = -32.0f * ab[1];
    }
}

/* Portable: the 32 ints q of sub-block s (unsigned 0..63, or Q8_0's signed bytes). */
static inline __attribute__((always_inline)) void sub_q_c(int t, const uint8_t *blk, int s, int *q) {
    if (t == T_Q8_0) {
        for (int l = 0; l < 32; l++) q[l] = ((const int8_t *)(blk + 2))[l];
    } else if (t == T_Q4_0 || t == T_Q4_1) {
        const uint8_t *qs = blk + (t == T_Q4_0 ? 2 : 4);
        for (int l = 0; l < 16; l++) {
            q[l] = qs[l] & 0xF;
            q[l + 16] = qs[l] >> 4;
        }
    } else if (t == T_Q4_K || t == T_Q5_K) {
        const uint8_t *qs = blk + (t == T_Q4_K ? 16 : 48) + 32 * (s / 2), *qh = blk + 16;
        for (int l = 0; l < 32; l++) {
            q[l] = (s & 1) ? qs[l] >> 4 : qs[l] & 0xF;
            if (t == T_Q5_K) q[l] |= ((qh[l] >> s) & 1) << 4;
        }
    } else {
        const int h = s / 4, u = s % 4;
        const uint8_t *ql = blk + 64 * h + 32 * (u & 1), *qh = blk + 128 + 32 * h;
        for (int l = 0; l < 32; l++)
            q[l] = ((u >= 2 ? ql[l] >> 4 : ql[l] & 0xF) | (((qh[l] >> (2 * u)) & 3) << 4));
    }
}

/* Portable: rows [r0, r0 + mb) of x against w's row wrow (nb32 sub-blocks), into res. */
__attribute__((always_inline)) static inline void dot_rows_c(int t, const uint8_t *wrow, int64_t nb32, const Act *x, int64_t r0, int mb, float *res) {
    const int subs = qk_of(t) / 32;
    const int64_t bb = block_bytes(t);
    for (int r = 0; r < mb; r++) res[r] = 0.0f;
    int q[32];
    float ab[4];
    for (int64_t kb = 0; kb < nb32; kb++) {
        const uint8_t *blk = wrow + (kb / subs) * bb;
        const int s = (int)(kb % subs);
        sub_q_c(t, blk, s, q);
        sub_params(t, blk, s, ab);
        for (int r = 0; r < mb; r++) {
            const int8_t *xq = x->q + (r0 + r) * x->k + kb * 32;
            const float *ds = x->ds + (r0 + r) * (x->k / 16) + 2 * kb;
            int32_t s0 = 0, s1 = 0;
            for (int l = 0; l < 16; l++) s0 += q[l] * xq[l];
            for (int l = 16; l < 32; l++) s1 += q[l] * xq[l];
            const float dx = x->d[(r0 + r) * (x->k / 32) + kb];
            res[r] += dx * (ab[0] * (float)s0 + ab[1] * (float)s1) + ab[2] * ds[0] + ab[3] * ds[1];
        }
    }
}

#if QG_AVX2
/* AVX2: the 32 q of sub-block s as bytes in element order. */
__attribute__((always_inline)) static inline __m256i sub_q_avx2(int t, const uint8_t *blk, int s) {
    const __m256i low4 = _mm256_set1_epi8(0xF);
    if (t == T_Q8_0) return _mm256_loadu_si256((const __m256i *)(blk + 2));
    if (t == T_Q4_0 || t == T_Q4_1) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(blk + (t == T_Q4_0 ? 2 : 4)));
        const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0xF));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0xF));
        return _mm256_set_m128i(hi, lo);
    }
    if (t == T_Q4_K || t == T_Q5_K) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + (t == T_Q4_K ? 16 : 48) + 32 * (s / 2)));
        __m256i q = (s & 1) ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low4) : _mm256_and_si256(v, low4);
        if (t == T_Q5_K) {
            const __m256i bit = _mm256_set1_epi8((char)(1 << s));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
            const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
            q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
        }
        return q;
    }
    const int h = s / 4, u = s % 4;
    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (u & 1)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    const __m256i lo = u >= 2 ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low4) : _mm256_and_si256(v, low4);
    const __m256i hi2 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * u), _mm256_set1_epi8(3));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi2, 4));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

__attribute__((always_inline)) static inline void dot_rows_avx2(int t, const uint8_t *wrow, int64_t nb32,
                                                                const Act *x, int64_t r0, int mb, float *res) {
    const int subs = qk_of(t) / 32;
    const int64_t bb = block_bytes(t), ks = x->k / 16, kd = x->k / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MB];
    float off[MB];
    for (int r = 0; r < mb; r++) {
        acc[r] = _mm256_setzero_ps();
        off[r] = 0.0f;
    }
    float ab[4];
    for (int64_t kb = 0; kb < nb32; kb++) {
        const uint8_t *blk = wrow + (kb / subs) * bb;
        const int s = (int)(kb % subs);
        __m256i q = sub_q_avx2(t, blk, s);
        sub_params(t, blk, s, ab);
        const __m256 ws = _mm256_setr_m128(_mm_set1_ps(ab[0]), _mm_set1_ps(ab[1]));
        const __m256i qa = t == T_Q8_0 ? _mm256_sign_epi8(q, q) : q; /* |q| for the signed trick */
        for (int r = 0; r < mb; r++) {
            __m256i xq = _mm256_loadu_si256((const __m256i *)(x->q + (r0 + r) * x->k + kb * 32));
            if (t == T_Q8_0) xq = _mm256_sign_epi8(xq, q); /* x * sign(q): |q| * that = q * x */
            const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(qa, xq), ones);
            const float dx = x->d[(r0 + r) * kd + kb];
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws, _mm256_set1_ps(dx)), acc[r]);
            if (t != T_Q8_0) {
                const float *ds = x->ds + (r0 + r) * ks + 2 * kb;
                off[r] += ab[2] * ds[0] + ab[3] * ds[1];
            }
        }
    }
    for (int r = 0; r < mb; r++) res[r] = hsum8(acc[r]) + off[r];
}
#endif

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
        }
    }
}

/* Every row of x against w's rows of one tile [j0, j1): MB rows of x per unpacked weight block. */
#define TILE(NAME, DOT, TY)                                                                              \
    static void NAME(const Act *a, int64_t m, const uint8_t *w, int64_t row_bytes, int64_t nb32,       \
                     int64_t j0, int64_t j1, const float *bias, float *out, int64_t n) {              \
        float res[MB];                                                                                  \
        for (int64_t r0 = 0; r0 < m; r0 += MB) {                                                        \
            const int mb = m - r0 < MB ? (int)(m - r0) : MB;                                            \
            for (int64_t j = j0; j < j1; j++) {                                                         \
                if (mb == MB)                                                                           \
                    DOT(TY, w + j * row_bytes, nb32, a, r0, MB, res);                                   \
                else                                                                                    \
                    DOT(TY, w + j * row_bytes, nb32, a, r0, mb, res);                                   \
                for (int r = 0; r < mb; r++) out[(r0 + r) * n + j] = res[r] + (bias ? bias[j] : 0.0f);  \
            }                                                                                           \
        }                                                                                               \
    }
#define FORMATS(DOT, SUFFIX)                                                                             \
    TILE(tile_q8_0_##SUFFIX, DOT, T_Q8_0)                                                                \
    TILE(tile_q4_0_##SUFFIX, DOT, T_Q4_0)                                                                \
    TILE(tile_q4_1_##SUFFIX, DOT, T_Q4_1)                                                                \
    TILE(tile_q4_k_##SUFFIX, DOT, T_Q4_K)                                                                \
    TILE(tile_q5_k_##SUFFIX, DOT, T_Q5_K)                                                                \
    TILE(tile_q6_k_##SUFFIX, DOT, T_Q6_K)
FORMATS(dot_rows_c, c)
#if QG_AVX2
FORMATS(dot_rows_avx2, avx2)
#endif

typedef void (*tile_fn)(const Act *, int64_t, const uint8_t *, int64_t, int64_t, int64_t, int64_t, const float *,
                        float *, int64_t);

static tile_fn pick_tile(int t, int portable) {
#if QG_AVX2
    if (!portable) {
        switch (t) {
        case T_Q8_0: return tile_q8_0_avx2;
        case T_Q4_0: return tile_q4_0_avx2;
        case T_Q4_1: return tile_q4_1_avx2;
        case T_Q4_K: return tile_q4_k_avx2;
        case T_Q5_K: return tile_q5_k_avx2;
        case T_Q6_K: return tile_q6_k_avx2;
        default: return NULL;
        }
    }
#endif
    (void)portable;
    switch (t) {
    case T_Q8_0: return tile_q8_0_c;
    case T_Q4_0: return tile_q4_0_c;
    case T_Q4_1: return tile_q4_1_c;
    case T_Q4_K: return tile_q4_k_c;
    case T_Q5_K: return tile_q5_k_c;
    case T_Q6_K: return tile_q6_k_c;
    default: return NULL;
    }
}

/* 1 where this build has the AVX2 path (quant_linear's portable=0 runs it). */
int quant_has_avx2(void) { return QG_AVX2; }

/* x (m, k) float32 rows; w n rows of k / QK blocks of type t; bias (n,) or NULL; out (m, n).
 * Returns 0, or -1 for a type not handled, -2 for k not a whole number of blocks, -3 out of memory. */
int quant_linear(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, int t, const float *bias,
                 float *out, int num_threads, int portable) {
    const tile_fn tile = pick_tile(t, portable);
    if (tile == NULL) return -1;
    if (k % qk_of(t) != 0) return -2;
    if (num_threads < 1) num_threads = 1;
    Act a = {malloc((size_t)(m * k)), malloc((size_t)(m * (k / 32)) * sizeof(float)),
             malloc((size_t)(m * (k / 16)) * sizeof(float)), k};
    int rc = 0;
    if (a.q == NULL || a.d == NULL || a.ds == NULL) {
        rc = -3;
    } else {
        quantize_rows(x, m, k, &a, num_threads);
        const int64_t row_bytes = k / qk_of(t) * block_bytes(t), tiles = (n + JT - 1) / JT;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
        for (int64_t p = 0; p < tiles; p++) {
            const int64_t j1 = (p + 1) * JT < n ? (p + 1) * JT : n;
            tile(&a, m, w, row_bytes, k / 32, p * JT, j1, bias, out, n);
        }
    }
    free(a.q);
    free(a.d);
    free(a.ds);
    return rc;
}
