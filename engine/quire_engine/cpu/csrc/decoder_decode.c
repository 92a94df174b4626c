/* One decode step of a Llama-shaped decoder stack on CPU (fp32), every layer in one call.
 *
 * Loaded by quire_engine/cpu/native.py and driven by cpu/decoder.py for the steps
 * where every sequence decodes one token and there are at most decoder_cpu.MAX_ROWS (64) of
 * them. Why: at a few rows a step streams every weight once and computes little, and the
 * module-by-module forward adds per-op dispatch (RMSNorm as seven tensor ops, RoPE as eight,
 * SiLU, residual adds, views, module calls), none of it arithmetic: this call takes 0.65x the
 * modules' step time at 1-4 sequences of the 32.5M Llama, 0.80-0.86x at 8-16. Here the step is
 * the weight stream, the attention and a few vector loops.
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
 * summation order, another exp).
 *
 * Layouts (fp32 unless stated):
 *   layers   int64 [num_layers, NUM_FIELDS]: addresses, in the enum's order below (0: no bias)
 *   windows  int64 [num_layers]: sliding window, 0 for none; scales [num_layers]: softmax scale
 *   embed    [vocab_rows, hidden]; final_norm [hidden]; lm_head [vocab, hidden]; lm_bias or NULL
 *   ids      int64 [n], each in 0 .. vocab_rows - 1 (checked by the caller)
 *   cos, sin [rope_rows_total, head_dim]: the model's rotary embedding, token t's at row
 *            rope_rows[t] (int64 [n], each inside the arrays: checked by the caller), so a
 *            table over positions is read in place (rope_rows = the positions)
 *   slots    int64 [n]: block_id * block_size + offset, the token's place in the K/V pools
 *   tables   int32 [n, table_stride]; lens int64 [n]: as quire_paged_decode takes them
 *   logits   [n, vocab]
 * A pool is [num_blocks, block_size, kv_heads, head_dim] contiguous, so a slot's K row is
 * kv_heads * head_dim floats at slot * kv_heads * head_dim.
 *
 * Returns 0; 1 when scratch memory could not be allocated (then the logits are not written,
 * and neither is every layer's K/V: the caller fails the step); 2 when num_fields is not
 * NUM_FIELDS (the caller's table and this file disagree; nothing is touched).
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

enum {
    F_INPUT_NORM,
    F_Q,
    F_Q_BIAS,
    F_K,
    F_K_BIAS,
    F_V,
    F_V_BIAS,
    F_O,
    F_O_BIAS,
    F_POST_NORM,
    F_GATE,
    F_GATE_BIAS,
    F_UP,
    F_UP_BIAS,
    F_DOWN,
    F_DOWN_BIAS,
    F_K_CACHE,
    F_V_CACHE,
    NUM_FIELDS
};

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

int quire_decoder_decode(const int64_t *layers, int64_t num_fields, int64_t num_layers,
                         const int64_t *windows, const float *scales, const float *embed,
                         const float *final_norm, const float *lm_head, const float *lm_bias,
                         int64_t vocab, int64_t hidden, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, int64_t inter, float eps, int64_t block_size, int64_t n,
                         const int64_t *ids, const float *cos, const float *sin,
                         const int64_t *rope_rows, const int64_t *slots, const int32_t *tables,
                         int64_t table_stride, const int64_t *lens, float *logits,
                         int64_t num_threads)
{
    if (num_fields != NUM_FIELDS)
        return 2;
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
        const int64_t *row = layers + l * NUM_FIELDS;
        rms_norm(h, FIELD(row, F_INPUT_NORM), eps, n, hidden, x);
        quire_skinny_linear(x, hidden, n, FIELD(row, F_Q), FIELD(row, F_Q_BIAS), q_width, hidden,
                            q, q_width, num_threads);
        quire_skinny_linear(x, hidden, n, FIELD(row, F_K), FIELD(row, F_K_BIAS), kv_width, hidden,
                            k, kv_width, num_threads);
        quire_skinny_linear(x, hidden, n, FIELD(row, F_V), FIELD(row, F_V_BIAS), kv_width, hidden,
                            v, kv_width, num_threads);
        float *k_cache = FIELD(row, F_K_CACHE), *v_cache = FIELD(row, F_V_CACHE);
        for (int64_t t = 0; t < n; t++) {
            const float *c = cos + rope_rows[t] * head_dim;
            const float *s = sin + rope_rows[t] * head_dim;
            rope(q + t * q_width, heads, head_dim, c, s, tmp);
            rope(k + t * kv_width, kv_heads, head_dim, c, s, tmp);
            memcpy(k_cache + slots[t] * kv_width, k + t * kv_width, sizeof(float) * kv_width);
            memcpy(v_cache + slots[t] * kv_width, v + t * kv_width, sizeof(float) * kv_width);
        }
        failed = quire_paged_decode(q, q_width, head_dim, k_cache, v_cache, rows, tables,
                                    table_stride, lens, n, block_size, heads, kv_heads, head_dim,
                                    scales[l], windows[l], 0.0f, attn, num_threads);
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
