/* The AVX-512 VNNI path of int8_gemm.c: one row of int8 weights against up to MB rows of int8
 * activations, 64 bytes per _mm512_dpbusd_epi32.
 *
 * Where it sits: int8_linear (int8_gemm.c) calls int8_dots_vnni for every block of 4 weight rows
 * and 4 activation rows when the path chosen by kvfleet/engine/kernels/native/int8_gemm.py is 2. Compiled on every
 * x86-64 GCC/clang build (the functions carry their own target, as quant_vnni.c's do) and run only
 * where int8_vnni_built() says the CPU has AVX-512F/BW and VNNI.
 *
 * How: dpbusd multiplies unsigned by signed bytes. The activations go unsigned by an offset of 128
 * (qu = q ^ 0x80 = q + 128), the weights stay signed: sum qu*w = sum q*w + 128 * sum w, and sum w
 * comes from the same loop (dpbusd of ones with w), so d = sum qu*w - 128 * sum w is the exact
 * integer dot the other paths take. The tail of k (k % 64) is read with masked loads (zeros add 0).
 *
 * Invariant: d[i][r] == sum over l of q[r][l] * w[i][l], exactly (int32: k * 255 * 127 fits to k = 66 000).
 */
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 9)
#define I8V_BUILT 1
#pragma GCC push_options
#pragma GCC target("avx2,avx512f,avx512bw,avx512vl,avx512vnni")
#include <immintrin.h>

#define VMB 4 /* at most this many activation rows per call (int8_gemm.c's MB) */
#define VJ 4  /* at most this many weight rows per call: 16 accumulators and 4 sums of 32 zmm */

/* nj (<= VJ) rows of w (stride k) against mb (<= VMB) rows of qu (unsigned bytes q + 128, stride
 * k): d[i * VMB + r] = the exact dot of weight row i with activation row r. Each 64-byte chunk of
 * the nj weight rows and the mb activation rows is loaded once for nj * mb dpbusd. */
void int8_dots_vnni(const int8_t *w, int nj, const uint8_t *qu, int64_t k, int mb, int32_t *d) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i acc[VJ][VMB], wsum[VJ];
    for (int i = 0; i < VJ; i++) {
        wsum[i] = _mm512_setzero_si512();
        for (int r = 0; r < VMB; r++) acc[i][r] = _mm512_setzero_si512();
    }
    for (int64_t l = 0; l < k; l += 64) {
        const __mmask64 m = k - l >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (k - l)) - 1);
        __m512i xv[VMB];
        for (int r = 0; r < mb; r++) xv[r] = _mm512_maskz_loadu_epi8(m, qu + r * k + l);
        for (int i = 0; i < nj; i++) {
            const __m512i wv = _mm512_maskz_loadu_epi8(m, w + i * k + l);
            wsum[i] = _mm512_dpbusd_epi32(wsum[i], ones, wv);
            for (int r = 0; r < mb; r++) acc[i][r] = _mm512_dpbusd_epi32(acc[i][r], xv[r], wv);
        }
    }
    for (int i = 0; i < nj; i++) {
        const int32_t offset = 128 * _mm512_reduce_add_epi32(wsum[i]);
        for (int r = 0; r < mb; r++) d[i * VMB + r] = _mm512_reduce_add_epi32(acc[i][r]) - offset;
    }
}
#pragma GCC pop_options
#else
#define I8V_BUILT 0
void int8_dots_vnni(const int8_t *w, int nj, const uint8_t *qu, int64_t k, int mb, int32_t *d) {
    (void)w, (void)nj, (void)qu, (void)k, (void)mb, (void)d;
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
