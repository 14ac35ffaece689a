/* GGUF block rows <-> the repacked layout of quant_layout.h, done once at load (and back, for rows).
 *
 * Where it sits: kvfleet/engine/kernels/native/quant_gemm.py calls quant_repack when a linear of a
 * model served with --quantization gguf is resolved (the file's bytes are then dropped: the packed
 * copy is the only one), and quant_unpack_rows where the file's blocks of some rows are needed
 * again: the token embedding's lookup (tied to the LM head, whose packed rows it reads) and the
 * tests' dequantise-then-float32 reference.
 *
 * How: each superblock of each row goes through one canonical form (its QK values q as ints and
 * its header fields as stored: f16 bits, 6-bit or int8 scales), decoded from one layout and
 * encoded into the other; both directions are exact, so unpack(repack(rows)) == rows.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_layout.h"

typedef struct {    /* one row's superblock, as stored */
    uint8_t q[256]; /* values: 0..63, or Q8_0's signed byte */
    uint16_t d, m;  /* f16 bits: d, and Q4_1's m or the K-quants' dmin */
    uint8_t sc[16]; /* Q4_K/Q5_K: 6-bit scales of 8 sub-blocks; Q6_K: int8 scales of 16 halves */
    uint8_t mn[8];  /* Q4_K/Q5_K: 6-bit mins */
} Canon;

static uint16_t u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* ggml's 12 bytes of 6-bit scales and mins (get_scale_min_k4), both ways */
static void k4_scales_decode(const uint8_t *s, Canon *c) {
    for (int j = 0; j < 8; j++) {
        c->sc[j] = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        c->mn[j] = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}
static void k4_scales_encode(const Canon *c, uint8_t *s) {
    for (int j = 0; j < 4; j++) {
        s[j] = (uint8_t)((c->sc[j] & 63) | ((c->sc[j + 4] >> 4) << 6));
        s[j + 4] = (uint8_t)((c->mn[j] & 63) | ((c->mn[j + 4] >> 4) << 6));
        s[j + 8] = (uint8_t)((c->sc[j + 4] & 15) | ((c->mn[j + 4] & 15) << 4));
    }
}

/* Where value e of a raw Q6_K superblock lives: ql byte, its shift, qh byte, its shift. */
static void q6k_place(int e, int *ql, int *lsh, int *qh, int *hsh) {
    const int h = e / 128, r = e % 128, part = r / 32, l = r % 32;
    *ql = 64 * h + l + 32 * (part & 1);
    *lsh = part >= 2 ? 4 : 0;
    *qh = 128 + 32 * h + l;
    *hsh = 2 * part;
}

static void decode_raw(int t, const uint8_t *b, Canon *c) {
    c->d = u16(b);
    c->m = (t == T_Q4_1 || t == T_Q4_K || t == T_Q5_K) ? u16(b + 2) : 0;
    if (t == T_Q8_0) {
        memcpy(c->q, b + 2, 32);
    } else if (t == T_Q4_0 || t == T_Q4_1) {
        const uint8_t *qs = b + (t == T_Q4_0 ? 2 : 4);
        for (int l = 0; l < 16; l++) {
            c->q[l] = qs[l] & 15;
            c->q[l + 16] = qs[l] >> 4;
        }
    } else if (t == T_Q4_K || t == T_Q5_K) {
        k4_scales_decode(b + 4, c);
        const uint8_t *qs = b + (t == T_Q4_K ? 16 : 48), *qh = b + 16;
        for (int e = 0; e < 256; e++) {
            const int s = e / 32, l = e % 32;
            const uint8_t byte = qs[32 * (s / 2) + l];
            c->q[e] = (uint8_t)((s & 1) ? byte >> 4 : byte & 15);
            if (t == T_Q5_K) c->q[e] |= (uint8_t)(((qh[l] >> s) & 1) << 4);
        }
    } else {
        c->d = u16(b + 208);
        memcpy(c->sc, b + 192, 16);
        for (int e = 0; e < 256; e++) {
            int ql, lsh, qh, hsh;
            q6k_place(e, &ql, &lsh, &qh, &hsh);
            c->q[e] = (uint8_t)(((b[ql] >> lsh) & 15) | (((b[qh] >> hsh) & 3) << 4));
        }
    }
}

static void encode_raw(int t, const Canon *c, uint8_t *b) {
    memset(b, 0, (size_t)block_bytes(t));
    memcpy(b + (t == T_Q6_K ? 208 : 0), &c->d, 2);
    if (t == T_Q4_1 || t == T_Q4_K || t == T_Q5_K) memcpy(b + 2, &c->m, 2);
    if (t == T_Q8_0) {
        memcpy(b + 2, c->q, 32);
    } else if (t == T_Q4_0 || t == T_Q4_1) {
        uint8_t *qs = b + (t == T_Q4_0 ? 2 : 4);
        for (int l = 0; l < 16; l++) qs[l] = (uint8_t)(c->q[l] | (c->q[l + 16] << 4));
    } else if (t == T_Q4_K || t == T_Q5_K) {
        k4_scales_encode(c, b + 4);
        uint8_t *qs = b + (t == T_Q4_K ? 16 : 48), *qh = b + 16;
        for (int e = 0; e < 256; e++) {
            const int s = e / 32, l = e % 32;
            qs[32 * (s / 2) + l] |= (uint8_t)((c->q[e] & 15) << ((s & 1) ? 4 : 0));
            if (t == T_Q5_K) qh[l] |= (uint8_t)(((c->q[e] >> 4) & 1) << s);
        }
    } else {
        memcpy(b + 192, c->sc, 16);
        for (int e = 0; e < 256; e++) {
            int ql, lsh, qh, hsh;
            q6k_place(e, &ql, &lsh, &qh, &hsh);
            b[ql] |= (uint8_t)((c->q[e] & 15) << lsh);
            b[qh] |= (uint8_t)(((c->q[e] >> 4) & 3) << hsh);
        }
    }
}

/* Row i of a group's superblock `base` (zeroed beforehand) set from / read into canonical form. */
static void put_packed(int t, uint8_t *base, int i, const Canon *c) {
    memcpy(base + 2 * i, &c->d, 2);
    if (t == T_Q4_1 || t == T_Q4_K || t == T_Q5_K) memcpy(base + 32 + 2 * i, &c->m, 2);
    for (int s = 0; t == T_Q6_K && s < 16; s++) base[32 + 16 * s + i] = c->sc[s];
    for (int s = 0; (t == T_Q4_K || t == T_Q5_K) && s < 8; s++) {
        base[64 + 16 * s + i] = c->sc[s];
        base[192 + 16 * s + i] = c->mn[s];
    }
    for (int e = 0; e < qk_of(t); e++) {
        uint8_t *D = base + hdr_bytes(t) + (e / 32) * sub_bytes(t);
        const int ch = (e % 32) / 4, j = e % 4, q = c->q[e];
        if (t == T_Q8_0) {
            D[64 * ch + 4 * i + j] = (uint8_t)q;
            continue;
        }
        D[64 * (ch % 4) + 4 * i + j] |= (uint8_t)((q & 15) << (ch < 4 ? 0 : 4));
        if (t == T_Q5_K) D[256 + 4 * i + j] |= (uint8_t)(((q >> 4) & 1) << ch);
        if (t == T_Q6_K) D[256 + 64 * (ch / 4) + 4 * i + j] |= (uint8_t)(((q >> 4) & 3) << (2 * (ch % 4)));
    }
}

static void get_packed(int t, const uint8_t *base, int i, Canon *c) {
    c->d = u16(base + 2 * i);
    c->m = (t == T_Q4_1 || t == T_Q4_K || t == T_Q5_K) ? u16(base + 32 + 2 * i) : 0;
    for (int s = 0; t == T_Q6_K && s < 16; s++) c->sc[s] = base[32 + 16 * s + i];
    for (int s = 0; (t == T_Q4_K || t == T_Q5_K) && s < 8; s++) {
        c->sc[s] = base[64 + 16 * s + i];
        c->mn[s] = base[192 + 16 * s + i];
    }
    for (int e = 0; e < qk_of(t); e++)
        c->q[e] = (uint8_t)packed_q(t, base + hdr_bytes(t) + (e / 32) * sub_bytes(t), i, e % 32);
}

/* Bytes of n rows of k values of type t repacked: 0, or -1 for a type not handled, -2 for k not
 * a whole number of blocks. */
int quant_packed_size(int t, int64_t n, int64_t k, int64_t *bytes) {
    if (!known_type(t)) return -1;
    if (k <= 0 || k % qk_of(t) != 0) return -2;
    *bytes = (n + QG - 1) / QG * group_bytes(t, k);
    return 0;
}

/* raw: n rows of k / QK blocks of type t as the file stores them; packed: quant_packed_size bytes. */
int quant_repack(const uint8_t *raw, int64_t n, int64_t k, int t, uint8_t *packed) {
    int64_t size;
    const int rc = quant_packed_size(t, n, k, &size);
    if (rc != 0) return rc;
    memset(packed, 0, (size_t)size);
    const int64_t nsb = k / qk_of(t), row_bytes = nsb * block_bytes(t);
    Canon c = {0};
    for (int64_t j = 0; j < n; j++) {
        for (int64_t sb = 0; sb < nsb; sb++) {
            decode_raw(t, raw + j * row_bytes + sb * block_bytes(t), &c);
            put_packed(t, packed + (j / QG) * group_bytes(t, k) + sb * sb_bytes(t), (int)(j % QG), &c);
        }
    }
    return 0;
}

/* The file's bytes of `count` rows (ids in rows[], each < the packed row count) into raw. */
int quant_unpack_rows(const uint8_t *packed, int64_t k, int t, const int64_t *rows, int64_t count, uint8_t *raw) {
    int64_t size;
    const int rc = quant_packed_size(t, 1, k, &size);
    if (rc != 0) return rc;
    const int64_t nsb = k / qk_of(t), row_bytes = nsb * block_bytes(t);
    Canon c = {0};
    for (int64_t r = 0; r < count; r++) {
        const int64_t j = rows[r];
        for (int64_t sb = 0; sb < nsb; sb++) {
            get_packed(t, packed + (j / QG) * group_bytes(t, k) + sb * sb_bytes(t), (int)(j % QG), &c);
            encode_raw(t, &c, raw + r * row_bytes + sb * block_bytes(t));
        }
    }
    return 0;
}
