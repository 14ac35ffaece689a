/* Every decoder layer of a decode step in one call: the per-op path of engine/model/llama.py, in C.
 *
 * Where it sits: kvfleet/engine/kernels/decode_layers.py calls decode_layers_f32 through ctypes
 * from LlamaForCausalLM.forward for a step whose rows all decode (one new token per sequence), in
 * float32 on the CPU, without LoRA; the embedding, the final norm and the LM head stay in torch.
 * A matmul's weight is float32 (native panels or row-major) or, for a model served with
 * --quantization gguf, GGUF blocks repacked by quant_pack.c, multiplied by quant_gemm.c's
 * quant_linear on the path the Python side chose (the per-op path's own call, same arguments).
 *
 * Why: at a few rows a layer's work is small (SmolLM2 at one row: 14 MB of weights a layer, about
 * half a millisecond of memory), and the per-op path pays Python and torch's dispatch for each of
 * its ten ops: the one call made a one-row step 1.41x faster, 8 rows 1.29x, 32 rows 1.18x
 * (bench/kernels/decode_step.py, bench/results/decode_step.txt). Same kernels, back to back from C.
 *
 * Invariant: the result is the per-op path's, bit for bit: the same functions (add_rms_norm_f32,
 * packed_linear_f32, skinny_linear_f32 or quant_linear, rope_f32, paged_decode_f32, silu_mul_f32 of this
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
int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                     int64_t table_stride, const int32_t *seq_lens, const int32_t *query_start,
                     const int64_t *seqs, int64_t num_seqs, float *out, int H, int KVH, int D, int block_size,
                     float scale, int window, int num_threads);

/* One layer's operands. Weights: with type 0, packed_gemm.c panels when the step's `packed`, else
 * (n, k) row-major float32; with a ggml type (qkv_type.. down_type), quant_pack.c's repacked blocks.
 * A bias may be NULL. Caches: (num_blocks, block_size, kv_heads, head_dim). */
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
    int32_t qkv_type, o_type, gate_up_type, down_type; /* 0: float32; else the ggml type of the blocks */
} decode_layer;

/* The step: its shapes, its per-row inputs and its scratch (each buffer rows x its width). */
typedef struct {
    int64_t rows, hidden, heads, kv_heads, head_dim, intermediate, table_stride;
    int32_t block_size, packed, threads;
    float eps;
    int32_t quant_path; /* quant_linear's path for the quantised weights: 0 portable, 1 AVX2, 2 VNNI */
    const float *cos, *sin;                                  /* (rows, head_dim) */
    const int64_t *slots, *seqs;                             /* (rows,): cache slot; sequence ids 0.. */
    const int32_t *block_tables, *seq_lens, *query_start;    /* as paged_decode_f32 takes them */
    float *h, *o, *qkv, *q, *attn, *gate_up, *act;           /* hidden, hidden, qkv, q, q, 2 x inter, inter */
} decode_step;

/* Returns 0, or QUANT_FAILED - quant_linear's (negative) status. */
#define QUANT_FAILED 100
static int matmul(const decode_step *s, const float *x, int64_t k, const void *w, int type, int64_t n,
                  const float *bias, float *out) {
    if (type != 0) {
        const int rc = quant_linear(x, s->rows, k, (const uint8_t *)w, n, type, bias, out, s->threads, s->quant_path);
        return rc == 0 ? 0 : QUANT_FAILED - rc;
    }
    if (s->packed)
        packed_linear_f32(x, s->rows, k, (const float *)w, n, bias, out, s->threads);
    else
        skinny_linear_f32(x, s->rows, k, (const float *)w, n, bias, out, s->threads);
    return 0;
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

/* x (rows, hidden): the embedding in, the last layer's MLP output out; residual (rows, hidden):
 * scratch in, the residual stream before that output out. Returns 0, paged_decode_f32's status
 * (2: no memory for the scores), or QUANT_FAILED - quant_linear's status. */
int decode_layers_f32(const decode_step *s, const decode_layer *layers, int64_t num_layers, float *x,
                      float *residual) {
    const int64_t T = s->rows, hd = s->hidden, H = s->heads, KV = s->kv_heads, D = s->head_dim;
    const int64_t inter = s->intermediate;
    memcpy(residual, x, (size_t)(T * hd) * sizeof(float));
    int rc = 0;
    for (int64_t i = 0; i < num_layers && rc == 0; i++) {
        const decode_layer *l = layers + i;
        add_rms_norm_f32(i == 0 ? NULL : x, residual, l->input_norm, s->h, T, hd, s->eps, s->threads);
        if ((rc = matmul(s, s->h, hd, l->qkv, l->qkv_type, (H + 2 * KV) * D, l->qkv_bias, s->qkv)) != 0) break;
        rotate_and_store(s, l);
        rc = paged_decode_f32(s->q, l->k_cache, l->v_cache, s->block_tables, s->table_stride, s->seq_lens,
                              s->query_start, s->seqs, T, s->attn, (int)H, (int)KV, (int)D, s->block_size, l->scale,
                              l->window, s->threads);
        if (rc != 0) break;
        if ((rc = matmul(s, s->attn, H * D, l->o, l->o_type, hd, l->o_bias, s->o)) != 0) break;
        add_rms_norm_f32(s->o, residual, l->post_norm, s->h, T, hd, s->eps, s->threads);
        rc = matmul(s, s->h, hd, l->gate_up, l->gate_up_type, 2 * inter, l->gate_up_bias, s->gate_up);
        if (rc != 0) break;
        silu_mul_f32(s->gate_up, s->act, T, inter, s->threads);
        rc = matmul(s, s->act, inter, l->down, l->down_type, hd, l->down_bias, x);
    }
    return rc;
}
