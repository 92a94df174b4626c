/* One decode step of a Llama-shaped decoder stack on CPU (fp32 weights; a float32 or 8-bit KV
 * cache), every layer in one call.
 *
 * Contract. Loaded by quire_engine/cpu/native.py (DecoderDecode) and driven by cpu/decoder.py
 * (DecoderStack) for the steps where every sequence decodes one token and there are at most
 * decoder.MAX_ROWS (64) of them. The arguments are one struct quire_decoder_args (quire_native.h
 * states every field's layout, the ownership and who checks what); the layer table's fields are
 * matched by name at load (quire_layer_field_names) and the struct's by name and offset
 * (quire_decoder_arg_names/offsets), so a Python mirror that disagrees with this file refuses to
 * load instead of passing misplaced addresses.
 *
 * The layer is transformers' LlamaDecoderLayer, as Mistral and Qwen2 also use it (the caller
 * checks the module classes):
 *   x = rmsnorm(h) ; q, k, v = x Wq^T + bq, x Wk^T + bk, x Wv^T + bv ; q, k = rope(q), rope(k)
 *   cache[slot] = k, v ; a = paged_attention(q) ; h = h + (a Wo^T + bo)
 *   x = rmsnorm(h) ; h = h + (silu(x Wg^T) * (x Wu^T)) Wd^T
 * then logits = rmsnorm(h) Wlm^T. Every matmul is quire_skinny_linear and the attention is
 * quire_paged_decode, the kernels the module path calls for the same rows (its matmuls up to
 * 16 rows; above, the BLAS), so those parts give the same bits as there; RoPE and the residual
 * adds are the same float operations in the same order (no contraction into fused multiply-adds
 * there); RMSNorm's sum of squares and SiLU's exp differ from torch's by rounding (another
 * summation order, another exp). Each row is computed in an order that depends only on that row,
 * so a row's logits are the same bits whatever other rows share the step.
 *
 * An 8-bit cache (kv_kind other than QUIRE_KV_F32): each new token's K and V rows are
 * quantized as they are written (csrc/kv_quant.c, kernels/kv_quant.py's rule bit for bit: the
 * module path's write gives the same bytes and scales), with the layer's fixed scales when
 * kv_fixed is set, and the attention reads the 8-bit pools in place.
 *
 * Layout notes beyond the struct's: a pool is [num_blocks, block_size, kv_heads, head_dim]
 * contiguous, so a slot's K row is kv_heads * head_dim elements at slot * kv_heads * head_dim,
 * and in an 8-bit pool its kv_heads scales at slot * kv_heads of the scale pool;
 * cos/sin are read at row rope_rows[t] in place, so a table over positions (rope_rows = the
 * positions) needs no gather.
 *
 * Returns (also in quire_native.h): 0; 1 when scratch memory could not be allocated (then the
 * logits are not written, and some layers' K/V may be: the caller fails the step); 2 when
 * layer_fields is not QUIRE_LAYER_FIELDS (nothing is touched).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quire_native.h"

/* Bit-equality with torch's RoPE needs each product rounded on its own: no contraction of
 * a * b + c into a fused multiply-add there (GCC contracts across statements by default, clang
 * within one). Only for that function: elsewhere contraction is harmless and inlining across a
 * changed option set is not always allowed. */
#if defined(__clang__)
#define SEPARATE_ROUNDING_FN
#define SEPARATE_ROUNDING_BODY _Pragma("clang fp contract(off)")
#elif defined(__GNUC__)
#define SEPARATE_ROUNDING_FN __attribute__((optimize("fp-contract=off")))
#define SEPARATE_ROUNDING_BODY
#else
#define SEPARATE_ROUNDING_FN
#define SEPARATE_ROUNDING_BODY
#endif

#include <stddef.h>

/* The layer table's field names, by enum value (designated: a reordered enum keeps each name
 * with its value), for the loader's name-by-name check. */
const char *const quire_layer_field_names[QUIRE_LAYER_FIELDS] = {
    [F_INPUT_NORM] = "input_norm", [F_Q] = "q",
    [F_Q_BIAS] = "q_bias",         [F_K] = "k",
    [F_K_BIAS] = "k_bias",         [F_V] = "v",
    [F_V_BIAS] = "v_bias",         [F_O] = "o",
    [F_O_BIAS] = "o_bias",         [F_POST_NORM] = "post_norm",
    [F_GATE] = "gate",             [F_GATE_BIAS] = "gate_bias",
    [F_UP] = "up",                 [F_UP_BIAS] = "up_bias",
    [F_DOWN] = "down",             [F_DOWN_BIAS] = "down_bias",
    [F_K_CACHE] = "k_cache",       [F_V_CACHE] = "v_cache",
    [F_K_SCALE] = "k_scale",       [F_V_SCALE] = "v_scale",
};
const int64_t quire_layer_field_count = QUIRE_LAYER_FIELDS;

/* struct quire_decoder_args' fields, in declaration order, listed once: their names and
 * offsets are generated from this list. */
#define DECODER_ARGS(X)                                                                        \
    X(layers) X(layer_fields) X(num_layers) X(windows) X(scales) X(embed) X(final_norm)        \
    X(lm_head) X(lm_bias) X(vocab) X(hidden) X(heads) X(kv_heads) X(head_dim) X(inter) X(eps)  \
    X(block_size) X(kv_kind) X(kv_fixed) X(n) X(ids) X(cos) X(sin) X(rope_rows) X(slots) X(tables) X(table_stride)    \
    X(lens) X(logits) X(num_threads)
#define ARG_NAME(name) #name,
#define ARG_OFFSET(name) (int64_t) offsetof(struct quire_decoder_args, name),
const char *const quire_decoder_arg_names[] = {DECODER_ARGS(ARG_NAME)};
const int64_t quire_decoder_arg_offsets[] = {DECODER_ARGS(ARG_OFFSET)};
#undef ARG_OFFSET
#undef ARG_NAME
#undef DECODER_ARGS
#define COUNT(a) ((int64_t)(sizeof(a) / sizeof((a)[0])))
const int64_t quire_decoder_arg_count = COUNT(quire_decoder_arg_names);
const int64_t quire_decoder_args_size = (int64_t)sizeof(struct quire_decoder_args);
_Static_assert(COUNT(quire_decoder_arg_names) == COUNT(quire_decoder_arg_offsets),
               "one offset per argument name");
#undef COUNT

#define FIELD(row, f) ((float *)(intptr_t)(row)[f])

/* out = w * (x * (1 / sqrt(mean(x^2) + eps))), row by row: LlamaRMSNorm's operations, in its
 * order, for fp32. */
static void rms_norm(const float *x, const float *w, float eps, int64_t n, int64_t d, float *out)
{
    for (int64_t r = 0; r < n; r++) {
        const float *xr = x + r * d;
        float *o = out + r * d;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < d; i++)
            ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
#pragma omp simd
        for (int64_t i = 0; i < d; i++)
            o[i] = w[i] * (xr[i] * inv);
    }
}

/* v = v * cos + rotate_half(v) * sin for each of `heads` heads of one token (transformers'
 * apply_rotary_pos_emb: rotate_half(v) = cat(-v[D/2:], v[:D/2])). `tmp` holds D floats. */
static SEPARATE_ROUNDING_FN void rope(float *v, int64_t heads, int64_t d, const float *cos,
                                      const float *sin, float *tmp)
{
    SEPARATE_ROUNDING_BODY
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *vh = v + h * d;
        memcpy(tmp, vh, sizeof(float) * (size_t)d);
        for (int64_t i = 0; i < half; i++)
            vh[i] = tmp[i] * cos[i] + (-tmp[i + half]) * sin[i];
        for (int64_t i = half; i < d; i++)
            vh[i] = tmp[i] * cos[i] + tmp[i - half] * sin[i];
    }
}

/* g = silu(g) * u: silu(x) = x / (1 + exp(-x)), its exp taken of a non-positive argument on
 * either side of 0 (for x < 0 as x e / (e + 1) with e = exp(x)), so it never overflows. */
static void silu_mul(float *g, const float *u, int64_t count)
{
#pragma omp simd
    for (int64_t i = 0; i < count; i++) {
        const float x = g[i];
        const float e = exp_nonpositive(x < 0.0f ? x : -x);
        const float s = x < 0.0f ? x * e / (e + 1.0f) : x / (1.0f + e);
        g[i] = s * u[i];
    }
}

static void add_into(float *h, const float *y, int64_t count)
{
#pragma omp simd
    for (int64_t i = 0; i < count; i++)
        h[i] = h[i] + y[i];
}

int quire_decoder_decode(const struct quire_decoder_args *args)
{
    if (args->layer_fields != QUIRE_LAYER_FIELDS || args->kv_kind < QUIRE_KV_F32 ||
        args->kv_kind > QUIRE_KV_E5M2)
        return 2;
    const int64_t *layers = args->layers, *windows = args->windows;
    const float *scales = args->scales, *embed = args->embed, *final_norm = args->final_norm;
    const float *lm_head = args->lm_head, *lm_bias = args->lm_bias, *cos = args->cos;
    const float *sin = args->sin;
    const int64_t num_layers = args->num_layers, vocab = args->vocab, hidden = args->hidden;
    const int64_t heads = args->heads, kv_heads = args->kv_heads, head_dim = args->head_dim;
    const int64_t inter = args->inter, block_size = args->block_size, n = args->n;
    const int64_t table_stride = args->table_stride, num_threads = args->num_threads;
    const float eps = args->eps;
    const int64_t kind = args->kv_kind;
    const float *kv_fixed = args->kv_fixed;
    const int64_t *ids = args->ids, *rope_rows = args->rope_rows, *slots = args->slots;
    const int64_t *lens = args->lens;
    const int32_t *tables = args->tables;
    float *logits = args->logits;
    const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
    /* Scratch, per token: residual h, normed x (also each matmul's output before its add),
     * q, k, v, attention output, gate and up. */
    const int64_t per_token = 2 * hidden + 2 * q_width + 2 * kv_width + 2 * inter;
    /* 64-byte aligned (a cache line): malloc's 16 bytes would put every other vector load of
     * a row across two lines, and the few-row matmuls load x from here. aligned_alloc wants a
     * size that is a multiple of the alignment. */
    const size_t scratch_bytes = sizeof(float) * (size_t)(n * per_token + head_dim);
    float *scratch = aligned_alloc(64, (scratch_bytes + 63) / 64 * 64);
    int64_t *rows = malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
    if (scratch == NULL || rows == NULL) {
        free(scratch);
        free(rows);
        return 1;
    }
    float *h = scratch, *x = h + n * hidden, *q = x + n * hidden, *k = q + n * q_width;
    float *v = k + n * kv_width, *attn = v + n * kv_width, *gate = attn + n * q_width;
    float *up = gate + n * inter, *tmp = up + n * inter;
    for (int64_t t = 0; t < n; t++) {
        rows[t] = t;
        memcpy(h + t * hidden, embed + ids[t] * hidden, sizeof(float) * (size_t)hidden);
    }
    int failed = 0;
    for (int64_t l = 0; l < num_layers && !failed; l++) {
        const int64_t *row = layers + l * QUIRE_LAYER_FIELDS;
        rms_norm(h, FIELD(row, F_INPUT_NORM), eps, n, hidden, x);
        quire_skinny_linear(x, hidden, n, FIELD(row, F_Q), FIELD(row, F_Q_BIAS), q_width, hidden,
                            q, q_width, num_threads);
        quire_skinny_linear(x, hidden, n, FIELD(row, F_K), FIELD(row, F_K_BIAS), kv_width, hidden,
                            k, kv_width, num_threads);
        quire_skinny_linear(x, hidden, n, FIELD(row, F_V), FIELD(row, F_V_BIAS), kv_width, hidden,
                            v, kv_width, num_threads);
        char *k_cache = (char *)FIELD(row, F_K_CACHE), *v_cache = (char *)FIELD(row, F_V_CACHE);
        float *k_scale = FIELD(row, F_K_SCALE), *v_scale = FIELD(row, F_V_SCALE);
        /* 8-bit: the layer's fixed scales, or 0 (dynamic). */
        const float k_fixed = kv_fixed != NULL ? kv_fixed[2 * l] : 0.0f;
        const float v_fixed = kv_fixed != NULL ? kv_fixed[2 * l + 1] : 0.0f;
        for (int64_t t = 0; t < n; t++) {
            const float *c = cos + rope_rows[t] * head_dim;
            const float *s = sin + rope_rows[t] * head_dim;
            rope(q + t * q_width, heads, head_dim, c, s, tmp);
            rope(k + t * kv_width, kv_heads, head_dim, c, s, tmp);
            if (kind == QUIRE_KV_F32) {
                const size_t bytes = sizeof(float) * (size_t)kv_width;
                memcpy(k_cache + slots[t] * (int64_t)bytes, k + t * kv_width, bytes);
                memcpy(v_cache + slots[t] * (int64_t)bytes, v + t * kv_width, bytes);
            } else {
                quire_kv_quantize(k + t * kv_width, kv_heads, head_dim, kind, k_fixed,
                                  k_cache + slots[t] * kv_width, k_scale + slots[t] * kv_heads);
                quire_kv_quantize(v + t * kv_width, kv_heads, head_dim, kind, v_fixed,
                                  v_cache + slots[t] * kv_width, v_scale + slots[t] * kv_heads);
            }
        }
        failed = quire_paged_decode(q, q_width, head_dim, k_cache, v_cache, k_scale, v_scale,
                                    kind, rows, tables, table_stride, lens, n, block_size, heads,
                                    kv_heads, head_dim, scales[l], windows[l], 0.0f, attn,
                                    num_threads) != 0;
        quire_skinny_linear(attn, q_width, n, FIELD(row, F_O), FIELD(row, F_O_BIAS), hidden,
                            q_width, x, hidden, num_threads);
        add_into(h, x, n * hidden);
        rms_norm(h, FIELD(row, F_POST_NORM), eps, n, hidden, x);
        quire_skinny_linear(x, hidden, n, FIELD(row, F_GATE), FIELD(row, F_GATE_BIAS), inter,
                            hidden, gate, inter, num_threads);
        quire_skinny_linear(x, hidden, n, FIELD(row, F_UP), FIELD(row, F_UP_BIAS), inter, hidden,
                            up, inter, num_threads);
        silu_mul(gate, up, n * inter);
        quire_skinny_linear(gate, inter, n, FIELD(row, F_DOWN), FIELD(row, F_DOWN_BIAS), hidden,
                            inter, x, hidden, num_threads);
        add_into(h, x, n * hidden);
    }
    if (!failed) {
        rms_norm(h, final_norm, eps, n, hidden, x);
        quire_skinny_linear(x, hidden, n, lm_head, lm_bias, vocab, hidden, logits, vocab,
                            num_threads);
    }
    free(scratch);
    free(rows);
    return failed ? 1 : 0;
}
