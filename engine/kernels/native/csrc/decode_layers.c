/* Every decoder layer of a decode step in one call: the per-op path of engine/model/llama.py, in C.
 *
 * Where it sits: kvfleet/engine/kernels/decode_layers.py calls decode_layers_f32 through ctypes
 * from LlamaForCausalLM.forward for a step whose rows all decode (one new token per sequence), in
 * float32 on the CPU, without LoRA; the embedding, the final norm and the LM head stay in torch.
 * A matmul's weight is float32 (native panels or row-major); for a model served with
 * --quantization gguf, GGUF blocks repacked by quant_pack.c, multiplied by quant_gemm.c's
 * quant_linear; for --quantization int8, per-channel int8 rows and their scales, multiplied by
 * int8_gemm.c's int8_linear; each on the path the Python side chose (the per-op path's own call,
 * same arguments).
 *
 * Why: at a few rows a layer's work is small (SmolLM2 at one row: 14 MB of weights a layer, about
 * half a millisecond of memory), and the per-op path pays Python and torch's dispatch for each of
 * its ten ops: the one call made a one-row step 1.41x faster, 8 rows 1.29x, 32 rows 1.18x
 * (bench/kernels/decode_step.py, bench/results/decode_step.txt). Same kernels, back to back from C.
 *
 * Invariant: the result is the per-op path's, bit for bit: the same functions (add_rms_norm_f32,
 * packed_linear_f32, skinny_linear_f32, quant_linear or int8_linear, rope_f32, paged_decode_f32, silu_mul_f32 of this
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
int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                     int64_t table_stride, const int32_t *seq_lens, const int32_t *query_start,
                     const int64_t *seqs, int64_t num_seqs, float *out, int H, int KVH, int D, int block_size,
                     float scale, int window, int num_threads);

/* One layer's operands. Weights: with type 0, packed_gemm.c panels when the step's `packed`, else
 * (n, k) row-major float32; with a ggml type (qkv_type.. down_type), quant_pack.c's repacked blocks;
 * with INT8_CHANNEL, (n, k) int8 rows whose scales are qkv_scale.. down_scale. A bias may be NULL.
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
    int32_t qkv_type, o_type, gate_up_type, down_type; /* 0: float32; a ggml type; or INT8_CHANNEL */
    const float *qkv_scale, *o_scale, *gate_up_scale, *down_scale; /* INT8_CHANNEL's (n,) scales */
} decode_layer;
#define INT8_CHANNEL 256 /* not a ggml type: int8_gemm.c's per-channel int8 */

/* The step: its shapes, its per-row inputs and its scratch (each buffer rows x its width). */
typedef struct {
    int64_t rows, hidden, heads, kv_heads, head_dim, intermediate, table_stride;
    int32_t block_size, packed, threads;
    float eps;
    int32_t quant_path; /* quant_linear's / int8_linear's path: 0 portable, 1 AVX2, 2 AVX-512 VNNI */
    const float *cos, *sin;                                  /* (rows, head_dim) */
    const int64_t *slots, *seqs;                             /* (rows,): cache slot; sequence ids 0.. */
    const int32_t *block_tables, *seq_lens, *query_start;    /* as paged_decode_f32 takes them */
    float *h, *o, *qkv, *q, *attn, *gate_up, *act;           /* hidden, hidden, qkv, q, q, 2 x inter, inter */
} decode_step;

/* Returns 0, or QUANT_FAILED - the quantised kernel's (negative) status. */
#define QUANT_FAILED 100
static int matmul(const decode_step *s, const float *x, int64_t k, const void *w, int type, const float *scale,
                  int64_t n, const float *bias, float *out) {
    int rc = 0;
    if (type == INT8_CHANNEL)
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

/* Layer l of the step: x the previous layer's MLP output (NULL for layer 0), residual the stream. */
static int layer_step(const decode_step *s, const decode_layer *l, const float *x_in, float *x, float *residual) {
    const int64_t T = s->rows, hd = s->hidden, H = s->heads, KV = s->kv_heads, D = s->head_dim;
    const int64_t inter = s->intermediate;
    int rc;
    add_rms_norm_f32(x_in, residual, l->input_norm, s->h, T, hd, s->eps, s->threads);
    rc = matmul(s, s->h, hd, l->qkv, l->qkv_type, l->qkv_scale, (H + 2 * KV) * D, l->qkv_bias, s->qkv);
    if (rc != 0) return rc;
    rotate_and_store(s, l);
    rc = paged_decode_f32(s->q, l->k_cache, l->v_cache, s->block_tables, s->table_stride, s->seq_lens,
                          s->query_start, s->seqs, T, s->attn, (int)H, (int)KV, (int)D, s->block_size, l->scale,
                          l->window, s->threads);
    if (rc != 0) return rc;
    rc = matmul(s, s->attn, H * D, l->o, l->o_type, l->o_scale, hd, l->o_bias, s->o);
    if (rc != 0) return rc;
    add_rms_norm_f32(s->o, residual, l->post_norm, s->h, T, hd, s->eps, s->threads);
    rc = matmul(s, s->h, hd, l->gate_up, l->gate_up_type, l->gate_up_scale, 2 * inter, l->gate_up_bias, s->gate_up);
    if (rc != 0) return rc;
    silu_mul_f32(s->gate_up, s->act, T, inter, s->threads);
    return matmul(s, s->act, inter, l->down, l->down_type, l->down_scale, hd, l->down_bias, x);
}

/* x (rows, hidden): the embedding in, the last layer's MLP output out; residual (rows, hidden):
 * scratch in, the residual stream before that output out. Returns 0, paged_decode_f32's status
 * (2: no memory for the scores), or QUANT_FAILED - a quantised kernel's status. */
int decode_layers_f32(const decode_step *s, const decode_layer *layers, int64_t num_layers, float *x,
                      float *residual) {
    memcpy(residual, x, (size_t)(s->rows * s->hidden) * sizeof(float));
    for (int64_t i = 0; i < num_layers; i++) {
        const int rc = layer_step(s, layers + i, i == 0 ? NULL : x, x, residual);
        if (rc != 0) return rc;
    }
    return 0;
}
