/* Every decoder layer of a step in one call: the per-op path of engine/model/llama.py, in C.
 *
 * Where it sits: kvfleet/engine/kernels/decode_layers.py calls decode_layers_f32 through ctypes
 * from LlamaForCausalLM.forward for a step of decode rows and prompt chunks, in float32 on the CPU,
 * without LoRA (chunks only where the per-op path runs them on paged_prefill_f32 too); the embedding,
 * the final norm and the LM head stay in torch. The last layer takes its o projection and MLP at the
 * rows that sample only, as the per-op path does.
 * A matmul's weight is float32 (native panels or row-major); for a model served with
 * --quantization gguf, GGUF blocks repacked by quant_pack.c, multiplied by quant_gemm.c's
 * quant_linear; for --quantization int8, per-channel int8 rows and their scales, multiplied by
 * int8_gemm.c's int8_linear; for a bf16 model (--dtype bfloat16 on the CPU), bf16 panels, multiplied
 * by bf16_gemm.c's bf16_linear (AMX from BF16_AMX_MIN_ROWS rows, as bf16_gemm.py's path_for); each on
 * the path the Python side chose (the per-op path's own call, same arguments).
 *
 * Why: at a few rows a layer's work is small (SmolLM2 at one row: 14 MB of weights a layer, about
 * half a millisecond of memory), and the per-op path pays Python and torch's dispatch for each of
 * its ten ops: the one call made a one-row step 1.41x faster, 8 rows 1.29x, 32 rows 1.18x
 * (bench/kernels/decode_step.py, bench/results/decode_step.txt). Same kernels, back to back from C.
 * A step with prefill chunks pays the same dispatch, once per layer, beside its chunks' matmuls: a
 * stall-free step (decodes plus a chunk of 64-256 tokens) pays it every step.
 *
 * Invariant: the result is the per-op path's, bit for bit: the same functions (add_rms_norm_f32,
 * packed_linear_f32, skinny_linear_f32, quant_linear, int8_linear or bf16_linear, rope_f32, paged_decode_f32,
 * paged_prefill_f32, silu_mul_f32 of this
 * library) on the same operands in the same order, and K/V stored by copy as store_kv_reference
 * stores it. Layer i: h = norm(x + residual) (layer 0: norm(residual), the embedding); qkv = h W;
 * RoPE on the q and k heads; k, v into the cache at slots[t]; attention over the cache; residual
 * += attn W_o, h = norm(residual); x = (silu(h W_gate) * h W_up) W_down.
 */
#include <stdint.h>
#include <string.h>

void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t n,
                      float eps, int num_threads);
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t m, int num_threads);
void rope_f32(float *x, const float *cos_, const float *sin_, int64_t rows, int64_t row_stride, int heads, int D,
              int num_threads);
void skinny_linear_f32(const float *x, int64_t m, int64_t k, const float *w, int64_t n, const float *bias,
                       float *out, int num_threads);
void packed_linear_f32(const float *x, int64_t m, int64_t k, const float *wp, int64_t n, const float *bias,
                       float *out, int num_threads);
int quant_linear(const float *x, int64_t m, int64_t k, const uint8_t *packed, int64_t n, int t, const float *bias,
                 float *out, int num_threads, int path);
int int8_linear(const float *x, int64_t m, int64_t k, const int8_t *w, int64_t n, const float *scale,
                const float *bias, float *out, int num_threads, int path);
int bf16_linear(const float *x, int64_t m, int64_t k, const uint16_t *wp, int64_t n, const float *bias,
                float *out, int num_threads, int path);
int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                     int64_t table_stride, const int32_t *seq_lens, const int32_t *query_start,
                     const int64_t *seqs, int64_t num_seqs, float *out, int H, int KVH, int D, int block_size,
                     float scale, int window, int num_threads, const float *sinks);
int paged_prefill_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                      int64_t table_stride, const int32_t *seq_lens, const int32_t *query_start,
                      const int64_t *seqs, int64_t num_seqs, float *out, int H, int KVH, int D, int block_size,
                      float scale, int window, int num_threads, const float *sinks);

/* One layer's operands. Weights: with type 0, packed_gemm.c panels when the step's `packed`, else
 * (n, k) row-major float32; with a ggml type (qkv_type.. down_type), quant_pack.c's repacked blocks;
 * with INT8_CHANNEL, (n, k) int8 rows whose scales are qkv_scale.. down_scale; with BF16_PANELS,
 * bf16_gemm.c's panels of (n, k) bf16. A bias may be NULL.
 * Caches: (num_blocks, block_size, kv_heads, head_dim). */
typedef struct {
    const float *input_norm, *post_norm;
    const void *qkv;
    const float *qkv_bias;
    const void *o;
    const float *o_bias;
    const void *gate_up;
    const float *gate_up_bias;
    const void *down;
    const float *down_bias;
    float *k_cache, *v_cache;
    float scale;
    int32_t window; /* 0: no sliding window */
    int32_t qkv_type, o_type, gate_up_type, down_type; /* 0: float32; a ggml type; INT8_CHANNEL; BF16_PANELS */
    const float *qkv_scale, *o_scale, *gate_up_scale, *down_scale; /* INT8_CHANNEL's (n,) scales */
} decode_layer;
#define INT8_CHANNEL 256 /* not a ggml type: int8_gemm.c's per-channel int8 */
#define BF16_PANELS 257  /* not a ggml type: bf16_gemm.c's bf16 panels */
#define BF16_AVX512 1    /* bf16_linear's paths: 1 avx512_bf16, 2 amx */
#define BF16_AMX 2
#define BF16_AMX_MIN_ROWS 8 /* below this many rows AVX512-BF16 rather than AMX (bf16_gemm.py's AMX_MIN_ROWS) */

/* The step: its shapes, its per-row inputs and its scratch (each buffer rows x its width). */
typedef struct {
    int64_t rows, hidden, heads, kv_heads, head_dim, intermediate, table_stride;
    int32_t block_size, packed, threads;
    float eps;
    int32_t quant_path; /* quant_linear's / int8_linear's path: 0 portable, 1 AVX2, 2 AVX-512 VNNI;
                         * bf16_linear's: 0 portable, 1 avx512_bf16, 2 amx */
    const float *cos, *sin;                                  /* (rows, head_dim) */
    const int64_t *slots;                                    /* (rows,): each row's cache slot */
    const int64_t *seqs;                                     /* the decoding sequences' ids */
    const int32_t *block_tables, *seq_lens, *query_start;    /* as paged_decode_f32 takes them */
    float *h, *o, *qkv, *q, *attn, *gate_up, *act;           /* hidden, hidden, qkv, q, q, 2 x inter, inter */
    int64_t num_decode_seqs, num_prefill_seqs, num_keep;     /* num_keep: rows the last layer keeps */
    const int64_t *prefill_seqs;                             /* the sequences with a prompt chunk */
    const int64_t *keep;                                     /* ascending rows that sample; NULL: all */
} decode_step;

/* Returns 0, or QUANT_FAILED - the quantised kernel's (negative) status. */
#define QUANT_FAILED 100
static int matmul(const decode_step *s, const float *x, int64_t k, const void *w, int type, const float *scale,
                  int64_t n, const float *bias, float *out) {
    int rc = 0;
    if (type == BF16_PANELS) {
        const int path = s->quant_path == BF16_AMX && s->rows < BF16_AMX_MIN_ROWS ? BF16_AVX512 : s->quant_path;
        rc = bf16_linear(x, s->rows, k, (const uint16_t *)w, n, bias, out, s->threads, path);
    } else if (type == INT8_CHANNEL)
        rc = int8_linear(x, s->rows, k, (const int8_t *)w, n, scale, bias, out, s->threads, s->quant_path);
    else if (type != 0)
        rc = quant_linear(x, s->rows, k, (const uint8_t *)w, n, type, bias, out, s->threads, s->quant_path);
    else if (s->packed)
        packed_linear_f32(x, s->rows, k, (const float *)w, n, bias, out, s->threads);
    else
        skinny_linear_f32(x, s->rows, k, (const float *)w, n, bias, out, s->threads);
    return rc == 0 ? 0 : QUANT_FAILED - rc;
}

/* RoPE on the q and k heads of qkv, then k and v into the cache and q into its own rows. */
static void rotate_and_store(const decode_step *s, const decode_layer *l) {
    const int64_t H = s->heads, KV = s->kv_heads, D = s->head_dim, width = (H + 2 * KV) * D;
    rope_f32(s->qkv, s->cos, s->sin, s->rows, width, (int)(H + KV), (int)D, s->threads);
    const size_t kv_bytes = (size_t)(KV * D) * sizeof(float), q_bytes = (size_t)(H * D) * sizeof(float);
    for (int64_t t = 0; t < s->rows; t++) {
        const float *row = s->qkv + t * width;
        memcpy(l->k_cache + s->slots[t] * KV * D, row + H * D, kv_bytes);
        memcpy(l->v_cache + s->slots[t] * KV * D, row + (H + KV) * D, kv_bytes);
        memcpy(s->q + t * H * D, row, q_bytes);
    }
}

/* Attention over the cache: the decoding sequences on the decode kernel, the chunks on the prefill
 * kernel (disjoint rows of attn). Returns 0 or the kernel's status. */
static int attend(const decode_step *s, const decode_layer *l) {
    const int H = (int)s->heads, KV = (int)s->kv_heads, D = (int)s->head_dim;
    int rc = 0;
    if (s->num_decode_seqs > 0)
        rc = paged_decode_f32(s->q, l->k_cache, l->v_cache, s->block_tables, s->table_stride, s->seq_lens,
                              s->query_start, s->seqs, s->num_decode_seqs, s->attn, H, KV, D, s->block_size,
                              l->scale, l->window, s->threads, NULL);
    if (rc == 0 && s->num_prefill_seqs > 0)
        rc = paged_prefill_f32(s->q, l->k_cache, l->v_cache, s->block_tables, s->table_stride, s->seq_lens,
                               s->query_start, s->prefill_seqs, s->num_prefill_seqs, s->attn, H, KV, D,
                               s->block_size, l->scale, l->window, s->threads, NULL);
    return rc;
}

/* The rows keep[0..n) of attn and residual moved to rows 0..n (keep ascending: a row moves up only). */
static void keep_rows(const decode_step *s, float *residual) {
    const int64_t width = s->heads * s->head_dim, hd = s->hidden;
    for (int64_t j = 0; j < s->num_keep; j++) {
        const int64_t r = s->keep[j];
        if (r == j) continue;
        memmove(s->attn + j * width, s->attn + r * width, (size_t)width * sizeof(float));
        memmove(residual + j * hd, residual + r * hd, (size_t)hd * sizeof(float));
    }
}

/* Layer l of the step: x the previous layer's MLP output (NULL for layer 0), residual the stream;
 * last: past the attention only the rows that sample go on (s->keep), written to x's first rows. */
static int layer_step(const decode_step *s, const decode_layer *l, const float *x_in, float *x, float *residual,
                      int last) {
    const int64_t hd = s->hidden, H = s->heads, KV = s->kv_heads, D = s->head_dim;
    const int64_t inter = s->intermediate;
    int rc;
    add_rms_norm_f32(x_in, residual, l->input_norm, s->h, s->rows, hd, s->eps, s->threads);
    rc = matmul(s, s->h, hd, l->qkv, l->qkv_type, l->qkv_scale, (H + 2 * KV) * D, l->qkv_bias, s->qkv);
    if (rc != 0) return rc;
    rotate_and_store(s, l);
    rc = attend(s, l);
    if (rc != 0) return rc;
    decode_step kept = *s; /* the rows past the attention */
    if (last && s->keep != NULL) {
        keep_rows(s, residual);
        kept.rows = s->num_keep;
    }
    const int64_t T = kept.rows;
    rc = matmul(&kept, s->attn, H * D, l->o, l->o_type, l->o_scale, hd, l->o_bias, s->o);
    if (rc != 0) return rc;
    add_rms_norm_f32(s->o, residual, l->post_norm, s->h, T, hd, s->eps, s->threads);
    rc = matmul(&kept, s->h, hd, l->gate_up, l->gate_up_type, l->gate_up_scale, 2 * inter, l->gate_up_bias,
                s->gate_up);
    if (rc != 0) return rc;
    silu_mul_f32(s->gate_up, s->act, T, inter, s->threads);
    return matmul(&kept, s->act, inter, l->down, l->down_type, l->down_scale, hd, l->down_bias, x);
}

/* x (rows, hidden): the embedding in, the last layer's MLP output out; residual (rows, hidden):
 * scratch in, the residual stream before that output out (with s->keep: their first num_keep rows,
 * the rows that sample). Returns 0, an attention kernel's status (paged_decode_f32's 2 or
 * paged_prefill_f32's 1: no memory for their scratch), or QUANT_FAILED - a quantised kernel's status. */
int decode_layers_f32(const decode_step *s, const decode_layer *layers, int64_t num_layers, float *x,
                      float *residual) {
    memcpy(residual, x, (size_t)(s->rows * s->hidden) * sizeof(float));
    for (int64_t i = 0; i < num_layers; i++) {
        const int rc = layer_step(s, layers + i, i == 0 ? NULL : x, x, residual, i == num_layers - 1);
        if (rc != 0) return rc;
    }
    return 0;
}
