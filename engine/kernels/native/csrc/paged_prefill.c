/* Paged prefill attention on the CPU: a step's prompt chunks, causal, read in place from the block table.
 *
 * Where it sits: kvfleet/engine/kernels/cpu_decode.py compiles this file with paged_decode.c into
 * one library; the "cpu" attention backend calls paged_prefill_f32 through ctypes
 * (kvfleet/engine/kernels/cpu_prefill.py) for the sequences of a step with more than one query
 * row: a prompt from its first token, or a chunk behind a cached prefix.
 *
 * Layout (float32, contiguous), as paged_decode.c: q (rows, H, D); k_cache and v_cache
 * (num_blocks, block_size, KVH, D); block_tables (S, table_stride) int32; seq_lens (S,) int32;
 * query_start (S + 1,) int32; out (rows, H, D). seqs lists the sequences to attend.
 *
 * Invariant: the n query rows of sequence s sit at positions L - n .. L - 1 (L = seq_lens[s]); the
 * row at position p attends keys max(0, p - window + 1) .. p (window 0: from 0), which the
 * sequence has stored, so no other slot is read and no key past the row is ever computed. A work
 * item is one KV head and TQ consecutive positions of one sequence, with the G query heads that
 * share that KV head: R = G x TQ rows. It walks its keys in blocks of BK with an online softmax
 * (running max m and sum l per row, the output rescaled when the max grows), as flash attention.
 *
 * Why this layout: Q is transposed once per item, (D, R), so the scores of a key block come out
 * transposed, (BK, R), from FMAs of a K element broadcast straight from the cache against Q
 * vectors; softmax then runs down the rows of that block in vectors with no horizontal sums, and
 * P @ V broadcasts P against V rows read in place. No K/V row is gathered or copied.
 *
 * Attention sinks (gpt-oss): the last argument, sinks, is NULL or (H,) float32, a logit per head
 * with no value row; each row's online softmax starts from it (m = sink, l = 1) instead of
 * (m = -inf, l = 0).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fast_exp.h"

#pragma GCC target("prefer-vector-width=512")

#if defined(__AVX512F__)
#define VEC 16     /* floats per vector: one AVX-512 register */
#define NV 4       /* vectors per register block: 16 accumulators of the 32 registers */
#else
#define VEC 8      /* one AVX2 register (two NEON ones): a 16-float vector type would spill */
#define NV 3       /* 12 accumulators of the 16 registers */
#endif
#define TQ 16      /* query positions per work item: a head's rows are one vector */
#define BK 64      /* keys per block of the online softmax */
#define KB 4       /* keys per QK register block */
#define RB 4       /* rows per PV register block */
#define MAX_D 256  /* head sizes the kernel takes: multiples of 16 (of VEC in every build) up to this */
#define MAX_G 16   /* query heads per KV head */

typedef float vf __attribute__((vector_size(VEC * sizeof(float)), aligned(4), may_alias));

static inline vf load(const float *p) { return *(const vf *)p; }
static inline void store(float *p, vf v) { *(vf *)p = v; }

typedef struct {
    int64_t seq, kv_head, tile, keys; /* keys: how many the item reads (its cost) */
} Item;

typedef struct {
    const float *k_cache, *v_cache;
    const int32_t *table;
    int KVH, D, bs;
} Cache;

static inline const float *row_of(const Cache *c, const float *base, int64_t pos, int h) {
    const int64_t slot = (int64_t)c->table[pos / c->bs] * c->bs + pos % c->bs;
    return base + (slot * c->KVH + h) * c->D;
}

/* St[j][r] = Qt[:, r] . K[j] for keys j in [j0, j0 + KB) and rows in nv vectors from r0. */
static inline __attribute__((always_inline)) void qk_block(const float *restrict Qt, int R, int D,
                                                           const float *const *kp, int r0, int nv,
                                                           float *restrict St) {
    vf acc[KB][4];
    for (int j = 0; j < KB; j++)
        for (int c = 0; c < nv; c++) acc[j][c] = (vf){0};
    for (int d = 0; d < D; d++) {
        vf qv[4];
        for (int c = 0; c < nv; c++) qv[c] = load(Qt + (int64_t)d * R + r0 + c * VEC);
        for (int j = 0; j < KB; j++) {
            const float kd = kp[j][d];
            for (int c = 0; c < nv; c++) acc[j][c] += kd * qv[c];
        }
    }
    for (int j = 0; j < KB; j++)
        for (int c = 0; c < nv; c++) store(St + (int64_t)j * R + r0 + c * VEC, acc[j][c]);
}

/* acc[r][d0 : d0 + nv * VEC] += sum_j Pt[j][r] V[j][...] for rows r0 .. r0 + RB. */
static inline __attribute__((always_inline)) void pv_block(const float *restrict Pt, int R, int D,
                                                           const float *const *vp, int nk, int r0,
                                                           int d0, int nv, float *restrict acc) {
    vf a[RB][4];
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < nv; c++) a[r][c] = load(acc + (int64_t)(r0 + r) * D + d0 + c * VEC);
    for (int j = 0; j < nk; j++) {
        vf v[4];
        for (int c = 0; c < nv; c++) v[c] = load(vp[j] + d0 + c * VEC);
        for (int r = 0; r < RB; r++) {
            const float p = Pt[(int64_t)j * R + r0 + r];
            for (int c = 0; c < nv; c++) a[r][c] += p * v[c];
        }
    }
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < nv; c++) store(acc + (int64_t)(r0 + r) * D + d0 + c * VEC, a[r][c]);
}

static void scores(const float *Qt, int R, int D, const float *const *kp, float *St) {
    for (int j0 = 0; j0 < BK; j0 += KB) {
        int r0 = 0;
        for (; r0 + NV * VEC <= R; r0 += NV * VEC) qk_block(Qt, R, D, kp + j0, r0, NV, St + (int64_t)j0 * R);
        switch ((R - r0) / VEC) { /* each case is qk_block specialised for that many vectors */
        case 3: qk_block(Qt, R, D, kp + j0, r0, 3, St + (int64_t)j0 * R); break;
        case 2: qk_block(Qt, R, D, kp + j0, r0, 2, St + (int64_t)j0 * R); break;
        case 1: qk_block(Qt, R, D, kp + j0, r0, 1, St + (int64_t)j0 * R); break;
        default: break;
        }
    }
}

static void weighted_values(const float *Pt, int R, int D, const float *const *vp, int nk, float *acc) {
    for (int r0 = 0; r0 < R; r0 += RB) {
        int d0 = 0;
        for (; d0 + NV * VEC <= D; d0 += NV * VEC) pv_block(Pt, R, D, vp, nk, r0, d0, NV, acc);
        switch ((D - d0) / VEC) {
        case 3: pv_block(Pt, R, D, vp, nk, r0, d0, 3, acc); break;
        case 2: pv_block(Pt, R, D, vp, nk, r0, d0, 2, acc); break;
        case 1: pv_block(Pt, R, D, vp, nk, r0, d0, 1, acc); break;
        default: break;
        }
    }
}

/* The scores of keys kb .. kb + nk - 1 become their softmax weights against the running max m and
 * sum l of each row (row r at position pos0 + r % TQ); acc is rescaled when a row's max grows. */
static void online_softmax(float *St, int R, int D, int64_t kb, int nk, int64_t pos0, int window, float *m,
                           float *l, float *acc) {
    float bmax[MAX_G * TQ];
    for (int r = 0; r < R; r++) bmax[r] = -INFINITY;
    /* Only a block that reaches past the item's first position, or below its last row's window, or
     * is short, has a key some row may not see: the others skip the mask. */
    const int masked = kb + BK - 1 > pos0 || (window > 0 && kb <= pos0 + TQ - 1 - window) || nk < BK;
    const int32_t first = (int32_t)(pos0 - kb), win = window; /* positions relative to the block */
    for (int j = 0; j < BK; j++) {
        float *s = St + (int64_t)j * R;
        if (masked) {
#pragma omp simd
            for (int r = 0; r < R; r++) {
                const int32_t p = first + (r & (TQ - 1));
                const int ok = j < nk && j <= p && (win == 0 || j > p - win);
                s[r] = ok ? s[r] : -INFINITY;
            }
        }
#pragma omp simd
        for (int r = 0; r < R; r++) bmax[r] = s[r] > bmax[r] ? s[r] : bmax[r];
    }
    float alpha[MAX_G * TQ], mnew[MAX_G * TQ], sum[MAX_G * TQ];
#pragma omp simd
    for (int r = 0; r < R; r++) {
        mnew[r] = bmax[r] > m[r] ? bmax[r] : m[r];
        /* a row with no key yet keeps m = -inf: nothing to rescale, and exp(-inf - -inf) is never taken */
        alpha[r] = mnew[r] == -INFINITY ? 1.0f : exp_clamped(m[r] - mnew[r]);
        sum[r] = 0.0f;
    }
    for (int j = 0; j < nk; j++) {
        float *s = St + (int64_t)j * R;
#pragma omp simd
        for (int r = 0; r < R; r++) {
            const float e = s[r] == -INFINITY ? 0.0f : exp_clamped(s[r] - mnew[r]);
            s[r] = e;
            sum[r] += e;
        }
    }
    for (int r = 0; r < R; r++) {
        l[r] = l[r] * alpha[r] + sum[r];
        m[r] = mnew[r];
        if (alpha[r] != 1.0f) {
            float *a = acc + (int64_t)r * D;
#pragma omp simd
            for (int d = 0; d < D; d++) a[d] *= alpha[r];
        }
    }
}

typedef struct {
    float *Qt, *acc, *St, *m, *l;
} Scratch;

/* One work item: G heads x TQ positions of one sequence against its keys, written into out. */
static void attend_item(const float *q, const Cache *c, int64_t row0, int64_t n_rows, int64_t pos_first,
                        int h, int64_t tile, int H, int G, float scale, int window, float *out,
                        const Scratch *w, const float *sinks) {
    const int D = c->D, R = G * TQ;
    const int64_t t0 = tile * TQ, nq = n_rows - t0 < TQ ? n_rows - t0 : TQ;
    const int64_t pos0 = pos_first + t0, last = pos0 + nq - 1;
    /* Qt[d][gi * TQ + i] = scale * q[row0 + t0 + i][h * G + gi][d]; rows past nq stay 0 */
    memset(w->Qt, 0, sizeof(float) * (size_t)D * (size_t)R);
    for (int gi = 0; gi < G; gi++)
        for (int64_t i = 0; i < nq; i++) {
            const float *src = q + ((row0 + t0 + i) * H + h * G + gi) * D;
            for (int d = 0; d < D; d++) w->Qt[(int64_t)d * R + gi * TQ + i] = scale * src[d];
        }
    memset(w->acc, 0, sizeof(float) * (size_t)R * (size_t)D);
    for (int r = 0; r < R; r++) { /* row r is head h * G + r / TQ: its sink is the softmax's first logit */
        w->m[r] = sinks ? sinks[h * G + r / TQ] : -INFINITY;
        w->l[r] = sinks ? 1.0f : 0.0f;
    }
    int64_t lo = window > 0 ? pos0 - window + 1 : 0;
    if (lo < 0) lo = 0;
    const float *kp[BK], *vp[BK];
    for (int64_t kb = lo; kb <= last; kb += BK) {
        const int nk = (int)(last + 1 - kb < BK ? last + 1 - kb : BK);
        for (int j = 0; j < nk;) { /* a cache block's rows are consecutive: one table lookup each */
            const int64_t pos = kb + j, off = pos % c->bs;
            const float *kr = row_of(c, c->k_cache, pos, h), *vr = row_of(c, c->v_cache, pos, h);
            const int64_t stride = (int64_t)c->KVH * c->D;
            for (int64_t o = off; o < c->bs && j < nk; o++, j++) {
                kp[j] = kr + (o - off) * stride;
                vp[j] = vr + (o - off) * stride;
            }
        }
        for (int j = nk; j < BK; j++) kp[j] = kp[0]; /* finite filler, masked in the softmax */
        scores(w->Qt, R, D, kp, w->St);
        online_softmax(w->St, R, D, kb, nk, pos0, window, w->m, w->l, w->acc);
        weighted_values(w->St, R, D, vp, nk, w->acc);
    }
    for (int gi = 0; gi < G; gi++)
        for (int64_t i = 0; i < nq; i++) {
            const int r = gi * TQ + (int)i;
            const float inv = 1.0f / w->l[r];
            float *dst = out + ((row0 + t0 + i) * H + h * G + gi) * D;
            for (int d = 0; d < D; d++) dst[d] = w->acc[(int64_t)r * D + d] * inv;
        }
}

static int by_cost(const void *a, const void *b) {
    const int64_t x = ((const Item *)a)->keys, y = ((const Item *)b)->keys;
    return (x < y) - (x > y); /* the costliest first, so the last items to start are short */
}

/* Returns 0; 1 if a scratch buffer could not be allocated; 2 for a head size or grouping it does
 * not take (head_dim not a multiple of 16 or above 256, more than 16 query heads per KV head).
 * sinks: NULL, or (H,) sink logits. */
int paged_prefill_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                      int64_t table_stride, const int32_t *seq_lens, const int32_t *query_start,
                      const int64_t *seqs, int64_t num_seqs, float *out, int H, int KVH, int D, int block_size,
                      float scale, int window, int num_threads, const float *sinks) {
    const int G = H / KVH, R = G * TQ;
    if (D % 16 != 0 || D > MAX_D || G > MAX_G || G * KVH != H) return 2;
    int64_t count = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t s = seqs[i];
        count += KVH * ((query_start[s + 1] - query_start[s] + TQ - 1) / TQ);
    }
    Item *items = malloc(sizeof(Item) * (size_t)(count > 0 ? count : 1));
    if (items == NULL) return 1;
    int64_t n = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t s = seqs[i], rows = query_start[s + 1] - query_start[s], first = seq_lens[s] - rows;
        for (int64_t t = 0; t * TQ < rows; t++) {
            const int64_t end = first + (t + 1) * TQ < seq_lens[s] ? first + (t + 1) * TQ : seq_lens[s];
            const int64_t keys = window > 0 && end > window ? window + TQ : end;
            for (int h = 0; h < KVH; h++) items[n++] = (Item){s, h, t, keys};
        }
    }
    qsort(items, (size_t)count, sizeof(Item), by_cost);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && count > 1)
    {
        Scratch w = {
            aligned_alloc(64, sizeof(float) * (size_t)D * (size_t)R),
            aligned_alloc(64, sizeof(float) * (size_t)R * (size_t)D),
            aligned_alloc(64, sizeof(float) * (size_t)BK * (size_t)R),
            malloc(sizeof(float) * (size_t)R),
            malloc(sizeof(float) * (size_t)R),
        };
        const int ok = w.Qt && w.acc && w.St && w.m && w.l;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < count; i++) {
            if (!ok) continue;
            const Item it = items[i];
            const int64_t rows = query_start[it.seq + 1] - query_start[it.seq];
            const Cache c = {k_cache, v_cache, block_tables + it.seq * table_stride, KVH, D, block_size};
            attend_item(q, &c, query_start[it.seq], rows, seq_lens[it.seq] - rows, (int)it.kv_head, it.tile, H,
                        G, scale, window, out, &w, sinks);
        }
        free(w.Qt), free(w.acc), free(w.St), free(w.m), free(w.l);
    }
    free(items);
    return failed;
}

/* 1 where this build has AVX-512 or AVX2, the builds measured faster than torch's SDPA on SmolLM2 (512-token
 * prompt, 2 threads: 1.59 ms a layer against 2.50 on a Xeon with AVX-512; 3.61 against 5.84 on an AMD EPYC
 * with AVX2), so the "cpu" backend uses the kernel only then; 0 elsewhere, where prefill stays on SDPA. */
int paged_prefill_preferred(void) {
#if defined(__AVX512F__) || defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}
