/* Paged decode attention on the CPU: one query row per sequence, read in place from the block table.
 *
 * Where it sits: kvfleet/engine/kernels/cpu_decode.py compiles this file once per machine
 * (cc -O3 -march=native -fopenmp) and calls paged_decode_f32 through ctypes from the "cpu"
 * attention backend, for the decoding sequences of a step; prefill chunks stay on torch's SDPA.
 *
 * Layout (float32, contiguous): q (rows, H, D); k_cache and v_cache (num_blocks, block_size,
 * KVH, D); block_tables (S, table_stride) int32; seq_lens (S,) int32; query_start (S + 1,)
 * int32; out (rows, H, D). seqs lists the sequences to attend (each with one query row).
 *
 * Invariant: the query of sequence s sits at position L - 1 (L = seq_lens[s]) and attends keys
 * lo..L-1, lo = max(0, L - window) (window 0: lo = 0); a key is read only if the sequence
 * stored it, so no other sequence's slot (stale or NaN) is ever touched, and no score is masked.
 * All heads of a sequence are done together, so every token's K and V rows (KVH * D floats
 * each, contiguous) are read once per step: scores, then max, exp and normalise, then the
 * weighted sum of V rows. A step's sequences are shared among the OpenMP threads. The portable
 * loops are what every CPU runs; with AVX-512 (-march=native found it) head sizes that are a
 * multiple of 16 take attend16, the same computation in explicit vector code.
 *
 * Attention sinks (gpt-oss): the last argument, sinks, is NULL or (H,) float32, a logit per head
 * that joins its softmax with no value row (the max and the sum include it, so the key weights sum
 * to less than one).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fast_exp.h"

/* Each of the H rows of n scores becomes its softmax, in place (with head h's sink logit sinks[h]
 * in its max and sum, when sinks is not NULL). */
static inline void softmax_rows(float *scores, int H, int n, const float *sinks) {
    for (int h = 0; h < H; h++) {
        float *sc = scores + (int64_t)h * n;
        float m = sinks ? sinks[h] : sc[0];
#pragma omp simd reduction(max : m)
        for (int i = 0; i < n; i++) m = sc[i] > m ? sc[i] : m;
        float sum = sinks ? exp_clamped(sinks[h] - m) : 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < n; i++) {
            sc[i] = exp_clamped(sc[i] - m);
            sum += sc[i];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int i = 0; i < n; i++) sc[i] *= inv;
    }
}

/* Blocks lie anywhere in the cache and the hardware prefetcher does not cross pages, so each key's
 * row asks for the row of the key AHEAD_KEYS further on, through the block table: a steady stream
 * a few rows ahead. On SmolLM2's heads (32 sequences of 100-800 keys, 30 layers, 2 threads) a step
 * went 45-48 -> 39-41 ms against fetching the first page of the next block when a block began. */
#define AHEAD_KEYS 4

static inline void prefetch_row(const float *cache, const int32_t *table, int pos, int block_size, int64_t rs,
                                int64_t bstride) {
    const char *p = (const char *)(cache + (int64_t)table[pos / block_size] * bstride + (int64_t)(pos % block_size) * rs);
    for (int64_t off = 0; off < rs * (int64_t)sizeof(float); off += 64) __builtin_prefetch(p + off, 0, 3);
}

/* One pass over the keys lo..L-1 in place, block by block, each token's KV heads together: with
 * SCORES, scores[h * n + i] = scale * q_h . k_i; else out_h += scores[h * n + i] * v_i. */
enum pass { SCORES, WEIGHTED_SUM };

static inline __attribute__((always_inline)) void over_keys(
    const enum pass pass, const float *cache, const float *q, const int32_t *table, int L, int lo, int g, int KVH,
    const int D, int block_size, float scale, float *scores, float *out) {
    const int64_t rs = (int64_t)KVH * D;              /* floats between consecutive tokens of a block */
    const int64_t bstride = (int64_t)block_size * rs; /* floats between consecutive blocks */
    const int n = L - lo;
    const int first = lo / block_size, last = (L - 1) / block_size;
    for (int b = first, i = 0; b <= last; b++) {
        const float *base = cache + (int64_t)table[b] * bstride;
        const int t1 = b == last ? (L - 1) % block_size + 1 : block_size;
        for (int t = b == first ? lo % block_size : 0; t < t1; t++, i++) {
            if (lo + i + AHEAD_KEYS < L) prefetch_row(cache, table, lo + i + AHEAD_KEYS, block_size, rs, bstride);
            const float *row = base + t * rs;
            for (int kh = 0; kh < KVH; kh++) {
                const float *x = row + (int64_t)kh * D;
                for (int h = kh * g; h < (kh + 1) * g; h++) {
                    if (pass == SCORES) {
                        const float *qh = q + (int64_t)h * D;
                        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                        for (int d = 0; d < D; d++) acc += qh[d] * x[d];
                        scores[(int64_t)h * n + i] = acc * scale;
                    } else {
                        const float w = scores[(int64_t)h * n + i];
                        float *o = out + (int64_t)h * D;
#pragma omp simd
                        for (int d = 0; d < D; d++) o[d] += w * x[d];
                    }
                }
            }
        }
    }
}

static inline __attribute__((always_inline)) void attend(
    const float *q, const float *k_cache, const float *v_cache, const int32_t *table, int L, int lo, int H,
    int g, int KVH, const int D, int block_size, float scale, float *scores, float *out, const float *sinks) {
    over_keys(SCORES, k_cache, q, table, L, lo, g, KVH, D, block_size, scale, scores, out);
    softmax_rows(scores, H, L - lo, sinks);
    memset(out, 0, sizeof(float) * (size_t)H * D);
    over_keys(WEIGHTED_SUM, v_cache, q, table, L, lo, g, KVH, D, block_size, scale, scores, out);
}


#if defined(__AVX512F__)
#include <immintrin.h>

/* The 16 lane sums of v[0..15], as one vector: r[j] = v[j][0] + ... + v[j][15]. */
static inline __m512 sum_lanes16(const __m512 *v) {
    __m512 x[8], z[4], u[2];
    for (int j = 0; j < 8; j++)
        x[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 4; j++) {
        const __m512d a = _mm512_castps_pd(x[2 * j]), b = _mm512_castps_pd(x[2 * j + 1]);
        z[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int j = 0; j < 2; j++)
        u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * j], z[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(z[2 * j], z[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Pointers to the K (or V) rows of keys lo + i0 .. lo + i0 + count - 1 (count <= 16). */
static inline void token_rows(const float *cache, const int32_t *table, int lo, int i0, int count, int block_size,
                              int64_t rs, int64_t bstride, const float **rows) {
    for (int j = 0; j < count; j++) {
        const int pos = lo + i0 + j;
        rows[j] = cache + (int64_t)table[pos / block_size] * bstride + (int64_t)(pos % block_size) * rs;
    }
}

/* attend() with AVX-512, for head sizes that are a multiple of 16 up to 128: the scores of 16 keys
 * come out of one lane reduction (sum_lanes16), not one each, and each head's output stays in
 * registers over all its keys. Same invariant as attend(). */
static inline __attribute__((always_inline)) void attend16(
    const float *q, const float *k_cache, const float *v_cache, const int32_t *table, int L, int lo, int H,
    int g, int KVH, const int D, int block_size, float scale, float *scores, float *out, const float *sinks) {
    const int DV = D / 16;
    const int64_t rs = (int64_t)KVH * D, bstride = (int64_t)block_size * rs;
    const int n = L - lo;
    const float *rows[16];
    for (int i0 = 0; i0 < n; i0 += 16) {
        const int count = n - i0 < 16 ? n - i0 : 16;
        token_rows(k_cache, table, lo, i0, count, block_size, rs, bstride, rows);
        if (i0 + 16 < n) { /* the next 16 keys start on another page, often: fetch it now */
            const int pos = lo + i0 + 16;
            __builtin_prefetch(k_cache + (int64_t)table[pos / block_size] * bstride + (int64_t)(pos % block_size) * rs, 0, 3);
        }
        const __mmask16 keep = (__mmask16)((1u << count) - 1u);
        for (int h = 0; h < H; h++) {
            const float *qh = q + (int64_t)h * D;
            __m512 qv[8], p[16];
            for (int c = 0; c < DV; c++) qv[c] = _mm512_loadu_ps(qh + 16 * c);
            const int64_t koff = (int64_t)(h / g) * D;
            for (int j = 0; j < 16; j++) {
                __m512 acc = _mm512_setzero_ps();
                if (j < count) {
                    const float *kh = rows[j] + koff;
                    for (int c = 0; c < DV; c++) acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kh + 16 * c), acc);
                }
                p[j] = acc;
            }
            _mm512_mask_storeu_ps(scores + (int64_t)h * n + i0, keep, _mm512_mul_ps(sum_lanes16(p), _mm512_set1_ps(scale)));
        }
    }
    softmax_rows(scores, H, n, sinks);
    for (int h = 0; h < H; h++) {
        const float *w = scores + (int64_t)h * n;
        const int64_t voff = (int64_t)(h / g) * D;
        __m512 acc[8];
        for (int c = 0; c < DV; c++) acc[c] = _mm512_setzero_ps();
        for (int b = lo / block_size, i = 0; i < n; b++) {
            const float *base = v_cache + (int64_t)table[b] * bstride + voff;
            const int t0 = i == 0 ? lo % block_size : 0;
            const int t1 = block_size - t0 < n - i ? block_size : t0 + (n - i);
            for (int t = t0; t < t1; t++, i++) {
                const __m512 wi = _mm512_set1_ps(w[i]);
                const float *v = base + t * rs;
                for (int c = 0; c < DV; c++) acc[c] = _mm512_fmadd_ps(wi, _mm512_loadu_ps(v + 16 * c), acc[c]);
            }
        }
        for (int c = 0; c < DV; c++) _mm512_storeu_ps(out + (int64_t)h * D + 16 * c, acc[c]);
    }
}
#endif

#if defined(__AVX512F__)
#define ATTEND_BODY(DIM) attend16(q, kc, vc, table, L, lo, H, g, KVH, DIM, bs, scale, sc, o, sinks)
#else
#define ATTEND_BODY(DIM) attend(q, kc, vc, table, L, lo, H, g, KVH, DIM, bs, scale, sc, o, sinks)
#endif
/* The common head sizes get their own copy, so the inner loops have a constant trip count; with
 * AVX-512 they take attend16, other sizes (and other CPUs) the portable attend. */
#define ATTEND_FIXED(DIM)                                                                                  \
    static void attend_##DIM(const float *q, const float *kc, const float *vc, const int32_t *table, int L, \
                             int lo, int H, int g, int KVH, int D, int bs, float scale, float *sc, float *o,  \
                             const float *sinks) {                                                         \
        (void)D;                                                                                           \
        ATTEND_BODY(DIM);                                                                                  \
    }
ATTEND_FIXED(32)
ATTEND_FIXED(64)
ATTEND_FIXED(128)
static void attend_any(const float *q, const float *kc, const float *vc, const int32_t *table, int L, int lo,
                       int H, int g, int KVH, int D, int bs, float scale, float *sc, float *o, const float *sinks) {
#if defined(__AVX512F__)
    if (D % 16 == 0 && D <= 128) {
        attend16(q, kc, vc, table, L, lo, H, g, KVH, D, bs, scale, sc, o, sinks);
        return;
    }
#endif
    attend(q, kc, vc, table, L, lo, H, g, KVH, D, bs, scale, sc, o, sinks);
}

/* Returns 0, or 2 if the scores scratch (H * longest context floats per thread) could not be allocated;
 * sinks: NULL, or (H,) sink logits. */
int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                     int64_t table_stride, const int32_t *seq_lens, const int32_t *query_start,
                     const int64_t *seqs, int64_t num_seqs, float *out, int H, int KVH, int D, int block_size,
                     float scale, int window, int num_threads, const float *sinks) {
    const int g = H / KVH;
    typeof(attend_any) *fn = D == 32 ? attend_32 : D == 64 ? attend_64 : D == 128 ? attend_128 : attend_any;
    int max_len = 1;
    for (int64_t i = 0; i < num_seqs; i++)
        if (seq_lens[seqs[i]] > max_len) max_len = seq_lens[seqs[i]];
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_seqs > 1)
    {
        float *scores = malloc(sizeof(float) * (size_t)H * (size_t)max_len);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < num_seqs; w++) {
            if (scores == NULL) continue;
            const int64_t s = seqs[w];
            const int L = seq_lens[s];
            const int lo = (window > 0 && L > window) ? L - window : 0;
            const int64_t row = query_start[s];
            fn(q + row * H * D, k_cache, v_cache, block_tables + s * table_stride, L, lo, H, g, KVH, D,
               block_size, scale, scores, out + row * H * D, sinks);
        }
        free(scores);
    }
    return failed ? 2 : 0;
}
