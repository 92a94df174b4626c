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
 * Speed: at the 32.5M Llama's shapes (8 query heads, 4 KV heads, D 64, blocks of 16) a step's
 * K/V is far larger than the caches, and randomly placed 16 KB blocks read at 6-8 GB/s here with
 * no arithmetic at all (9-10 contiguous). Fused multiply-adds and eight independent dot chains
 * took the kernel from ~4 to ~5 GB/s; reading each block straight through, token by token (every
 * query head against its KV head's part of the row) instead of KV head by KV head in strided
 * pieces, to 6-7: 0.68-0.76x the time at 16-48 sequences of 250-400 tokens, 0.72-0.86x at one
 * of 800, the same output values (a C harness over 9 layers' pools with shuffled tables, best
 * of 15 alternating runs). With the K/V in cache it is slower (1.3-1.4x: pass 2's output rows
 * go through L1 per token), which a decode step's K/V never is. With AVX-512 (16 lanes, half the
 * instructions per row) the engine's native decode steps of 17-64 sequences took 0.93-0.96x the
 * time they took with this kernel at 8 lanes, the same at one (the matmuls at 16 lanes in both;
 * benchmarks/native_ab.py --rtol, Zen 5).
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
 * the pool: without help every block starts with cache misses. While the kernel reads a token's
 * row of one block, it prefetches the same row of the sequence's next block (`count` floats from
 * `p`, one request per 64-byte line). */
static inline void prefetch_floats(const float *p, int64_t count)
{
    for (int64_t i = 0; i < count; i += 16)
        prefetch_l2(p + i);
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

/* q_h . k for up to DOTS query heads h = h0 .. h0 + count - 1 of one token (q_h at q + (h - h0) *
 * q_head), head h against its KV head's part of the token's K row k, (h / group) * head_dim on:
 * lane l sums d = l, l + LANES, ... with fused multiply-adds, the lanes are added in lanes_sum's
 * order, then the tail d >= D - D % LANES, whatever the count. DOTS independent chains, because
 * one dot's multiply-adds are a dependency chain: with four, the latency of the multiply-add,
 * not its throughput, bound the pass. */
#define DOTS 8
static inline __attribute__((always_inline)) void head_dots(const float *q, int64_t q_head,
                                                            const float *k, int64_t head_dim,
                                                            int64_t h0, int64_t group,
                                                            const int count, float *dot)
{
    const int64_t d_vec = head_dim - head_dim % LANES;
    const float *kh[DOTS];
    vec acc[DOTS];
#pragma GCC unroll 8
    for (int t = 0; t < count; t++) {
        acc[t] = (vec){0};
        kh[t] = k + ((h0 + t) / group) * head_dim;
    }
    for (int64_t d = 0; d < d_vec; d += LANES) {
#pragma GCC unroll 8
        for (int t = 0; t < count; t++)
            acc[t] = vec_madd(acc[t], vec_load(q + t * q_head + d), vec_load(kh[t] + d));
    }
    lanes_sums(acc, count, dot);
    for (int t = 0; t < count; t++)
        for (int64_t d = d_vec; d < head_dim; d++)
            dot[t] += q[t * q_head + d] * kh[t][d];
}

static void decode_one(const float *q, int64_t q_head, const float *k, const float *v,
                       const int32_t *table, int64_t len, int64_t first, int64_t block_size,
                       int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,
                       float softcap, float *out, float *scores, float *row_max, float *row_sum)
{
    const int64_t token_stride = kv_heads * head_dim; /* floats between two tokens of a block */
    const int64_t n = len - first;                     /* visible positions first .. len - 1 */
    const int64_t group = heads / kv_heads;            /* query heads per KV head */
    /* With a soft-cap the scores are c * tanh(scale * q.k / c) (transformers' order). */
    const float pre = softcap > 0.0f ? scale / softcap : scale;

    /* Pass 1: scores[hq][t - first] = pre * q_hq . k_t, block by block. A block holds every KV
     * head of its tokens contiguously ([block_size, kv_heads, D]), and it is read in that order,
     * token by token, every query head against its KV head's part of the token's row: the reads
     * run straight through the block, as the hardware prefetcher follows them. (KV head by KV
     * head over groups of tokens, as before, read each row in four strided pieces: 1.3-1.5x
     * this pass's time out of cache, where decode attention always runs.) Blocks wholly before
     * `first` are never touched (a windowed model may have released them). While a token's row
     * is read, the same row of the sequence's next block is prefetched (hardware prefetchers
     * stop at page boundaries; the next block is anywhere in the pool). */
    for (int64_t b = first / block_size; b * block_size < len; b++) {
        const struct span sp = block_span(k, table, b, first, len, block_size, token_stride);
        const int64_t hi = sp.hi, off = sp.off;
        for (int64_t j = sp.lo; j < hi; j++) {
            const float *kt = sp.block + j * token_stride;
            if (sp.next != NULL)
                prefetch_floats(sp.next + j * token_stride, token_stride);
            for (int64_t h0 = 0; h0 < heads; h0 += DOTS) {
                float dot[DOTS];
                const float *qh = q + h0 * q_head;
                const int64_t count = heads - h0 < DOTS ? heads - h0 : DOTS;
                if (count == DOTS)
                    head_dots(qh, q_head, kt, head_dim, h0, group, DOTS, dot);
                else
                    for (int64_t t = 0; t < count; t++)
                        head_dots(qh + t * q_head, q_head, kt, head_dim, h0 + t, group, 1,
                                  dot + t);
                for (int64_t t = 0; t < count; t++)
                    scores[(h0 + t) * n + off + j] = dot[t] * pre;
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
    /* Pass 2: out_hq = sum_t p[hq][t] v_t / sum_t p[hq][t], the same block order and the same
     * token-by-token order of the reads as pass 1: each output element is a chain of fused
     * multiply-adds over the tokens in order (the output rows, heads x D floats, stay in L1),
     * and the next block's row is prefetched the same way. */
    const int64_t d_vec = head_dim - head_dim % LANES;
    memset(out, 0, sizeof(float) * (size_t)(heads * head_dim));
    for (int64_t b = first / block_size; b * block_size < len; b++) {
        const struct span sp = block_span(v, table, b, first, len, block_size, token_stride);
        for (int64_t j = sp.lo; j < sp.hi; j++) {
            const float *vt = sp.block + j * token_stride;
            if (sp.next != NULL)
                prefetch_floats(sp.next + j * token_stride, token_stride);
            for (int64_t hq = 0; hq < heads; hq++) {
                const float pj = scores[hq * n + sp.off + j];
                const vec pv = vec_splat(pj);
                const float *vg = vt + (hq / group) * head_dim;
                float *o = out + hq * head_dim;
                int64_t d = 0;
                for (; d < d_vec; d += LANES) {
                    const vec acc = vec_madd(vec_load(o + d), pv, vec_load(vg + d));
                    memcpy(o + d, &acc, sizeof acc);
                }
                for (; d < head_dim; d++)
                    o[d] += pj * vg[d];
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
                       scores + heads);
        }
        free(scores);
    }
    return failed;
}
