/* Paged decode attention on CPU (fp32): one query token per sequence, read against that
 * sequence's K/V blocks where they lie in the pool. No gather, no padding, no mask.
 *
 * Loaded by quire_engine/kernels/native.py (compiled on first use, cached per machine) and called
 * by CpuAttentionPlan for the decode rows of a step, once per layer. The semantics are those of
 * paged_attention_reference for a one-token query: the query at position len - 1 sees keys
 * 0 .. len - 1, or with a sliding window W > 0 keys max(0, len - W) .. len - 1 (blocks wholly
 * before that are never read: a windowed model releases them); with a soft-cap c > 0 the scores
 * are c * tanh(scale * q.k / c). Results match it to rounding, not bit for bit (another
 * summation order).
 *
 * Layouts (all fp32 except the index arrays):
 *   q        [T, heads, D], row stride q_tok, head stride q_head, D contiguous
 *   k, v     [num_blocks, block_size, kv_heads, D] contiguous (the runner's pools)
 *   rows     int64 [n]: the query/output row of each sequence
 *   tables   int32 [n, table_stride]: block ids, the first ceil(len / block_size) used
 *   lens     int64 [n]: context length including the step's token (>= 1)
 *   window   0: none; softcap 0: none
 *   out      [T, heads, D] contiguous; only the n rows are written
 *
 * Grouped-query attention: query head hq reads KV head hq / (heads / kv_heads), as transformers'
 * repeat_kv maps them. A sequence is computed by one thread from start to end, in an order that
 * depends only on its own data, so its output is the same bits whatever the batch around it and
 * whatever the thread count.
 *
 * The caller (native.py) checks dtypes, shapes and strides; the plan checks that every block id
 * is inside the pool and every length inside its table. Returns 0, or 1 when scratch memory
 * could not be allocated (nothing is written then for the rows of the failing thread).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quire_native.h"

/* Hardware prefetchers stop at page boundaries, and the next block of a sequence is anywhere in
 * the pool: without help every block starts with cache misses. While the kernel works on a
 * group of tokens of one block, it prefetches the same tokens of the sequence's next block
 * (`count` floats from `p`, one request per 64-byte line). */
static inline void prefetch_floats(const float *p, int64_t count)
{
#if defined(__GNUC__)
    for (int64_t i = 0; i < count; i += 16)
        __builtin_prefetch(p + i, 0, 3);
#else
    (void)p;
    (void)count;
#endif
}

/* Block b of a sequence whose visible positions are first .. len - 1: its tokens lo .. hi - 1
 * are visible, token j has score index base - first + j, and `next` is the start of the
 * sequence's next block in `pool` (NULL after the last one, for the prefetch). */
struct span {
    int64_t lo, hi, off;
    const float *block, *next;
};

static inline struct span block_span(const float *pool, const int32_t *table, int64_t b,
                                     int64_t first, int64_t len, int64_t block_size,
                                     int64_t token_stride)
{
    const int64_t base = b * block_size;
    const int64_t block_floats = block_size * token_stride;
    struct span sp;
    sp.lo = base < first ? first - base : 0;
    sp.hi = len - base < block_size ? len - base : block_size;
    sp.off = base - first; /* >= -lo, so off + j >= 0 for every visible j */
    sp.block = pool + (int64_t)table[b] * block_floats;
    sp.next = base + block_size < len ? pool + (int64_t)table[b + 1] * block_floats : NULL;
    return sp;
}

static void decode_one(const float *q, int64_t q_head, const float *k, const float *v,
                       const int32_t *table, int64_t len, int64_t first, int64_t block_size,
                       int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,
                       float softcap, float *out, float *scores, float *row_max, float *row_sum,
                       const int64_t *kv_of)
{
    const int64_t token_stride = kv_heads * head_dim; /* floats between two tokens of a block */
    const int64_t n = len - first;                     /* visible positions first .. len - 1 */
    /* With a soft-cap the scores are c * tanh(scale * q.k / c) (transformers' order). */
    const float pre = softcap > 0.0f ? scale / softcap : scale;

    /* Pass 1: scores[hq][t - first] = pre * q_hq . k_t, block by block. A block holds every KV
     * head of its tokens contiguously ([block_size, kv_heads, D]), so it is read front to back.
     * Blocks wholly before `first` are never touched (a windowed model may have released them). */
    for (int64_t b = first / block_size; b * block_size < len; b++) {
        const struct span sp = block_span(k, table, b, first, len, block_size, token_stride);
        const int64_t hi = sp.hi, off = sp.off;
        const float *kb = sp.block, *kn = sp.next;
        int64_t j = sp.lo;
        /* Four tokens at a time: four independent accumulators keep the vector unit busy
         * (one dot's additions are a dependency chain). */
        for (; j + 4 <= hi; j += 4) {
            const float *kt = kb + j * token_stride;
            if (kn != NULL)
                prefetch_floats(kn + j * token_stride, 4 * token_stride);
            for (int64_t hq = 0; hq < heads; hq++) {
                const float *qh = q + hq * q_head;
                const float *k0 = kt + kv_of[hq];
                const float *k1 = k0 + token_stride, *k2 = k1 + token_stride;
                const float *k3 = k2 + token_stride;
                float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
                for (int64_t d = 0; d < head_dim; d++) {
                    d0 += qh[d] * k0[d];
                    d1 += qh[d] * k1[d];
                    d2 += qh[d] * k2[d];
                    d3 += qh[d] * k3[d];
                }
                float *row = scores + hq * n + off + j;
                row[0] = d0 * pre;
                row[1] = d1 * pre;
                row[2] = d2 * pre;
                row[3] = d3 * pre;
            }
        }
        for (; j < hi; j++) {
            const float *kt = kb + j * token_stride;
            if (kn != NULL)
                prefetch_floats(kn + j * token_stride, token_stride);
            for (int64_t hq = 0; hq < heads; hq++) {
                const float *qh = q + hq * q_head;
                const float *kh = kt + kv_of[hq];
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; d++)
                    dot += qh[d] * kh[d];
                scores[hq * n + off + j] = dot * pre;
            }
        }
    }
    if (softcap > 0.0f)
        for (int64_t i = 0; i < heads * n; i++)
            scores[i] = softcap * tanhf(scores[i]);
    for (int64_t hq = 0; hq < heads; hq++) {
        const float *p = scores + hq * n;
        float m = -INFINITY;
        for (int64_t t = 0; t < n; t++)
            m = p[t] > m ? p[t] : m;
        row_max[hq] = m;
    }
    /* Softmax numerators in place; the division waits for the end (one per output element). */
    for (int64_t hq = 0; hq < heads; hq++) {
        float *p = scores + hq * n;
        const float m = row_max[hq];
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; t++) {
            p[t] = exp_nonpositive(p[t] - m);
            sum += p[t];
        }
        row_sum[hq] = sum;
    }
    /* Pass 2: out_hq = sum_t p[hq][t] v_t / sum_t p[hq][t], the same block order. */
    memset(out, 0, sizeof(float) * (size_t)(heads * head_dim));
    for (int64_t b = first / block_size; b * block_size < len; b++) {
        const struct span sp = block_span(v, table, b, first, len, block_size, token_stride);
        const int64_t hi = sp.hi, off = sp.off;
        const float *vb = sp.block, *vn = sp.next;
        int64_t j = sp.lo;
        /* Four tokens per pass over the output row: a quarter of the loads and stores of it. */
        for (; j + 4 <= hi; j += 4) {
            const float *vt = vb + j * token_stride;
            if (vn != NULL)
                prefetch_floats(vn + j * token_stride, 4 * token_stride);
            for (int64_t hq = 0; hq < heads; hq++) {
                const float *p = scores + hq * n + off + j;
                const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];
                const float *v0 = vt + kv_of[hq];
                const float *v1 = v0 + token_stride, *v2 = v1 + token_stride;
                const float *v3 = v2 + token_stride;
                float *o = out + hq * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++)
                    o[d] += (p0 * v0[d] + p1 * v1[d]) + (p2 * v2[d] + p3 * v3[d]);
            }
        }
        for (; j < hi; j++) {
            const float *vt = vb + j * token_stride;
            if (vn != NULL)
                prefetch_floats(vn + j * token_stride, token_stride);
            for (int64_t hq = 0; hq < heads; hq++) {
                const float p = scores[hq * n + off + j];
                const float *vh = vt + kv_of[hq];
                float *o = out + hq * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++)
                    o[d] += p * vh[d];
            }
        }
    }
    for (int64_t hq = 0; hq < heads; hq++) {
        const float inv = 1.0f / row_sum[hq];
        float *o = out + hq * head_dim;
        for (int64_t d = 0; d < head_dim; d++)
            o[d] *= inv;
    }
}

int quire_paged_decode(const float *q, int64_t q_tok, int64_t q_head, const float *k,
                       const float *v, const int64_t *rows, const int32_t *tables,
                       int64_t table_stride, const int64_t *lens, int64_t n, int64_t block_size,
                       int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,
                       int64_t window, float softcap, float *out, int64_t num_threads)
{
    int64_t max_len = 1;
    for (int64_t s = 0; s < n; s++)
        if (lens[s] > max_len)
            max_len = lens[s];
    /* kv_of[hq]: the offset of query head hq's KV head inside a token (no division in the
     * inner loops). */
    int64_t *kv_of = malloc(sizeof(int64_t) * (size_t)heads);
    if (kv_of == NULL)
        return 1;
    for (int64_t hq = 0; hq < heads; hq++)
        kv_of[hq] = hq / (heads / kv_heads) * head_dim;
    int failed = 0;
    /* Threads split sequences, never one sequence: see the header on determinism. Scratch per
     * thread: heads x max_len scores, then each head's running max and sum. */
#pragma omp parallel num_threads(num_threads > 1 ? (int)num_threads : 1) if (num_threads > 1 && n > 1)
    {
        float *scores = malloc(sizeof(float) * (size_t)(heads * (max_len + 2)));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < n; s++) {
            if (scores == NULL)
                continue;
            const int64_t len = lens[s];
            const int64_t first = window > 0 && len > window ? len - window : 0;
            decode_one(q + rows[s] * q_tok, q_head, k, v, tables + s * table_stride, len, first,
                       block_size, heads, kv_heads, head_dim, scale, softcap,
                       out + rows[s] * heads * head_dim, scores + 2 * heads, scores,
                       scores + heads, kv_of);
        }
        free(scores);
    }
    free(kv_of);
    return failed;
}
