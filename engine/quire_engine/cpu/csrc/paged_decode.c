/* Paged decode attention on CPU (fp32): one query token per sequence, read against that
 * sequence's K/V blocks where they lie in the pool. No gather, no padding, no mask.
 *
 * Contract. Loaded by quire_engine/cpu/native.py (PagedDecode) and called by CpuAttentionPlan
 * for the decode rows of a step, once per layer, and by decoder_decode.c. The semantics are those
 * of paged_attention_reference for a one-token query: the query at position len - 1 sees keys
 * 0 .. len - 1, or with a sliding window W > 0 keys max(0, len - W) .. len - 1 (blocks wholly
 * before that are never read: a windowed model releases them); with a soft-cap c > 0 the scores
 * are c * tanh(scale * q.k / c). Results match it to rounding, not bit for bit (another
 * summation order).
 *
 * Layouts (all fp32 except the index arrays):
 *   q        [T, heads, D], row stride q_tok, head stride q_head (in floats), D contiguous
 *   k, v     [num_blocks, block_size, kv_heads, D] contiguous (the runner's pools)
 *   rows     int64 [n]: the query/output row of each sequence, each < T
 *   tables   int32 [n, table_stride]: block ids, the first ceil(len / block_size) used
 *   lens     int64 [n]: context length including the step's token, 1 .. table_stride * block_size
 *   window   0: none; softcap 0: none
 *   out      [T, heads, D] contiguous; only the n rows are written
 *
 * How: each sequence is computed in one pass over its blocks with an online softmax
 * (decode_one), each block read straight through, token by token (every query head against its
 * KV head's part of the row), while the same row of the sequence's next block is prefetched
 * (hardware prefetchers stop at page boundaries, and the next block is anywhere in the pool).
 *
 * Grouped-query attention: query head hq reads KV head hq / (heads / kv_heads), as transformers'
 * repeat_kv maps them. A sequence is computed by one thread from start to end, in an order that
 * depends only on its own data, so its output is the same bits whatever the batch around it and
 * whatever the thread count.
 *
 * Who checks what: the caller (native.py) checks dtypes, shapes and strides; the plan (or
 * decoder.py) checks that every block id is inside the pool, every length inside its table row
 * and every row below T. This code trusts all of it. Returns 0, or 1 when scratch memory could not
 * be allocated (nothing is written then for the rows of the failing thread).
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
 * q_head), head h against its KV head's part of the token's K row k, kv_off[h - h0] on:
 * lane l sums d = l, l + LANES, ... with fused multiply-adds, the lanes are added in lanes_sum's
 * order, then the tail d >= D - D % LANES, whatever the count. DOTS independent chains, because
 * one dot's multiply-adds are a dependency chain: with four, the latency of the multiply-add,
 * not its throughput, bound the pass. */
#define DOTS 8
static inline __attribute__((always_inline)) void head_dots(const float *q, int64_t q_head,
                                                            const float *k, int64_t head_dim,
                                                            const int64_t *kv_off,
                                                            const int count, float *dot)
{
    const int64_t d_vec = head_dim - head_dim % LANES;
    const float *kh[DOTS];
    vec acc[DOTS];
#pragma GCC unroll 8
    for (int t = 0; t < count; t++) {
        acc[t] = (vec){0};
        kh[t] = k + kv_off[t];
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

/* o_h[d] += p_h[j] * vg[j * token_stride + d] for j = lo .. hi - 1 in order, for `nh` (1 or 2)
 * query heads h sharing the V rows vg: head h's output row at o + h * head_dim, its weights at
 * p + h * p_head. Four vectors of each row are held in registers over the tokens (a load and a
 * store of the row per token made pass 2 a chain through memory). */
static inline void accumulate_v(float *o, const float *p, const float *vg, int64_t token_stride,
                                int64_t lo, int64_t hi, int64_t head_dim, int64_t p_head,
                                const int nh)
{
    const int64_t d_vec = head_dim - head_dim % LANES;
    int64_t d = 0;
    for (; d + 4 * LANES <= d_vec; d += 4 * LANES) {
        vec acc[2][4];
        for (int h = 0; h < nh; h++)
            for (int c = 0; c < 4; c++)
                acc[h][c] = vec_load(o + h * head_dim + d + c * LANES);
        for (int64_t j = lo; j < hi; j++) {
            const float *vr = vg + j * token_stride + d;
            const vec v0 = vec_load(vr), v1 = vec_load(vr + LANES);
            const vec v2 = vec_load(vr + 2 * LANES), v3 = vec_load(vr + 3 * LANES);
            for (int h = 0; h < nh; h++) {
                const vec pv = vec_splat(p[h * p_head + j]);
                acc[h][0] = vec_madd(acc[h][0], pv, v0);
                acc[h][1] = vec_madd(acc[h][1], pv, v1);
                acc[h][2] = vec_madd(acc[h][2], pv, v2);
                acc[h][3] = vec_madd(acc[h][3], pv, v3);
            }
        }
        for (int h = 0; h < nh; h++)
            memcpy(o + h * head_dim + d, acc[h], sizeof acc[h]);
    }
    for (int h = 0; h < nh; h++) {
        float *oh = o + h * head_dim;
        const float *ph = p + h * p_head;
        for (int64_t e = d; e < d_vec; e += LANES) {
            vec acc = vec_load(oh + e);
            for (int64_t j = lo; j < hi; j++)
                acc = vec_madd(acc, vec_splat(ph[j]), vec_load(vg + j * token_stride + e));
            memcpy(oh + e, &acc, sizeof acc);
        }
        for (int64_t e = d_vec; e < head_dim; e++)
            for (int64_t j = lo; j < hi; j++)
                oh[e] += ph[j] * vg[j * token_stride + e];
    }
}

/* One sequence in one pass over its blocks (online softmax, as flash-decoding does): for each
 * block, the scores of its visible tokens for every query head (K rows read token by token,
 * every query head against its KV head's part of the row), then each head's running maximum
 * m and sum l and its output row o (heads x D floats, in L1) rescaled by exp(m_old - m_new) when
 * the block raises the maximum, then o_h += exp(s - m) v_t for the block's V rows in the same
 * order; at the end o_h / l_h. While the K rows of a block are read, the same rows of the
 * block's V and of the next block's K are prefetched, so both streams are in flight at once
 * (a pass over all K and then one over all V would read one stream at a time).
 * `kv_off[h]`: where query head h's KV head starts in a K or V row, (h / (heads / kv_heads)) *
 * head_dim, computed once per call (no integer division per head and token); `scores`:
 * heads x block_size floats of scratch; `m`, `l`: heads floats each. */
static void decode_one(const float *q, int64_t q_head, const float *k, const float *v,
                       const int32_t *table, int64_t len, int64_t first, int64_t block_size,
                       int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,
                       float softcap, const int64_t *kv_off, float *out, float *scores,
                       float *m, float *l)
{
    const int64_t token_stride = kv_heads * head_dim; /* floats between two tokens of a block */
    /* With a soft-cap the scores are c * tanh(scale * q.k / c) (transformers' order). */
    const float pre = softcap > 0.0f ? scale / softcap : scale;
    memset(out, 0, sizeof(float) * (size_t)(heads * head_dim));
    for (int64_t hq = 0; hq < heads; hq++) {
        m[hq] = -INFINITY;
        l[hq] = 0.0f;
    }
    /* Blocks wholly before `first` are never touched (a windowed model may have released them). */
    for (int64_t b = first / block_size; b * block_size < len; b++) {
        const struct span ks = block_span(k, table, b, first, len, block_size, token_stride);
        const float *vblock = v + (ks.block - k); /* the V pool has the K pool's layout */
        const int64_t lo = ks.lo, hi = ks.hi, count = hi - lo;
        /* scores[hq * block_size + j - lo] = pre * q_hq . k_j */
        for (int64_t j = lo; j < hi; j++) {
            const float *kt = ks.block + j * token_stride;
            prefetch_floats(vblock + j * token_stride, token_stride);
            if (ks.next != NULL)
                prefetch_floats(ks.next + j * token_stride, token_stride);
            for (int64_t h0 = 0; h0 < heads; h0 += DOTS) {
                float dot[DOTS];
                const float *qh = q + h0 * q_head;
                const int64_t n = heads - h0 < DOTS ? heads - h0 : DOTS;
                if (n == DOTS)
                    head_dots(qh, q_head, kt, head_dim, kv_off + h0, DOTS, dot);
                else
                    for (int64_t t = 0; t < n; t++)
                        head_dots(qh + t * q_head, q_head, kt, head_dim, kv_off + h0 + t, 1,
                                  dot + t);
                for (int64_t t = 0; t < n; t++)
                    scores[(h0 + t) * block_size + j - lo] = dot[t] * pre;
            }
        }
        /* Per head: the new maximum, the old sum and output rescaled to it (exp(-inf) = 0 on
         * the first block, whose output is still zero), the block's numerators and their sum. */
        for (int64_t hq = 0; hq < heads; hq++) {
            float *p = scores + hq * block_size;
            if (softcap > 0.0f)
                for (int64_t t = 0; t < count; t++)
                    p[t] = softcap * tanhf(p[t]);
            float mx = m[hq];
            for (int64_t t = 0; t < count; t++)
                mx = p[t] > mx ? p[t] : mx;
            if (mx > m[hq]) {
                const float alpha = exp_nonpositive(m[hq] - mx);
                float *o = out + hq * head_dim;
                for (int64_t d = 0; d < head_dim; d++)
                    o[d] *= alpha;
                l[hq] *= alpha;
                m[hq] = mx;
            }
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < count; t++) {
                p[t] = exp_nonpositive(p[t] - mx);
                sum += p[t];
            }
            l[hq] += sum;
        }
        /* o_hq += p[hq][j] v_j over the block's tokens in order: each output element a chain
         * of fused multiply-adds. Query heads two at a time where they share a KV head (their
         * V rows are the same loads), their output rows in registers across the block. */
        for (int64_t hq = 0; hq < heads;) {
            const int two = hq + 1 < heads && kv_off[hq + 1] == kv_off[hq];
            accumulate_v(out + hq * head_dim, scores + hq * block_size - lo,
                         vblock + kv_off[hq], token_stride, lo, hi, head_dim,
                         block_size, two ? 2 : 1);
            hq += two ? 2 : 1;
        }
    }
    for (int64_t hq = 0; hq < heads; hq++) {
        const float inv = 1.0f / l[hq];
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
    (void)num_threads; /* unused in a build without OpenMP */
    int failed = 0;
    /* Threads split sequences, never one sequence: see the header on determinism. Scratch per
     * thread: each query head's KV offset, then its running max and sum, then heads x block_size
     * scores. */
    const int64_t group = heads / kv_heads; /* query heads per KV head */
#pragma omp parallel num_threads(num_threads > 1 ? (int)num_threads : 1) if (num_threads > 1 && n > 1)
    {
        const size_t floats = (size_t)(heads * (block_size + 2));
        int64_t *kv_off = malloc(sizeof(int64_t) * (size_t)heads + sizeof(float) * floats);
        float *scores = kv_off != NULL ? (float *)(kv_off + heads) : NULL;
        for (int64_t h = 0; scores != NULL && h < heads; h++)
            kv_off[h] = (h / group) * head_dim;
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
                       block_size, heads, kv_heads, head_dim, scale, softcap, kv_off,
                       out + rows[s] * heads * head_dim, scores + 2 * heads, scores,
                       scores + heads);
        }
        free(kv_off);
    }
    return failed;
}
