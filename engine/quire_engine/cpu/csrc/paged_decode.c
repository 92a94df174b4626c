/* Paged decode attention on CPU: one query token per sequence, read against that sequence's K/V
 * blocks where they lie in the pool, float32, bfloat16 or 8-bit. No gather, no padding, no mask,
 * and no widened copy of a bfloat16 or 8-bit cache: its elements become floats in registers
 * (a bfloat16 one exactly, by a shift), and every sum is in float32.
 *
 * Contract. Loaded by quire_engine/cpu/native.py (PagedDecode) and called by CpuAttentionPlan
 * for the decode rows of a step, once per layer, and by decoder_decode.c. The semantics are those
 * of paged_attention_reference for a one-token query: the query at position len - 1 sees keys
 * 0 .. len - 1, or with a sliding window W > 0 keys max(0, len - W) .. len - 1 (blocks wholly
 * before that are never read: a windowed model releases them); with a soft-cap c > 0 the scores
 * are c * tanh(scale * q.k / c); an 8-bit pool's element q with scale s is float(q) * s
 * (kernels/kv_quant.py). Results match it to rounding, not bit for bit (another summation
 * order; for 8-bit, each row's scale applied once per dot product and once per weight instead
 * of once per element: q.(s k) = s (q.k) and p (s v) = (p s) v, equal up to rounding).
 *
 * Layouts (fp32 unless stated):
 *   q        [T, heads, D], row stride q_tok, head stride q_head (in floats), D contiguous
 *   k, v     [num_blocks, block_size, kv_heads, D] contiguous (the runner's pools), of `kind`
 *            (enum quire_kv_kind: float32, int8, float8_e4m3fn, float8_e5m2, bfloat16)
 *   k_scale, v_scale  8-bit kinds only: [num_blocks, block_size, kv_heads] contiguous, one per
 *            token and KV head (NULL for float32 and bfloat16)
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
 * An 8-bit pool is read by the same pass, specialised per format (decode_one is inlined into
 * one function per kind, so the format is never tested per element): LANES bytes become LANES
 * floats (kv_quant.h: exact), each K vector widened once for all the query heads that share
 * it, the dot product scaled by the token's K scale, the softmax weight by its V scale.
 *
 * Grouped-query attention: query head hq reads KV head hq / (heads / kv_heads), as transformers'
 * repeat_kv maps them. A sequence is computed by one thread from start to end, in an order that
 * depends only on its own data, so its output is the same bits whatever the batch around it and
 * whatever the thread count.
 *
 * Who checks what: the caller (native.py) checks dtypes, shapes and strides; the plan (or
 * decoder.py) checks that every block id is inside the pool, every length inside its table row
 * and every row below T. This code trusts all of it. Returns 0; 1 when scratch memory could not
 * be allocated (nothing is written then for the rows of the failing thread); 2 for an unknown
 * kind (nothing is written).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_quant.h"
#include "quire_native.h"

/* Hardware prefetchers stop at page boundaries, and the next block of a sequence is anywhere in
 * the pool: without help every block starts with cache misses. While the kernel reads a token's
 * row of one block, it prefetches the same row of the sequence's next block (`bytes` from `p`,
 * one request per 64-byte line). */
static inline void prefetch_bytes(const void *p, int64_t bytes)
{
    for (int64_t i = 0; i < bytes; i += 64)
        prefetch_l2((const char *)p + i);
}

/* Block b of a sequence whose visible positions are first .. len - 1: its tokens lo .. hi - 1
 * are visible, token j has score index base - first + j, `block` is the block's first byte in
 * `pool` and `next` the start of the sequence's next block (NULL after the last one, for the
 * prefetch); `index` the block's id (its scales' block). */
struct span {
    int64_t lo, hi, off, index;
    const char *block, *next;
};

static inline struct span block_span(const char *pool, const int32_t *table, int64_t b,
                                     int64_t first, int64_t len, int64_t block_size,
                                     int64_t token_bytes)
{
    const int64_t base = b * block_size;
    const int64_t block_bytes = block_size * token_bytes;
    struct span sp;
    sp.lo = base < first ? first - base : 0;
    sp.hi = len - base < block_size ? len - base : block_size;
    sp.off = base - first; /* >= -lo, so off + j >= 0 for every visible j */
    sp.index = table[b];
    sp.block = pool + sp.index * block_bytes;
    sp.next = base + block_size < len ? pool + (int64_t)table[b + 1] * block_bytes : NULL;
    return sp;
}

/* The kinds' storage: bytes per element, and whether rows carry scales (the 8-bit kinds do;
 * float32 and bfloat16 hold their values as they are). */
static inline __attribute__((always_inline)) int kv_scaled(const int kind)
{
    return kind == QUIRE_KV_INT8 || kind == QUIRE_KV_E4M3 || kind == QUIRE_KV_E5M2;
}

static inline __attribute__((always_inline)) int64_t kv_esize(const int kind)
{
    return kind == QUIRE_KV_F32 ? (int64_t)sizeof(float) : kind == QUIRE_KV_BF16 ? 2 : 1;
}

/* LANES bfloat16 elements at p as floats: a bfloat16 is a float's high half, so each widens
 * exactly by a zero-extension and a shift (vpmovzxwd, vpslld). */
typedef uint16_t u16vec __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t uvec __attribute__((vector_size(LANES * sizeof(uint32_t))));
static inline __attribute__((always_inline)) vec bf16_load(const void *p)
{
    u16vec h;
    memcpy(&h, p, sizeof h); /* unaligned load */
    const uvec bits = __builtin_convertvector(h, uvec) << 16;
    vec f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* LANES elements of a pool of `kind` at p as floats: float32 as they are, bfloat16 and 8-bit
 * ones widened in registers (kv_quant.h: exact; e4m3 / KV_E4M3_UNIT); and one element, for row tails. */
static inline __attribute__((always_inline)) vec elem_load(const int kind, const void *p)
{
    if (kind == QUIRE_KV_BF16)
        return bf16_load(p);
    return kind == QUIRE_KV_F32 ? vec_load(p) : kv8_load(kind, p);
}

static inline __attribute__((always_inline)) float elem_scalar(const int kind, const void *p)
{
    float f;
    if (kind == QUIRE_KV_BF16) {
        uint16_t h;
        memcpy(&h, p, sizeof h);
        const uint32_t bits = (uint32_t)h << 16;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    if (kind != QUIRE_KV_F32)
        return kv8_scalar(kind, p);
    memcpy(&f, p, sizeof f);
    return f;
}

/* q_h . k for up to DOTS query heads h = h0 .. h0 + count - 1 of one token (q_h at q + (h - h0) *
 * q_head), head h against its KV head's part of the token's K row k (of `kind`), kv_off[h - h0]
 * elements on: lane l sums d = l, l + LANES, ... with fused multiply-adds, the lanes are added
 * in lanes_sum's order, then the tail d >= D - D % LANES, whatever the count. DOTS independent
 * chains, because one dot's multiply-adds are a dependency chain: with four, the latency of the
 * multiply-add, not its throughput, bound the pass. An 8-bit row's dot is of its widened values,
 * without the scale. With shift >= 0 (8-bit only) the count is DOTS and each run of 2^shift heads
 * shares one KV head (heads / kv_heads a power of two, or a multiple of DOTS with shift 3), so
 * each K vector is widened once for its run; with shift < 0 each head loads its own. */
#define DOTS 8
static inline __attribute__((always_inline)) void head_dots(const int kind, const int shift,
                                                            const float *q, int64_t q_head,
                                                            const char *k, int64_t head_dim,
                                                            const int64_t *kv_off,
                                                            const int count, float *dot)
{
    const int64_t esize = kv_esize(kind);
    const int64_t d_vec = head_dim - head_dim % LANES;
    const char *kh[DOTS];
    vec acc[DOTS];
#pragma GCC unroll 8
    for (int t = 0; t < count; t++) {
        acc[t] = (vec){0};
        kh[t] = k + kv_off[t] * esize;
    }
    for (int64_t d = 0; d < d_vec; d += LANES) {
        if (shift >= 0) {
            vec kv[DOTS];
#pragma GCC unroll 8
            for (int r = 0; r < (DOTS >> shift); r++)
                kv[r] = elem_load(kind, kh[r << shift] + d * esize);
#pragma GCC unroll 8
            for (int t = 0; t < DOTS; t++)
                acc[t] = vec_madd(acc[t], vec_load(q + t * q_head + d), kv[t >> shift]);
        } else {
#pragma GCC unroll 8
            for (int t = 0; t < count; t++)
                acc[t] = vec_madd(acc[t], vec_load(q + t * q_head + d),
                                  elem_load(kind, kh[t] + d * esize));
        }
    }
    lanes_sums(acc, count, dot);
    for (int t = 0; t < count; t++)
        for (int64_t d = d_vec; d < head_dim; d++)
            dot[t] += q[t * q_head + d] * elem_scalar(kind, kh[t] + d * esize);
}

/* o_h[d] += p_h[j] * vg[j * token_stride + d] for j = lo .. hi - 1 in order, for `nh` (1, 2 or
 * 4) query heads h sharing the V rows vg: head h's output row at o + h * head_dim, its weights at
 * p + h * p_head. Four vectors of each row are held in registers over the tokens (a load and a
 * store of the row per token made pass 2 a chain through memory).
 * For an 8-bit kind (kind != QUIRE_KV_F32) vg holds bytes, widened in registers, and weight j
 * is p_h[j] * vs[j * kv_heads] (vs: the rows' V scales; decode_one applies kv8_unit at the
 * end). */
static inline __attribute__((always_inline)) void accumulate_v(
    const int kind, float *o, const float *p, const void *vg, const float *vs, int64_t kv_heads,
    int64_t token_stride, int64_t lo, int64_t hi, int64_t head_dim, int64_t p_head, const int nh)
{
    const int64_t d_vec = head_dim - head_dim % LANES;
    const int64_t esize = kv_esize(kind);
    const char *vb = vg;
#define V_AT(j, e) (vb + ((j) * token_stride + (e)) * esize) /* element e of row j */
#define V_LOAD(j, e) elem_load(kind, V_AT(j, e))
#define WEIGHT(ph, j) (!kv_scaled(kind) ? (ph)[j] : (ph)[j] * vs[(j) * kv_heads])
    int64_t d = 0;
    for (; d + 4 * LANES <= d_vec; d += 4 * LANES) {
        vec acc[4][4];
        for (int h = 0; h < nh; h++)
            for (int c = 0; c < 4; c++)
                acc[h][c] = vec_load(o + h * head_dim + d + c * LANES);
        for (int64_t j = lo; j < hi; j++) {
            const vec v0 = V_LOAD(j, d), v1 = V_LOAD(j, d + LANES);
            const vec v2 = V_LOAD(j, d + 2 * LANES), v3 = V_LOAD(j, d + 3 * LANES);
            for (int h = 0; h < nh; h++) {
                const vec pv = vec_splat(WEIGHT(p + h * p_head, j));
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
                acc = vec_madd(acc, vec_splat(WEIGHT(ph, j)), V_LOAD(j, e));
            memcpy(oh + e, &acc, sizeof acc);
        }
        for (int64_t e = d_vec; e < head_dim; e++)
            for (int64_t j = lo; j < hi; j++)
                oh[e] += WEIGHT(ph, j) * elem_scalar(kind, V_AT(j, e));
    }
#undef WEIGHT
#undef V_LOAD
#undef V_AT
}

/* The most query heads whose output rows accumulate_v keeps in registers at once for an 8-bit
 * pool, where each widened V vector is worth sharing: 4 x 4 accumulators with 16 lanes (of 32
 * vector registers), 2 with 8 (of 16). */
#if LANES == 16
#define V_HEADS 4
#else
#define V_HEADS 2
#endif

/* What decode_one needs besides the sequence: the pools and the per-call head maps. */
struct pools {
    const char *k, *v;            /* the pools' first bytes */
    const float *k_scale, *v_scale; /* 8-bit kinds: the scale pools */
    const int64_t *kv_off;        /* per query head: its KV head's offset in a row (elements) */
    const int64_t *kv_head;       /* per query head: its KV head */
    int shift;                    /* head_dots8's grouping (see there), or -1 */
};

/* One sequence in one pass over its blocks (online softmax, as flash-decoding does): for each
 * block, the scores of its visible tokens for every query head (K rows read token by token,
 * every query head against its KV head's part of the row), then each head's running maximum
 * m and sum l and its output row o (heads x D floats, in L1) rescaled by exp(m_old - m_new) when
 * the block raises the maximum, then o_h += exp(s - m) v_t for the block's V rows in the same
 * order; at the end o_h / l_h. While the K rows of a block are read, the same rows of the
 * block's V and of the next block's K are prefetched, so both streams are in flight at once
 * (a pass over all K and then one over all V would read one stream at a time).
 * `kind` is a constant in each caller (decode_f32 ...), so each format gets its own code.
 * An 8-bit score is (q.k * s_k) * pre with pre times kv8_unit (a power of two: the same
 * rounding as scaling each widened element), the V weights p * s_v, and the final division
 * by l times kv8_unit too.
 * `pl->kv_off[h]`: where query head h's KV head starts in a K or V row, (h / (heads / kv_heads))
 * * head_dim, and `pl->kv_head[h]` that KV head, computed once per call (no integer division per
 * head and token); `scores`: heads x block_size floats of scratch; `m`, `l`: heads floats each. */
static inline __attribute__((always_inline)) void decode_one(
    const int kind, const float *q, int64_t q_head, const struct pools *pl, const int32_t *table,
    int64_t len, int64_t first, int64_t block_size, int64_t heads, int64_t kv_heads,
    int64_t head_dim, float scale, float softcap, float *out, float *scores, float *m, float *l)
{
    const int64_t token_stride = kv_heads * head_dim; /* elements between two tokens of a block */
    const int64_t token_bytes = token_stride * kv_esize(kind);
    const int64_t *kv_off = pl->kv_off;
    const float unit = kv8_unit(kind);
    /* With a soft-cap the scores are c * tanh(scale * q.k / c) (transformers' order). */
    const float pre = (softcap > 0.0f ? scale / softcap : scale) * unit;
    memset(out, 0, sizeof(float) * (size_t)(heads * head_dim));
    for (int64_t hq = 0; hq < heads; hq++) {
        m[hq] = -INFINITY;
        l[hq] = 0.0f;
    }
    /* Blocks wholly before `first` are never touched (a windowed model may have released them). */
    for (int64_t b = first / block_size; b * block_size < len; b++) {
        const struct span ks = block_span(pl->k, table, b, first, len, block_size, token_bytes);
        const char *vblock = pl->v + (ks.block - pl->k); /* the V pool has the K pool's layout */
        const int64_t lo = ks.lo, hi = ks.hi, count = hi - lo;
        /* 8-bit: the block's scales, [block_size, kv_heads] each. */
        const float *kscales = NULL, *vscales = NULL;
        if (kv_scaled(kind)) {
            kscales = pl->k_scale + ks.index * block_size * kv_heads;
            vscales = pl->v_scale + ks.index * block_size * kv_heads;
            prefetch_bytes(vscales, (int64_t)sizeof(float) * block_size * kv_heads);
        }
        /* scores[hq * block_size + j - lo] = pre * q_hq . k_j */
        for (int64_t j = lo; j < hi; j++) {
            const char *kt = ks.block + j * token_bytes;
            prefetch_bytes(vblock + j * token_bytes, token_bytes);
            if (ks.next != NULL)
                prefetch_bytes(ks.next + j * token_bytes, token_bytes);
            for (int64_t h0 = 0; h0 < heads; h0 += DOTS) {
                float dot[DOTS];
                const float *qh = q + h0 * q_head;
                const int64_t n = heads - h0 < DOTS ? heads - h0 : DOTS;
                /* 8-bit: the grouped widening where the heads allow it (a constant each) */
                const int shift = kind == QUIRE_KV_F32 || n < DOTS ? -1 : pl->shift;
                if (shift == 0)
                    head_dots(kind, 0, qh, q_head, kt, head_dim, kv_off + h0, DOTS, dot);
                else if (shift == 1)
                    head_dots(kind, 1, qh, q_head, kt, head_dim, kv_off + h0, DOTS, dot);
                else if (shift == 2)
                    head_dots(kind, 2, qh, q_head, kt, head_dim, kv_off + h0, DOTS, dot);
                else if (shift == 3)
                    head_dots(kind, 3, qh, q_head, kt, head_dim, kv_off + h0, DOTS, dot);
                else if (n == DOTS)
                    head_dots(kind, -1, qh, q_head, kt, head_dim, kv_off + h0, DOTS, dot);
                else
                    for (int64_t t = 0; t < n; t++)
                        head_dots(kind, -1, qh + t * q_head, q_head, kt, head_dim,
                                  kv_off + h0 + t, 1, dot + t);
                if (!kv_scaled(kind)) {
                    for (int64_t t = 0; t < n; t++)
                        scores[(h0 + t) * block_size + j - lo] = dot[t] * pre;
                } else {
                    const float *ksj = kscales + j * kv_heads; /* the token's K scales */
                    for (int64_t t = 0; t < n; t++)
                        scores[(h0 + t) * block_size + j - lo] =
                            dot[t] * ksj[pl->kv_head[h0 + t]] * pre;
                }
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
         * of fused multiply-adds. Query heads two (8-bit: up to V_HEADS) at a time where they
         * share a KV head (their V rows are the same loads and widenings), their output rows in
         * registers across the block. */
        for (int64_t hq = 0; hq < heads;) {
            /* The heads from hq on that share its KV head, up to V_HEADS (8-bit) or 2. */
            int run = 1;
            while (run < (kind == QUIRE_KV_F32 ? 2 : V_HEADS) && hq + run < heads &&
                   kv_off[hq + run] == kv_off[hq])
                run++;
            const int64_t at = kv_off[hq] * kv_esize(kind);
            float *o = out + hq * head_dim;
            const float *p = scores + hq * block_size - lo;
            const float *vs = kv_scaled(kind) ? vscales + pl->kv_head[hq] : NULL;
            /* nh a constant in each call, so the accumulators stay in registers */
            if (run >= 4)
                accumulate_v(kind, o, p, vblock + at, vs, kv_heads, token_stride, lo, hi, head_dim,
                             block_size, 4);
            else if (run >= 2)
                accumulate_v(kind, o, p, vblock + at, vs, kv_heads, token_stride, lo, hi, head_dim,
                             block_size, 2);
            else
                accumulate_v(kind, o, p, vblock + at, vs, kv_heads, token_stride, lo, hi, head_dim,
                             block_size, 1);
            hq += run >= 4 ? 4 : run >= 2 ? 2 : 1;
        }
    }
    for (int64_t hq = 0; hq < heads; hq++) {
        const float inv = unit / l[hq];
        float *o = out + hq * head_dim;
        for (int64_t d = 0; d < head_dim; d++)
            o[d] *= inv;
    }
}

/* decode_one per kind: `kind` a constant in each, so every format's loops are its own. */
#define DECODE_FOR(name, kind)                                                                  \
    static void name(const float *q, int64_t q_head, const struct pools *pl,                   \
                     const int32_t *table, int64_t len, int64_t first, int64_t block_size,      \
                     int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,            \
                     float softcap, float *out, float *scores, float *m, float *l)              \
    {                                                                                           \
        decode_one(kind, q, q_head, pl, table, len, first, block_size, heads, kv_heads,        \
                   head_dim, scale, softcap, out, scores, m, l);                               \
    }
DECODE_FOR(decode_f32, QUIRE_KV_F32)
DECODE_FOR(decode_int8, QUIRE_KV_INT8)
DECODE_FOR(decode_e4m3, QUIRE_KV_E4M3)
DECODE_FOR(decode_e5m2, QUIRE_KV_E5M2)
DECODE_FOR(decode_bf16, QUIRE_KV_BF16)
#undef DECODE_FOR

int quire_paged_decode(const float *q, int64_t q_tok, int64_t q_head, const void *k, const void *v,
                       const float *k_scale, const float *v_scale, int64_t kind,
                       const int64_t *rows, const int32_t *tables, int64_t table_stride,
                       const int64_t *lens, int64_t n, int64_t block_size, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, float scale, int64_t window,
                       float softcap, float *out, int64_t num_threads)
{
    (void)num_threads; /* unused in a build without OpenMP */
    void (*decode)(const float *, int64_t, const struct pools *, const int32_t *, int64_t,
                   int64_t, int64_t, int64_t, int64_t, int64_t, float, float, float *, float *,
                   float *, float *) =
        kind == QUIRE_KV_F32    ? decode_f32
        : kind == QUIRE_KV_INT8 ? decode_int8
        : kind == QUIRE_KV_E4M3 ? decode_e4m3
        : kind == QUIRE_KV_E5M2 ? decode_e5m2
        : kind == QUIRE_KV_BF16 ? decode_bf16
                                : NULL;
    if (decode == NULL)
        return 2;
    int failed = 0;
    /* Threads split sequences, never one sequence: see the header on determinism. Scratch per
     * thread: each query head's KV offset and KV head, then its running max and sum, then
     * heads x block_size scores. */
    const int64_t group = heads / kv_heads; /* query heads per KV head */
    int shift = -1; /* head_dots8's grouping: runs of 2^shift heads within each DOTS */
    if (group % DOTS == 0)
        shift = 3;
    else if (group == 1 || group == 2 || group == 4)
        shift = group == 1 ? 0 : group == 2 ? 1 : 2;
#pragma omp parallel num_threads(num_threads > 1 ? (int)num_threads : 1) if (num_threads > 1 && n > 1)
    {
        const size_t floats = (size_t)(heads * (block_size + 2));
        int64_t *kv_off = malloc(sizeof(int64_t) * (size_t)(2 * heads) + sizeof(float) * floats);
        int64_t *kv_head = kv_off != NULL ? kv_off + heads : NULL;
        float *scores = kv_off != NULL ? (float *)(kv_off + 2 * heads) : NULL;
        for (int64_t h = 0; scores != NULL && h < heads; h++) {
            kv_head[h] = h / group;
            kv_off[h] = kv_head[h] * head_dim;
        }
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        const struct pools pl = {k, v, k_scale, v_scale, kv_off, kv_head, shift};
#pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < n; s++) {
            if (scores == NULL)
                continue;
            const int64_t len = lens[s];
            const int64_t first = window > 0 && len > window ? len - window : 0;
            decode(q + rows[s] * q_tok, q_head, &pl, tables + s * table_stride, len, first,
                   block_size, heads, kv_heads, head_dim, scale, softcap,
                   out + rows[s] * heads * head_dim, scores + 2 * heads, scores, scores + heads);
        }
        free(kv_off);
    }
    return failed;
}
