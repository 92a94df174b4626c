/* y = x W^T + b on CPU (fp32) for a few rows of x: the matmuls of a decode step with a small
 * batch, where every step streams all the model's weights from memory and does little
 * arithmetic with each.
 *
 * Contract. Loaded by quire_engine/cpu/native.py (SkinnyLinear) and called through
 * cpu/linear.py for nn.Linear forwards with at most linear.MAX_ROWS (16) rows, and by the native
 * decode step (decoder_decode.c) for every matmul of up to decoder.MAX_ROWS (64) sequences.
 * Every element of W is read once, straight from the weight (no packed copy, as a BLAS sgemm
 * makes), and used for every row of x while it is in registers.
 *
 * Layouts (fp32):
 *   x     [M, K], row stride x_stride (in floats), K contiguous
 *   w     [N, K] contiguous (nn.Linear's weight)
 *   bias  [N] or NULL
 *   y     [M, N], row stride y_stride, N contiguous; every element written
 * No return value: the call allocates nothing and cannot fail.
 *
 * Order of summation (the contract tests rely on): y[m, n] is lane l summing k = l, l + LANES,
 * ... below K - K % LANES, then the lanes added pairwise, then the scalar tail, then the bias:
 * the same order whatever M, the tile a row lands in, the order of the loops (blocked or not: a
 * chunk's partial sums are stored and reloaded as they are) and the thread count. So a row's
 * result is the same bits whatever the batch around it (batch invariance), which the BLAS does
 * not promise; it differs from the BLAS's by rounding, and between an AVX-512 build (LANES 16)
 * and an 8-lane one.
 *
 * Structure: a tile is ROWS_W rows of W against up to ROWS_X rows of x, ROWS_W * ROWS_X vector
 * accumulators of LANES floats, so each W vector is loaded once per tile and x stays in L1.
 * With 1-4 rows of x (1-6 with AVX-512: tile_halves, each 16-lane accumulator as two 8-lane
 * halves, the same bits) the tiles are wider in W (WIDE). The rows of x are split into
 * ceil(M / 6) groups of sizes that differ by at most one (group_start), and every row group
 * prefetches its share of the next tiles. Above BLOCKED_FROM (16) rows, W is taken in blocks
 * that fit L2 (blocked): each row group of x runs over the whole block, one chunk of K at a time,
 * so its chunk of x stays in L1 and only W comes from L2.
 *
 * Threads (OpenMP, torch's thread count) split the columns n in whole tiles (blocks, in the
 * blocked order); never one dot. They take them two at a time as they come free
 * (schedule(dynamic)), not in fixed shares: on cores shared with other processes a thread that
 * is descheduled would hold up the whole call with the rest of its fixed share (on 2 cores with
 * one busy neighbour, two threads ran at 1.6-1.7x the tok/s of fixed shares; quiet, the same).
 * Which thread computes a tile changes none of its sums.
 * Who checks what: the caller (native.py, or linear.py through SkinnyLinear.launch after its own
 * checks) checks dtypes, shapes, strides and devices; this code trusts them.
 */
#include <stdint.h>
#include <string.h>

#include "quire_native.h"

#define ROWS_X 6
#if LANES == 16
/* AVX-512's 32 registers hold twice the accumulators: tiles twice as wide in W. */
#define ROWS_W 4
#define WIDE_UP_TO 6 /* the rows of x with a tile of their own (tile_halves) */
#else
#define ROWS_W 2
#define WIDE_UP_TO 4 /* the rows of x with a tile wide in W */
#endif
#define MAX_W 8 /* the widest tile in W (one row of x) */
/* Above BLOCKED_FROM rows of x, the blocked order (see the header): W in blocks of about
 * BLOCK_BYTES and at most BLOCK_MAX rows (one block sits in L2 while the next streams in), K in
 * chunks of CHUNK floats (a 6-row group's chunk of x, 12 KB, stays in L1 across the block's
 * tiles; a block's partial accumulators, at most 12 KB, live on the stack). */
#define BLOCKED_FROM 16
#define BLOCK_BYTES (128 * 1024)
#define BLOCK_MAX 64
#define CHUNK 512

/* A tile's last step: s[i * NW + j], the lane sums of x row i against W row j, plus the scalar
 * tail k >= K - K % LANES, plus the bias, into y. */
static inline __attribute__((always_inline)) void finish(const float *s, const float *x,
                                                         int64_t x_stride, const int MX,
                                                         const float *w, const int NW, int64_t K,
                                                         const float *bias, float *y,
                                                         int64_t y_stride)
{
    for (int i = 0; i < MX; i++)
        for (int j = 0; j < NW; j++) {
            float t = s[i * NW + j];
            for (int64_t k = K - K % LANES; k < K; k++)
                t += x[i * x_stride + k] * w[j * K + k];
            y[i * y_stride + j] = bias != NULL ? t + bias[j] : t;
        }
}

/* One tile: rows x[0 .. MX), W rows w[0 .. NW), both compile-time counts after inlining, so
 * the accumulators live in registers, over the vector part [k0, k1) of K. With `partial` NULL
 * the tile is the whole vector part (k0 = 0, k1 = K - K % LANES); otherwise it is one chunk of
 * it, its accumulators taken from `partial` unless k0 = 0 and left there unless k1 ends the
 * vector part (a float stored and loaded is the same float, so chunking changes no bits). The
 * last chunk adds the lanes, the scalar tail and the bias, and writes y.
 * `ahead` (or NULL) is W further on, prefetched one 64-byte line per row every 16 floats: the
 * rows of W are consecutive in memory, but each tile streams several of them at once and the
 * hardware prefetcher alone lags behind. When x has `groups` row groups, each group's pass over
 * the tile prefetches its share (the lines whose 16-float chunk index is `group` modulo
 * `groups`), so the weights ahead arrive while every group computes, not only the first. */
static inline __attribute__((always_inline)) void
tile(const float *x, int64_t x_stride, const int MX, const float *w, const int NW, int64_t K,
     int64_t k0, int64_t k1, vec *partial, const float *bias, float *y, int64_t y_stride,
     const float *ahead, int64_t group, int64_t groups)
{
    vec acc[ROWS_X * MAX_W]; /* acc[i * NW + j]: x row i, W row j */
    const int64_t k_vec = K - K % LANES;
    if (partial != NULL && k0 > 0) {
#pragma GCC unroll 32
        for (int c = 0; c < MX * NW; c++)
            acc[c] = partial[c];
    } else {
#pragma GCC unroll 32
        for (int c = 0; c < MX * NW; c++)
            acc[c] = (vec){0};
    }
    /* The next k whose line this group prefetches (none: -1), and the step between them: a
     * compare per vector rather than a division (k0 is a multiple of 16). */
    int64_t prefetch_at = -1;
    if (ahead != NULL) {
        const int64_t line = k0 / 16;
        prefetch_at = (line + ((group - line % groups) + groups) % groups) * 16;
    }
    const int64_t prefetch_step = 16 * groups;
    for (int64_t k = k0; k < k1; k += LANES) {
        if (MX == 1) {
            /* One row of x: each W vector is used once, straight from memory (an operand of the
             * multiply-add), so NW accumulators and x fit the 16 registers with none spilled. */
            const vec xv = vec_load(x + k);
#pragma GCC unroll 32
            for (int j = 0; j < NW; j++)
                acc[j] = vec_madd(acc[j], xv, vec_load(w + j * K + k));
            if (k == prefetch_at) {
#pragma GCC unroll 32
                for (int j = 0; j < NW; j++)
                    prefetch_l2(ahead + j * K + k);
                prefetch_at += prefetch_step;
            }
            continue;
        }
        vec wv[MAX_W];
#pragma GCC unroll 32
        for (int j = 0; j < NW; j++)
            wv[j] = vec_load(w + j * K + k);
        if (k == prefetch_at) {
#pragma GCC unroll 32
            for (int j = 0; j < NW; j++)
                prefetch_l2(ahead + j * K + k);
            prefetch_at += prefetch_step;
        }
#pragma GCC unroll 32
        for (int i = 0; i < MX; i++) {
            vec xv = vec_load(x + i * x_stride + k);
            IN_REGISTER(xv);
#pragma GCC unroll 32
            for (int j = 0; j < NW; j++)
                acc[i * NW + j] = vec_madd(acc[i * NW + j], xv, wv[j]);
        }
    }
    if (partial != NULL && k1 < k_vec) {
#pragma GCC unroll 32
        for (int c = 0; c < MX * NW; c++)
            partial[c] = acc[c];
        return;
    }
    float s[ROWS_X * MAX_W];
    lanes_sums(acc, MX * NW, s);
    finish(s, x, x_stride, MX, w, NW, K, bias, y, y_stride);
}

#if LANES == 16
/* tile() for the one-group tiles at 1-6 rows of x, with each 16-lane accumulator kept as two
 * 8-lane halves (vec_fold: the same multiply-adds on the same lanes, so the same bits as tile()
 * and batch invariance across M): AVX registers, of which AVX-512 also has 32. Why: at 1-6 rows
 * the call streams W and barely computes, and 256-bit loads stream it faster than 512-bit ones
 * there (docs/benchmarks.md). Whole K (no chunks); `ahead` as in tile(). */
static inline __attribute__((always_inline)) void
tile_halves(const float *x, int64_t x_stride, const int MX, const float *w, const int NW,
            int64_t K, const float *bias, float *y, int64_t y_stride, const float *ahead)
{
    vec8 lo[ROWS_X * 8], hi[ROWS_X * 8]; /* [i * NW + j]: x row i, W row j; lanes 0-7, 8-15 */
    const int64_t k_vec = K - K % LANES;
#pragma GCC unroll 32
    for (int c = 0; c < MX * NW; c++)
        lo[c] = hi[c] = (vec8){0};
    for (int64_t k = 0; k < k_vec; k += LANES) {
        if (MX == 1) {
            const vec8 x0 = vec8_load(x + k), x1 = vec8_load(x + k + 8);
#pragma GCC unroll 16
            for (int j = 0; j < NW; j++) {
                lo[j] = vec8_madd(lo[j], x0, vec8_load(w + j * K + k));
                hi[j] = vec8_madd(hi[j], x1, vec8_load(w + j * K + k + 8));
            }
        } else {
            vec8 w0[8], w1[8];
#pragma GCC unroll 16
            for (int j = 0; j < NW; j++) {
                w0[j] = vec8_load(w + j * K + k);
                w1[j] = vec8_load(w + j * K + k + 8);
            }
#pragma GCC unroll 16
            for (int i = 0; i < MX; i++) {
                vec8 x0 = vec8_load(x + i * x_stride + k), x1 = vec8_load(x + i * x_stride + k + 8);
                IN_REGISTER(x0);
                IN_REGISTER(x1);
#pragma GCC unroll 16
                for (int j = 0; j < NW; j++) {
                    lo[i * NW + j] = vec8_madd(lo[i * NW + j], x0, w0[j]);
                    hi[i * NW + j] = vec8_madd(hi[i * NW + j], x1, w1[j]);
                }
            }
        }
        if (ahead != NULL) {
#pragma GCC unroll 16
            for (int j = 0; j < NW; j++)
                prefetch_l2(ahead + j * K + k);
        }
    }
    float s[ROWS_X * 8];
#pragma GCC unroll 32
    for (int c = 0; c < MX * NW; c++)
        lo[c] += hi[c]; /* vec_fold's addition */
    vec8_sums(lo, MX * NW, s);
    finish(s, x, x_stride, MX, w, NW, K, bias, y, y_stride);
}

#define WIDE_FN(MX, NW)                                                                            \
    static void wide_##MX##_##NW(const float *x, int64_t xs, const float *w, int64_t K,           \
                                 int64_t k0, int64_t k1, vec *p, const float *b, float *y,         \
                                 int64_t ys, const float *ahead, int64_t g, int64_t G)             \
    {                                                                                              \
        (void)k0, (void)k1, (void)p, (void)g, (void)G;                                             \
        tile_halves(x, xs, MX, w, NW, K, b, y, ys, ahead);                                         \
    }
#endif

/* The tile functions, one per (rows of x, rows of W): constant trip counts for the compiler. */
#define TILE_FN(MX, NW)                                                                            \
    static void tile_##MX##_##NW(const float *x, int64_t xs, const float *w, int64_t K,           \
                                 int64_t k0, int64_t k1, vec *p, const float *b, float *y,         \
                                 int64_t ys, const float *ahead, int64_t g, int64_t G)             \
    {                                                                                              \
        tile(x, xs, MX, w, NW, K, k0, k1, p, b, y, ys, ahead, g, G);                               \
    }
TILE_FN(1, 1)
TILE_FN(2, 1)
TILE_FN(3, 1)
TILE_FN(4, 1)
TILE_FN(5, 1)
TILE_FN(6, 1)
TILE_FN(1, 2)
TILE_FN(2, 2)
TILE_FN(3, 2)
TILE_FN(4, 2)
TILE_FN(5, 2)
TILE_FN(6, 2)
#if ROWS_W == 4
TILE_FN(1, 3)
TILE_FN(2, 3)
TILE_FN(3, 3)
TILE_FN(4, 3)
TILE_FN(5, 3)
TILE_FN(6, 3)
TILE_FN(1, 4)
TILE_FN(2, 4)
TILE_FN(3, 4)
TILE_FN(4, 4)
TILE_FN(5, 4)
TILE_FN(6, 4)
WIDE_FN(1, 8)
WIDE_FN(2, 4)
WIDE_FN(3, 4)
WIDE_FN(4, 3)
WIDE_FN(5, 2)
WIDE_FN(6, 2)
#else
TILE_FN(1, 8)
TILE_FN(2, 4)
TILE_FN(3, 4)
TILE_FN(4, 3)
#endif

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, int64_t, int64_t, vec *,
                        const float *, float *, int64_t, const float *, int64_t, int64_t);
static const tile_fn TILES[ROWS_W][ROWS_X] = {
    {tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1},
    {tile_1_2, tile_2_2, tile_3_2, tile_4_2, tile_5_2, tile_6_2},
#if ROWS_W == 4
    {tile_1_3, tile_2_3, tile_3_3, tile_4_3, tile_5_3, tile_6_3},
    {tile_1_4, tile_2_4, tile_3_4, tile_4_4, tile_5_4, tile_6_4},
#endif
};

/* The tile of its own for M = 1 .. WIDE_UP_TO rows of x (see the header; wide in W at 1-4);
 * beyond, ROWS_W-row tiles. */
static const struct {
    int64_t rows;
    tile_fn fn;
#if ROWS_W == 4
} WIDE[WIDE_UP_TO + 1] = {{0, NULL},     {8, wide_1_8}, {4, wide_2_4}, {4, wide_3_4},
                          {3, wide_4_3}, {2, wide_5_2}, {2, wide_6_2}};
#else
} WIDE[WIDE_UP_TO + 1] = {{0, NULL}, {8, tile_1_8}, {4, tile_2_4}, {4, tile_3_4}, {3, tile_4_3}};
#endif

/* Row groups: M rows of x in `groups` = ceil(M / ROWS_X) groups whose sizes differ by at most
 * one (7 rows: 4 + 3, not 6 + 1): a group of one or two rows keeps only 2-4 accumulators busy
 * yet reads every W tile again, as a full group does. Group g starts at row group_start(g). */
static inline int64_t group_start(int64_t M, int64_t groups, int64_t g)
{
    return g * (M / groups) + (g < M % groups ? g : M % groups);
}

/* The blocked order for one block of W, rows n0 .. n0 + nb: each group of rows of x
 * (`group_start`) runs over every tile of the block, one chunk of K at a time (the chunk of x
 * stays in L1, the block in L2; the first group reads it from memory). Every group prefetches
 * its share of the same tiles of the next block, `next_nb` rows (0: none), while it computes. */
static void blocked(const float *x, int64_t x_stride, int64_t M, const float *w, const float *bias,
                    int64_t K, float *y, int64_t y_stride, int64_t n0, int64_t nb, int64_t next_nb)
{
    vec partial[BLOCK_MAX / ROWS_W][ROWS_X * ROWS_W]; /* per tile, between chunks */
    const int64_t k_vec = K - K % LANES, groups = (M + ROWS_X - 1) / ROWS_X;
    const int64_t chunk = k_vec > CHUNK ? CHUNK : k_vec;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t m = group_start(M, groups, g), mx = group_start(M, groups, g + 1) - m;
        /* At least one pass, so that a K below LANES still runs each tile (for its tail). */
        int64_t k0 = 0;
        do {
            const int64_t k1 = k0 + chunk < k_vec ? k0 + chunk : k_vec;
            for (int64_t t = 0; t * ROWS_W < nb; t++) {
                const int64_t n = n0 + t * ROWS_W;
                const int64_t nw = n0 + nb - n < ROWS_W ? n0 + nb - n : ROWS_W;
                const float *ahead = t * ROWS_W + ROWS_W <= next_nb ? w + (n + nb) * K : NULL;
                TILES[nw - 1][mx - 1](x + m * x_stride, x_stride, w + n * K, K, k0, k1,
                                      chunk < k_vec ? partial[t] : NULL,
                                      bias != NULL ? bias + n : NULL, y + m * y_stride + n,
                                      y_stride, ahead, g, groups);
            }
            k0 = k1;
        } while (k0 < k_vec);
    }
}

void quire_skinny_linear(const float *x, int64_t x_stride, int64_t M, const float *w,
                         const float *bias, int64_t N, int64_t K, float *y, int64_t y_stride,
                         int64_t num_threads)
{
    (void)num_threads; /* unused in a build without OpenMP */
    if (M > BLOCKED_FROM) {
        /* Blocks of about BLOCK_BYTES of W, a whole number of tiles, at most BLOCK_MAX rows. */
        int64_t nb = BLOCK_BYTES / ((int64_t)sizeof(float) * (K > 0 ? K : 1));
        nb = nb < ROWS_W ? ROWS_W : nb - nb % ROWS_W;
        if (nb > BLOCK_MAX)
            nb = BLOCK_MAX;
        const int64_t num_blocks = (N + nb - 1) / nb;
#pragma omp parallel for schedule(dynamic, 2) num_threads(num_threads > 1 ? (int)num_threads : 1) \
    if (num_threads > 1 && num_blocks > 1)
        for (int64_t b = 0; b < num_blocks; b++) {
            const int64_t n0 = b * nb, this_nb = N - n0 < nb ? N - n0 : nb;
            const int64_t rest = N - n0 - this_nb, next_nb = rest < nb ? rest : nb;
            blocked(x, x_stride, M, w, bias, K, y, y_stride, n0, this_nb, next_nb);
        }
        return;
    }

    /* Tiles of `wide` rows of W, then the N % wide rows left in tiles of ROWS_W (or one). */
    const tile_fn wide_fn = M <= WIDE_UP_TO ? WIDE[M].fn : NULL;
    const int64_t wide = wide_fn != NULL ? WIDE[M].rows : ROWS_W;
    const int64_t num_wide = N / wide, rest = N - num_wide * wide;
    const int64_t num_tiles = num_wide + (rest + ROWS_W - 1) / ROWS_W;
    const int64_t groups = (M + ROWS_X - 1) / ROWS_X;
#pragma omp parallel for schedule(dynamic, 2) num_threads(num_threads > 1 ? (int)num_threads : 1) \
    if (num_threads > 1 && num_tiles > 1)
    for (int64_t t = 0; t < num_tiles; t++) {
        const int64_t n = t < num_wide ? t * wide : num_wide * wide + (t - num_wide) * ROWS_W;
        const int64_t width = t < num_wide ? wide : ROWS_W;
        const int64_t nw = N - n < width ? N - n : width;
        /* Prefetch 4 tiles ahead (at one row too, since the prefetch goes to L2: see
         * prefetch_l2). */
        const int64_t ahead_n = n + 4 * width;
        const float *ahead = ahead_n + width <= N ? w + ahead_n * K : NULL;
        const float *b = bias != NULL ? bias + n : NULL;
        if (nw == wide && wide_fn != NULL) {
            wide_fn(x, x_stride, w + n * K, K, 0, K - K % LANES, NULL, b, y + n, y_stride, ahead,
                    0, 1);
            continue;
        }
        for (int64_t g = 0; g < groups; g++) {
            const int64_t m = group_start(M, groups, g), mx = group_start(M, groups, g + 1) - m;
            TILES[nw - 1][mx - 1](x + m * x_stride, x_stride, w + n * K, K, 0, K - K % LANES,
                                  NULL, b, y + m * y_stride + n, y_stride, ahead, g, groups);
        }
    }
}
