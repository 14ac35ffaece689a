/* out = x @ w^T (+ bias) with w in bf16 and x, out in float32: the linears of a bf16 model on the CPU.
 *
 * Where it sits: kvfleet/engine/kernels/native/bf16_gemm.py calls bf16_linear through ctypes for
 * every linear of a model served --dtype bfloat16 on the CPU (engine/layers/linear/bf16.py: the
 * decoder's matmuls and the LM head), and csrc/decode_layers.c calls it for its BF16_PANELS operands
 * (the one-call decode step). The weight is laid out once at load (bf16_gemm.py's pack_panels) in
 * panels of 16 output columns, each a run of k/2 pairs: panel[b][p][c][e] = w[16 b + c][2 p + e],
 * with n padded to a multiple of 16 and k to a multiple of 32 by zeros. One 64-byte line of a panel
 * is the operand of one _mm512_dpbf16_ps (16 columns x one pair of k), and 16 lines are an AMX-BF16
 * B tile (16 pairs of k x 16 columns, the VNNI layout), so both paths read the same bytes.
 *
 * Why: a decode step reads every weight once; bf16 halves the bytes of float32 (SmolLM2: 270 MB ->
 * 135 MB a step), and the dot products run on the CPU's bf16 units (16 pairs an instruction, or a
 * 16 x 32 x 16 tile), where torch's bf16 F.linear at a few rows ran no faster than float32.
 *
 * Invariant: every path computes out[r][j] = bias[j] + sum_i bf16(x[r][i]) * w[j][i] in float32:
 * x rounded to bf16 (round to nearest even) once per call, each product exact in float32 (8-bit by
 * 8-bit mantissas), only the order of the float32 additions differs by path (pairs in k order per
 * lane on avx512_bf16 and portable; AMX's tile order inside 32 k). Each (r, j) is written by one
 * thread; threads split the panels (output columns) in contiguous runs, as skinny_gemm.c does.
 * Paths: 0 portable (bf16 -> float32 by a 16-bit shift, float32 multiply-adds; any CPU),
 * 1 avx512_bf16 (_mm512_dpbf16_ps), 2 amx (AMX-BF16 tiles; only after the process was granted the
 * tile state: cpu_features.py asks). A path this build lacks returns BF16_NO_PATH.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__) || defined(__AMX_BF16__)
#include <immintrin.h>
#endif

#define BF16_NO_PATH -1
#define BF16_NO_MEMORY -3
#define PANEL 16 /* output columns per panel */
#define KSTEP 32 /* k padded to this: one AMX tile row of bf16 */
#define MR 6     /* rows of x per register block (avx512_bf16: 6 x 4 accumulators of 32 registers) */
#define NC 4     /* panels per register block */

static inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

/* float32 -> bf16, round to nearest even (a NaN stays a quiet NaN), as torch's .to(torch.bfloat16). */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* x (m, k) float32 -> xb (m, kp) bf16, the padding zero. */
static void round_rows(const float *x, int64_t m, int64_t k, int64_t kp, uint16_t *xb) {
    for (int64_t r = 0; r < m; r++) {
        for (int64_t i = 0; i < k; i++) xb[r * kp + i] = to_bf16(x[r * k + i]);
        for (int64_t i = k; i < kp; i++) xb[r * kp + i] = 0;
    }
}

/* One finished 16-column tile of results (rows x 16, row stride ld floats) into out, bias added,
 * the columns past n dropped. */
static inline void write_block(const float *acc, int64_t ld, int rows, int64_t r0, int64_t j0, int64_t n,
                               const float *bias, float *out) {
    const int cols = n - j0 < PANEL ? (int)(n - j0) : PANEL;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            const float s = acc[r * ld + c];
            out[(r0 + r) * n + j0 + c] = bias != NULL ? s + bias[j0 + c] : s;
        }
}

/* ---- portable: the pair (even, odd) of a 32-bit word as two float32 by shifts, multiply-adds. ---- */
typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t u16x __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) void portable_block(const uint32_t *xp, int mr, int64_t kp2,
                                                                 const uint32_t *wp, int nc, int64_t r0,
                                                                 int64_t b0, int64_t n, const float *bias,
                                                                 float *out) {
    v16 acc[MR][NC];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++) acc[r][c] = (v16){0};
    for (int64_t p = 0; p < kp2; p++) {
        v16 we[NC], wo[NC];
        for (int c = 0; c < nc; c++) {
            u16x u;
            memcpy(&u, wp + ((b0 + c) * kp2 + p) * PANEL, sizeof u);
            const u16x e = u << 16, o = u & 0xffff0000u;
            memcpy(&we[c], &e, sizeof e);
            memcpy(&wo[c], &o, sizeof o);
        }
        for (int r = 0; r < mr; r++) {
            const uint32_t pair = xp[(r0 + r) * kp2 + p], pe = pair << 16, po = pair & 0xffff0000u;
            float xe, xo;
            memcpy(&xe, &pe, sizeof xe);
            memcpy(&xo, &po, sizeof xo);
            for (int c = 0; c < nc; c++) {
                acc[r][c] = acc[r][c] + xo * wo[c]; /* the odd term first, as vdpbf16ps adds them */
                acc[r][c] = acc[r][c] + xe * we[c];
            }
        }
    }
    for (int c = 0; c < nc; c++) {
        float tile[MR * PANEL];
        for (int r = 0; r < mr; r++) memcpy(tile + r * PANEL, &acc[r][c], sizeof acc[r][c]);
        write_block(tile, PANEL, mr, r0, (b0 + c) * PANEL, n, bias, out);
    }
}

#if defined(__AVX512BF16__)
/* ---- avx512_bf16: one vdpbf16ps takes a line of a panel against a pair of x broadcast. ---- */
static inline __attribute__((always_inline)) void dp_block(const uint32_t *xp, int mr, int64_t kp2,
                                                           const uint32_t *wp, int nc, int64_t r0, int64_t b0,
                                                           int64_t n, const float *bias, float *out) {
    __m512 acc[MR][NC];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kp2; p++) {
        __m512bh w[NC];
        for (int c = 0; c < nc; c++) {
            const uint32_t *line = wp + ((b0 + c) * kp2 + p) * PANEL;
            w[c] = (__m512bh)_mm512_loadu_si512(line);
            _mm_prefetch((const char *)(line + 8 * PANEL), _MM_HINT_T0);
        }
        for (int r = 0; r < mr; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[(r0 + r) * kp2 + p]);
            for (int c = 0; c < nc; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, w[c]);
        }
    }
    for (int c = 0; c < nc; c++) {
        float tile[MR * PANEL];
        for (int r = 0; r < mr; r++) _mm512_storeu_ps(tile + r * PANEL, acc[r][c]);
        write_block(tile, PANEL, mr, r0, (b0 + c) * PANEL, n, bias, out);
    }
}
#endif

typedef void block_fn(const uint32_t *, int, int64_t, const uint32_t *, int, int64_t, int64_t, int64_t,
                      const float *, float *);

/* Panels [b0, b0 + nc) against every row of x, MR rows at a time; mr and nc constants after inlining. */
#define ROWS_OVER(NAME, BLOCK)                                                                                 \
    static void NAME(const uint32_t *xp, int64_t m, int64_t kp2, const uint32_t *wp, int nc, int64_t b0,      \
                     int64_t n, const float *bias, float *out) {                                               \
        int64_t r0 = 0;                                                                                        \
        for (; r0 + MR <= m; r0 += MR)                                                                         \
            if (nc == NC) BLOCK(xp, MR, kp2, wp, NC, r0, b0, n, bias, out);                                    \
            else BLOCK(xp, MR, kp2, wp, 1, r0, b0, n, bias, out);                                              \
        switch ((int)(m - r0) * 8 + (nc == NC ? NC : 1)) {                                                     \
        case 5 * 8 + NC: BLOCK(xp, 5, kp2, wp, NC, r0, b0, n, bias, out); break;                              \
        case 4 * 8 + NC: BLOCK(xp, 4, kp2, wp, NC, r0, b0, n, bias, out); break;                              \
        case 3 * 8 + NC: BLOCK(xp, 3, kp2, wp, NC, r0, b0, n, bias, out); break;                              \
        case 2 * 8 + NC: BLOCK(xp, 2, kp2, wp, NC, r0, b0, n, bias, out); break;                              \
        case 1 * 8 + NC: BLOCK(xp, 1, kp2, wp, NC, r0, b0, n, bias, out); break;                              \
        case 5 * 8 + 1: BLOCK(xp, 5, kp2, wp, 1, r0, b0, n, bias, out); break;                                \
        case 4 * 8 + 1: BLOCK(xp, 4, kp2, wp, 1, r0, b0, n, bias, out); break;                                \
        case 3 * 8 + 1: BLOCK(xp, 3, kp2, wp, 1, r0, b0, n, bias, out); break;                                \
        case 2 * 8 + 1: BLOCK(xp, 2, kp2, wp, 1, r0, b0, n, bias, out); break;                                \
        case 1 * 8 + 1: BLOCK(xp, 1, kp2, wp, 1, r0, b0, n, bias, out); break;                                \
        default: break;                                                                                        \
        }                                                                                                      \
    }

ROWS_OVER(portable_rows, portable_block)
#if defined(__AVX512BF16__)
ROWS_OVER(dp_rows, dp_block)
#endif

typedef void rows_fn(const uint32_t *, int64_t, int64_t, const uint32_t *, int, int64_t, int64_t, const float *,
                     float *);

/* Panels in groups of NC (the last few one at a time), the groups split over the threads. */
static void vector_linear(rows_fn *rows, const uint32_t *xp, int64_t m, int64_t kp2, const uint32_t *wp,
                          int64_t panels, int64_t n, const float *bias, float *out, int num_threads) {
    const int64_t groups = panels / NC;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t g = 0; g < groups; g++) rows(xp, m, kp2, wp, NC, g * NC, n, bias, out);
    for (int64_t b = groups * NC; b < panels; b++) rows(xp, m, kp2, wp, 1, b, n, bias, out);
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
/* ---- amx: C tiles 0-3 (two row blocks x two panels), A tiles 4-5, B tiles 6-7. ---- */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void configure(int m0, int m1) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const int rows[8] = {m0, m0, m1, m1, m0, m1, KSTEP / 2, KSTEP / 2};
    for (int t = 0; t < 8; t++)
        if (rows[t] > 0) {
            cfg.rows[t] = (uint8_t)rows[t];
            cfg.colsb[t] = 64;
        }
    _tile_loadconfig(&cfg);
}

/* Rows [r0, r0 + m0 + m1) of x against panels b0 (and b0 + 1 where two): 32 k a step. */
static void amx_block(const uint16_t *xb, int64_t kp, const uint16_t *wp, int64_t r0, int m0, int m1,
                      int64_t b0, int two, int64_t n, const float *bias, float *out) {
    const uint16_t *w0 = wp + b0 * kp * PANEL, *w1 = w0 + kp * PANEL, *x0 = xb + r0 * kp, *x1 = x0 + 16 * kp;
    const int64_t xs = kp * 2;
    _tile_zero(0);
    _tile_zero(1);
    if (m1 > 0) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t i = 0; i < kp; i += KSTEP) {
        _tile_loadd(4, x0 + i, xs);
        _tile_loadd(6, w0 + i * PANEL, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
            _tile_loadd(7, w1 + i * PANEL, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (m1 > 0) {
            _tile_loadd(5, x1 + i, xs);
            _tile_dpbf16ps(2, 5, 6);
            if (two) _tile_dpbf16ps(3, 5, 7);
        }
    }
    float tile[16 * PANEL];
    _tile_stored(0, tile, 64);
    write_block(tile, PANEL, m0, r0, b0 * PANEL, n, bias, out);
    if (two) {
        _tile_stored(1, tile, 64);
        write_block(tile, PANEL, m0, r0, (b0 + 1) * PANEL, n, bias, out);
    }
    if (m1 > 0) {
        _tile_stored(2, tile, 64);
        write_block(tile, PANEL, m1, r0 + 16, b0 * PANEL, n, bias, out);
        if (two) {
            _tile_stored(3, tile, 64);
            write_block(tile, PANEL, m1, r0 + 16, (b0 + 1) * PANEL, n, bias, out);
        }
    }
}

/* Pairs of panels split over the threads in chunks; each thread configures its own tiles (per thread
 * state). Past one block of 32 rows, a chunk of up to AMX_CHUNK pairs meets every row block in turn:
 * its B tiles stay in L2 while a block's rows of x (32 x k bf16) stay in L1 (one pair at a time
 * re-read all of x from L2 for each pair: 1.7x slower than oneDNN at 256 rows). */
#define AMX_CHUNK 8
static void amx_linear(const uint16_t *xb, int64_t m, int64_t kp, const uint16_t *wp, int64_t panels, int64_t n,
                       const float *bias, float *out, int num_threads) {
    const int64_t pairs = (panels + 1) / 2, per_thread = (pairs + num_threads - 1) / num_threads;
    const int64_t chunk = m <= 32 ? 1 : (per_thread < AMX_CHUNK ? per_thread : AMX_CHUNK);
    const int64_t chunks = (pairs + chunk - 1) / chunk;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        int cm0 = -1, cm1 = -1;
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++)
            for (int64_t r0 = 0; r0 < m; r0 += 32) {
                const int m0 = m - r0 < 16 ? (int)(m - r0) : 16;
                const int m1 = m - r0 - 16 <= 0 ? 0 : (m - r0 - 16 < 16 ? (int)(m - r0 - 16) : 16);
                if (m0 != cm0 || m1 != cm1) {
                    configure(m0, m1);
                    cm0 = m0;
                    cm1 = m1;
                }
                const int64_t end = (c + 1) * chunk < pairs ? (c + 1) * chunk : pairs;
                for (int64_t g = c * chunk; g < end; g++)
                    amx_block(xb, kp, wp, r0, m0, m1, 2 * g, 2 * g + 1 < panels, n, bias, out);
            }
        if (cm0 >= 0) _tile_release();
    }
}
#endif

/* The paths this build has, as a bit mask (bit 0 portable, 1 avx512_bf16, 2 amx). */
int bf16_paths(void) {
    int mask = 1;
#if defined(__AVX512BF16__)
    mask |= 2;
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    mask |= 4;
#endif
    return mask;
}

/* x (m, k) float32 rows contiguous; wp the panels of w (n, k) (the header); bias (n,) or NULL; out
 * (m, n) float32. Returns 0, BF16_NO_PATH (path not in this build) or BF16_NO_MEMORY. */
int bf16_linear(const float *x, int64_t m, int64_t k, const uint16_t *wp, int64_t n, const float *bias,
                float *out, int num_threads, int path) {
    if (num_threads < 1) num_threads = 1;
    if (((bf16_paths() >> path) & 1) == 0 || path < 0) return BF16_NO_PATH;
    if (m <= 0 || n <= 0) return 0;
    const int64_t kp = round_up(k, KSTEP), panels = round_up(n, PANEL) / PANEL;
    uint16_t *xb = aligned_alloc(64, (size_t)round_up(m * kp * 2, 64));
    if (xb == NULL) return BF16_NO_MEMORY;
    round_rows(x, m, k, kp, xb);
    const uint32_t *xp = (const uint32_t *)xb, *wq = (const uint32_t *)wp;
    if (path == 0) vector_linear(portable_rows, xp, m, kp / 2, wq, panels, n, bias, out, num_threads);
#if defined(__AVX512BF16__)
    if (path == 1) vector_linear(dp_rows, xp, m, kp / 2, wq, panels, n, bias, out, num_threads);
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (path == 2) amx_linear(xb, m, kp, wp, panels, n, bias, out, num_threads);
#endif
    free(xb);
    return 0;
}
