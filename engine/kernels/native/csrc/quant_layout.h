/* The repacked GGUF layout shared by quant_pack.c (repack at load, unpack rows back) and the
 * kernels (quant_gemm.c: portable and AVX2; quant_vnni.c: AVX-512 VNNI).
 *
 * Where it sits: kvfleet/engine/kernels/native/quant_gemm.py repacks each linear's GGUF rows once
 * at load (quant_repack) and drops the original bytes; every step's quant_linear reads this layout.
 *
 * Layout: the weight's n rows in groups of G = 16 (the last group padded with zero rows: scale 0,
 * so they add nothing); a group is k / QK superblocks (QK = 32, or 256 for the K-quants) one after
 * another; a superblock is a header (the 16 rows' scales side by side) then one data area per
 * 32-value sub-block. In a sub-block's data the values are taken four at a time ("chunk" c covers
 * elements 4c..4c+3) and a chunk of all 16 rows is 64 bytes: row i's four bytes at 4i. So one
 * 64-byte load holds a chunk of 16 rows (AVX-512) or two loads of 32 bytes each hold 8 rows (AVX2),
 * and one broadcast of the activation's 4 bytes of that chunk feeds all of them: the int32 lane
 * i of maddubs + madd (or dpbusd) is row i's partial dot, no horizontal sums.
 *   Q8_0: 8 chunks x 64 bytes, signed values.
 *   4-bit values (Q4_0, Q4_1, Q4_K, and the low 4 bits of Q5_K and Q6_K): 4 x 64 bytes; byte
 *     (t, i, j) holds chunk t in its low nibble and chunk t + 4 in its high nibble.
 *   Q5_K: then 64 bytes of high bits: bit c of byte (i, j) is chunk c's fifth bit.
 *   Q6_K: then 2 x 64 bytes of high bit pairs: bits 2(c % 4) of byte (c / 4, i, j).
 * Headers (f16 stay f16, scales stay their integers, so dequantisation is exact):
 *   Q8_0, Q4_0: d[16]; Q4_1: d[16] m[16]; Q4_K, Q5_K: d[16] dmin[16] sc[8][16] mn[8][16] (6-bit
 *   values in bytes: 64 bytes more per 16 x 256 values than the file, 2-3%); Q6_K: d[16] sc[16][16].
 * Value of row i, element e of sub-block s: w = a * q + b, (a, b) = (d, 0) Q8_0, (d, -8d) Q4_0,
 * (d, m) Q4_1, (d sc_s, -dmin mn_s) Q4_K/Q5_K, (d sc_{e/16}, -32 d sc_{e/16}) Q6_K: gguf's values.
 */
#ifndef KVFLEET_QUANT_LAYOUT_H
#define KVFLEET_QUANT_LAYOUT_H
#include <stdint.h>
#include <string.h>

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };
#define QG 16 /* output rows per group */

static inline int qk_of(int t) { return t >= T_Q4_K ? 256 : 32; }
static inline int known_type(int t) {
    return t == T_Q4_0 || t == T_Q4_1 || t == T_Q8_0 || t == T_Q4_K || t == T_Q5_K || t == T_Q6_K;
}
/* bytes of one row's block in the .gguf file (ggml-common.h) */
static inline int64_t block_bytes(int t) {
    switch (t) {
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    default: return 210;
    }
}
/* bytes of a repacked superblock's header, and of one sub-block's data (16 rows each) */
static inline int64_t hdr_bytes(int t) {
    switch (t) {
    case T_Q8_0:
    case T_Q4_0: return 32;
    case T_Q4_1: return 64;
    case T_Q6_K: return 32 + 256;
    default: return 64 + 256;
    }
}
static inline int64_t sub_bytes(int t) {
    switch (t) {
    case T_Q8_0: return 512;
    case T_Q5_K: return 256 + 64;
    case T_Q6_K: return 256 + 128;
    default: return 256;
    }
}
static inline int64_t sb_bytes(int t) { return hdr_bytes(t) + (qk_of(t) / 32) * sub_bytes(t); }
static inline int64_t group_bytes(int t, int64_t k) { return k / qk_of(t) * sb_bytes(t); }

/* x's rows quantised: q (m, k) int8, d (m, k/32) scales, ds (m, k/16) d * (sum of q per 16),
 * sq (m, k/32) the sum of q per 32 (the VNNI path's exact correction for Q8_0's +128) */
typedef struct {
    int8_t *q;
    float *d;
    float *ds;
    int32_t *sq;
    int64_t k;
} Act;

static inline float h2f_bits(uint16_t h) {
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
static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h2f_bits(h);
}

/* The affine map of row i of a group's superblock `base`, sub-block s: w = a_g * q + b_g per half g. */
static inline void row_params(int t, const uint8_t *base, int s, int i, float *ab) {
    const float d = h2f(base + 2 * i);
    if (t == T_Q8_0 || t == T_Q4_0 || t == T_Q4_1) {
        ab[0] = ab[1] = d;
        ab[2] = ab[3] = t == T_Q4_1 ? h2f(base + 32 + 2 * i) : t == T_Q4_0 ? -8.0f * d : 0.0f;
    } else if (t == T_Q6_K) {
        ab[0] = d * (float)(int8_t)base[32 + 16 * (2 * s) + i];
        ab[1] = d * (float)(int8_t)base[32 + 16 * (2 * s + 1) + i];
        ab[2] = -32.0f * ab[0];
        ab[3] = -32.0f * ab[1];
    } else {
        ab[0] = ab[1] = d * (float)base[64 + 16 * s + i];
        ab[2] = ab[3] = -h2f(base + 32 + 2 * i) * (float)base[192 + 16 * s + i];
    }
}

/* The value q (unsigned 0..63, or Q8_0's signed byte) of row i, element e of sub-block data D. */
static inline int packed_q(int t, const uint8_t *D, int i, int e) {
    const int c = e / 4, j = e % 4;
    if (t == T_Q8_0) return (int8_t)D[64 * c + 4 * i + j];
    const uint8_t nib = D[64 * (c % 4) + 4 * i + j];
    int q = c < 4 ? nib & 15 : nib >> 4;
    if (t == T_Q5_K) q |= ((D[256 + 4 * i + j] >> c) & 1) << 4;
    if (t == T_Q6_K) q |= ((D[256 + 64 * (c / 4) + 4 * i + j] >> (2 * (c % 4))) & 3) << 4;
    return q;
}

#endif
