/* The AVX-512 VNNI path of quant_gemm.c: a group of 16 repacked weight rows (quant_layout.h) in
 * one zmm per chunk, dotted with _mm512_dpbusd_epi32.
 *
 * Where it sits: quant_linear (quant_gemm.c) calls quant_group_vnni per group when the path chosen
 * by kvfleet/engine/kernels/native/quant_gemm.py is 2. It is compiled on every x86-64 GCC/clang
 * build (the functions carry their own target, so a library built with -march=native on an
 * AVX2-only CPU still holds it) and runs only where quant_vnni_built() says the CPU has
 * AVX-512F/BW/VL and VNNI.
 *
 * How: dpbusd multiplies unsigned by signed bytes, four at a time into each int32 lane: the weight
 * values are the unsigned side (0..63 for the 4/5/6-bit formats), the activations' int8 the signed
 * one. Q8_0's signed weights are offset by +128 (x ^ 0x80), and 128 * (sum of the activations'
 * int8 per 32) is taken off the int32 dot afterwards: exact, as llama.cpp's offset trick.
 */
#include <stdint.h>
#include <string.h>

#include "quant_layout.h"

#if defined(__x86_64__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 9)
#define QV_BUILT 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#include <immintrin.h>

#define VMB 8 /* activation rows per pass over a group: each chunk unpacked once for 8 */
#define LD(p) _mm512_loadu_si512((const void *)(p))

static inline __attribute__((always_inline)) __m512i chunk_vnni(int t, const uint8_t *D, int c) {
    if (t == T_Q8_0) return _mm512_xor_si512(LD(D + 64 * c), _mm512_set1_epi8((char)0x80));
    const __m512i low4 = _mm512_set1_epi8(15), v = LD(D + 64 * (c % 4));
    __m512i q = _mm512_and_si512(c < 4 ? v : _mm512_srli_epi16(v, 4), low4);
    if (t == T_Q5_K) {
        const __m512i hb = _mm512_and_si512(_mm512_srli_epi16(LD(D + 256), c), _mm512_set1_epi8(1));
        q = _mm512_or_si512(q, _mm512_slli_epi16(hb, 4));
    } else if (t == T_Q6_K) {
        const __m512i hv = LD(D + 256 + 64 * (c / 4));
        const __m512i hb = _mm512_and_si512(_mm512_srli_epi16(hv, 2 * (c % 4)), _mm512_set1_epi8(3));
        q = _mm512_or_si512(q, _mm512_slli_epi16(hb, 4));
    }
    return q;
}

static inline __m512 bytes_ps(const uint8_t *p, int is_signed) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
}

/* (a0, a1, b0, b1) of the group's 16 rows, sub-block s (a1, b1: Q6_K's second half). */
static inline __attribute__((always_inline)) void params_vnni(int t, const uint8_t *base, int s, __m512 *p) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)base));
    if (t == T_Q8_0 || t == T_Q4_0 || t == T_Q4_1) {
        p[0] = p[1] = d;
        p[2] = t == T_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(base + 32)))
                           : _mm512_mul_ps(d, _mm512_set1_ps(t == T_Q4_0 ? -8.0f : -128.0f));
    } else if (t == T_Q6_K) {
        p[0] = _mm512_mul_ps(d, bytes_ps(base + 32 + 16 * (2 * s), 1));
        p[1] = _mm512_mul_ps(d, bytes_ps(base + 32 + 16 * (2 * s + 1), 1));
        p[2] = _mm512_mul_ps(p[0], _mm512_set1_ps(-32.0f));
        p[3] = _mm512_mul_ps(p[1], _mm512_set1_ps(-32.0f));
    } else {
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(base + 32)));
        p[0] = p[1] = _mm512_mul_ps(d, bytes_ps(base + 64 + 16 * s, 0));
        p[2] = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), dmin), bytes_ps(base + 192 + 16 * s, 0));
    }
}

/* Activation rows [r0, r0 + mb) against the group: res (mb x 16). */
static inline __attribute__((always_inline)) void rows_vnni(int t, const Act *a, int64_t r0, int mb,
                                                            const uint8_t *gp, float *res) {
    const int subs = qk_of(t) / 32;
    const int64_t k = a->k, nsb = k / qk_of(t);
    __m512 acc[VMB], p[4];
    for (int r = 0; r < mb; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *base = gp + sb * sb_bytes(t);
        for (int s = 0; s < subs; s++) {
            const int64_t kb = sb * subs + s;
            const uint8_t *D = base + hdr_bytes(t) + s * sub_bytes(t);
            __m512i lo[VMB], hi[VMB];
            for (int r = 0; r < mb; r++) lo[r] = hi[r] = _mm512_setzero_si512();
            for (int c = 0; c < 8; c++) {
                const __m512i w = chunk_vnni(t, D, c);
                for (int r = 0; r < mb; r++) {
                    int32_t xv;
                    memcpy(&xv, a->q + (r0 + r) * k + 32 * kb + 4 * c, 4);
                    const __m512i x = _mm512_set1_epi32(xv);
                    if (t == T_Q6_K && c >= 4) hi[r] = _mm512_dpbusd_epi32(hi[r], w, x);
                    else lo[r] = _mm512_dpbusd_epi32(lo[r], w, x);
                }
            }
            params_vnni(t, base, s, p);
            for (int r = 0; r < mb; r++) {
                const __m512 dx = _mm512_set1_ps(a->d[(r0 + r) * (k / 32) + kb]);
                const float *ds = a->ds + (r0 + r) * (k / 16) + 2 * kb;
                if (t == T_Q8_0) /* the +128 of the weights, taken off exactly */
                    lo[r] = _mm512_sub_epi32(lo[r], _mm512_set1_epi32(128 * a->sq[(r0 + r) * (k / 32) + kb]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[r]), _mm512_mul_ps(p[0], dx), acc[r]);
                if (t == T_Q6_K) {
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[r]), _mm512_mul_ps(p[1], dx), acc[r]);
                    acc[r] = _mm512_fmadd_ps(p[2], _mm512_set1_ps(ds[0]), acc[r]);
                    acc[r] = _mm512_fmadd_ps(p[3], _mm512_set1_ps(ds[1]), acc[r]);
                } else if (t != T_Q8_0) {
                    acc[r] = _mm512_fmadd_ps(p[2], _mm512_set1_ps(ds[0] + ds[1]), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < mb; r++) _mm512_storeu_ps(res + 16 * r, acc[r]);
}

#define GROUP_VNNI(NAME, TY)                                                                                  \
    static void NAME(const Act *a, int64_t m, const uint8_t *gp, int64_t j0, int64_t n, const float *bias,  \
                     float *out) {                                                                          \
        float res[VMB * 16];                                                                                \
        const int rows = n - j0 < 16 ? (int)(n - j0) : 16;                                                  \
        for (int64_t r0 = 0; r0 < m; r0 += VMB) {                                                           \
            const int mb = m - r0 < VMB ? (int)(m - r0) : VMB;                                              \
            switch (mb) {                                                                                   \
            case 1: rows_vnni(TY, a, r0, 1, gp, res); break;                                                \
            case 2: rows_vnni(TY, a, r0, 2, gp, res); break;                                                \
            case 3: rows_vnni(TY, a, r0, 3, gp, res); break;                                                \
            case 4: rows_vnni(TY, a, r0, 4, gp, res); break;                                                \
            case 5: rows_vnni(TY, a, r0, 5, gp, res); break;                                                \
            case 6: rows_vnni(TY, a, r0, 6, gp, res); break;                                                \
            case 7: rows_vnni(TY, a, r0, 7, gp, res); break;                                                \
            default: rows_vnni(TY, a, r0, VMB, gp, res);                                                    \
            }                                                                                               \
            for (int r = 0; r < mb; r++)                                                                    \
                for (int i = 0; i < rows; i++)                                                              \
                    out[(r0 + r) * n + j0 + i] = res[16 * r + i] + (bias ? bias[j0 + i] : 0.0f);            \
        }                                                                                                   \
    }
GROUP_VNNI(group_q8_0_vnni, T_Q8_0)
GROUP_VNNI(group_q4_0_vnni, T_Q4_0)
GROUP_VNNI(group_q4_1_vnni, T_Q4_1)
GROUP_VNNI(group_q4_k_vnni, T_Q4_K)
GROUP_VNNI(group_q5_k_vnni, T_Q5_K)
GROUP_VNNI(group_q6_k_vnni, T_Q6_K)

void quant_group_vnni(int t, const Act *a, int64_t m, const uint8_t *gp, int64_t j0, int64_t n, const float *bias,
                      float *out) {
    switch (t) {
    case T_Q8_0: group_q8_0_vnni(a, m, gp, j0, n, bias, out); break;
    case T_Q4_0: group_q4_0_vnni(a, m, gp, j0, n, bias, out); break;
    case T_Q4_1: group_q4_1_vnni(a, m, gp, j0, n, bias, out); break;
    case T_Q4_K: group_q4_k_vnni(a, m, gp, j0, n, bias, out); break;
    case T_Q5_K: group_q5_k_vnni(a, m, gp, j0, n, bias, out); break;
    default: group_q6_k_vnni(a, m, gp, j0, n, bias, out);
    }
}
#pragma GCC pop_options
#else
#define QV_BUILT 0
void quant_group_vnni(int t, const Act *a, int64_t m, const uint8_t *gp, int64_t j0, int64_t n, const float *bias,
                      float *out) {
    (void)t, (void)a, (void)m, (void)gp, (void)j0, (void)n, (void)bias, (void)out;
}
#endif

/* 1 where this build holds the VNNI path and this CPU runs it. */
int quant_vnni_built(void) {
#if QV_BUILT
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}
