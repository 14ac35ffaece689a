/* The AVX-512 VNNI path of int8_gemm.c: rows of int8 weights against rows of int8 activations,
 * 64 bytes per _mm512_dpbusd_epi32.
 *
 * Where it sits: int8_linear (int8_gemm.c) calls int8_row16_vnni for every 16 weight rows when a step
 * has one activation row (a decode step at batch 1), else int8_dots_vnni for every block of 4 weight
 * rows and 4 activation rows, when the path chosen by kvfleet/engine/kernels/native/int8_gemm.py is 2.
 * Compiled on every x86-64 GCC/clang build (the functions carry their own target, as quant_vnni.c's
 * do) and run only where int8_vnni_built() says the CPU has AVX-512F/BW and VNNI.
 *
 * How: dpbusd multiplies unsigned by signed bytes. The weights go unsigned in register (wu = w ^ 0x80
 * = w + 128), the activations stay signed: sum wu*q = sum w*q + 128 * sum q, and sum q (qsum, one
 * per activation row, from the caller) is taken off, so d is the exact integer dot the other paths
 * take. The offset costs one xor per weight chunk, not a second dpbusd per weight row (the weights'
 * own sums, as the activations' offset needed). The tail of k (k % 64) is read with masked loads:
 * a masked weight byte becomes 128, times a masked activation byte, 0.
 * int8_row16_vnni keeps 16 accumulators, one per weight row, and sums them across in one tree of
 * unpacks and 128-bit shuffles into a vector whose lane j is row j's dot, instead of 16 reductions.
 *
 * Invariant: every d is sum over l of q[r][l] * w[i][l], exactly (int32: k * 255 * 127 fits to k = 66 000).
 */
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 9)
#define I8V_BUILT 1
#pragma GCC push_options
#pragma GCC target("avx2,avx512f,avx512bw,avx512vl,avx512vnni")
#include <immintrin.h>

#define VMB 4 /* at most this many activation rows per call (int8_gemm.c's MB) */
#define VJ 4  /* at most this many weight rows per int8_dots_vnni call: 16 accumulators */

static inline __mmask64 tail_mask(int64_t k, int64_t l) {
    return k - l >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (k - l)) - 1);
}

/* nj (<= VJ) rows of w (stride k) against mb (<= VMB) rows of q (signed, stride k) whose byte sums
 * are qsum: d[i * VMB + r] = the exact dot of weight row i with activation row r. Each 64-byte chunk
 * of the nj weight rows and the mb activation rows is loaded once for nj * mb dpbusd. */
void int8_dots_vnni(const int8_t *w, int nj, const int8_t *q, const int32_t *qsum, int64_t k, int mb,
                    int32_t *d) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i acc[VJ][VMB];
    for (int i = 0; i < VJ; i++)
        for (int r = 0; r < VMB; r++) acc[i][r] = _mm512_setzero_si512();
    for (int64_t l = 0; l < k; l += 64) {
        const __mmask64 m = tail_mask(k, l);
        __m512i xv[VMB];
        for (int r = 0; r < mb; r++) xv[r] = _mm512_maskz_loadu_epi8(m, q + r * k + l);
        for (int i = 0; i < nj; i++) {
            const __m512i wv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, w + i * k + l), flip);
            for (int r = 0; r < mb; r++) acc[i][r] = _mm512_dpbusd_epi32(acc[i][r], wv, xv[r]);
        }
    }
    for (int i = 0; i < nj; i++)
        for (int r = 0; r < mb; r++) d[i * VMB + r] = _mm512_reduce_add_epi32(acc[i][r]) - 128 * qsum[r];
}

/* lane j of the result: the sum of a[j]'s 16 lanes (16 vectors summed across in 4 rounds). */
static inline __m512i sum_across16(__m512i a[16]) {
    __m512i t[8], u[4], v[2];
    for (int i = 0; i < 8; i++) /* per 128 bits: [a0+a2, b0+b2, a1+a3, b1+b3] of rows 2i, 2i+1 */
        t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]),
                                _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128 bits: rows 4i..4i+3, each that segment's sum */
        u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]),
                                _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    for (int i = 0; i < 2; i++) /* segments: u[2i]'s 0+1, 2+3, u[2i+1]'s 0+1, 2+3 */
        v[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], 0x88),
                                _mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(v[0], v[1], 0x88), _mm512_shuffle_i32x4(v[0], v[1], 0xDD));
}

/* 16 rows of w (stride k) against one row of q (signed) whose byte sum is qsum: d[j] = the exact
 * dot of weight row j (nj < 16: the rows past nj are not read and their d is not written). */
void int8_row16_vnni(const int8_t *w, int nj, const int8_t *q, int32_t qsum, int64_t k, int32_t *d) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_si512();
    for (int64_t l = 0; l < k; l += 64) {
        const __mmask64 m = tail_mask(k, l);
        const __m512i xv = _mm512_maskz_loadu_epi8(m, q + l);
        for (int i = 0; i < nj; i++) {
            const __m512i wv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, w + i * k + l), flip);
            acc[i] = _mm512_dpbusd_epi32(acc[i], wv, xv);
        }
    }
    const __m512i sums = _mm512_sub_epi32(sum_across16(acc), _mm512_set1_epi32(128 * qsum));
    _mm512_mask_storeu_epi32(d, (__mmask16)((1u << nj) - 1), sums);
}
#pragma GCC pop_options
#else
#define I8V_BUILT 0
void int8_dots_vnni(const int8_t *w, int nj, const int8_t *q, const int32_t *qsum, int64_t k, int mb,
                    int32_t *d) {
    (void)w, (void)nj, (void)q, (void)qsum, (void)k, (void)mb, (void)d;
}
void int8_row16_vnni(const int8_t *w, int nj, const int8_t *q, int32_t qsum, int64_t k, int32_t *d) {
    (void)w, (void)nj, (void)q, (void)qsum, (void)k, (void)d;
}
#endif

/* 1 where this build holds the VNNI path and this CPU runs it. */
int int8_vnni_built(void) {
#if I8V_BUILT
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}
