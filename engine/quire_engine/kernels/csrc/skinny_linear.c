/* y = x W^T + b on CPU (fp32) for a few rows of x: the matmuls of a decode step with a small
 * batch, where every step streams all the model's weights from memory and does little
 * arithmetic with each.
 *
 * Loaded by quire_engine/kernels/native.py and called through kernels/linear_cpu.py for
 * nn.Linear forwards with at most linear_cpu.MAX_ROWS (16) rows, and by the native decode step
 * (decoder_decode.c) for every matmul of up to decoder_cpu.MAX_ROWS (64) sequences. Why not the
 * BLAS: a general sgemm packs panels of W into a scratch buffer before it multiplies, which at
 * a handful of rows doubles the memory traffic that bounds the call (measured with MKL on one
 * core: 2 rows cost 1.6x one row; `quire-engine bench linear`). Here every element of W is read
 * once, straight from the weight, and used for every row of x while it is in registers.
 *
 * Layouts (fp32):
 *   x     [M, K], row stride x_stride, K contiguous
 *   w     [N, K] contiguous (nn.Linear's weight)
 *   bias  [N] or NULL
 *   y     [M, N], row stride y_stride, N contiguous
 *
 * Tiling: a tile is ROWS_W rows of W against up to ROWS_X rows of x, ROWS_W * ROWS_X vector
 * accumulators of LANES floats (12 of AVX2's 16 registers, with two for W and one for x), so
 * each W vector is loaded once per tile and x stays in L1. With 1-4 rows of x (one group) the
 * tiles are wider in W (WIDE: 8, 4, 4, 3 rows of W): a 2-row tile keeps only 2-8
 * accumulators and two W streams in flight there. Best of 14 alternating passes over the 32.5M
 * Llama's 64 weights, cold, one thread, the 2-row tiles -> these: 0.85-0.92x the time at one
 * row, 0.91 at two, 0.91-0.94 at three, 0.94-0.98 at four (a C harness linking both versions).
 * From 5 rows on, x is held in a register for each of its multiply-adds (GCC otherwise reloads
 * it per W row), the lane sums of a tile run four at a time in vector form, and every row group
 * prefetches its share of the next tiles: 0.74-0.92x the time at 8-64 rows (same harness, best
 * of 9 alternating passes; 0.95-1.04x at 1-6 rows, within the harness's noise).
 * Order of summation: y[m, n] is lane l summing k = l, l + LANES, ... below K - K % LANES,
 * then the lanes added pairwise, then the scalar tail, then the bias: the same order whatever
 * M, the tile a row lands in, and the thread count. So a row's result is the same bits whatever
 * the batch around it (batch invariance), which the BLAS does not promise; it differs from the
 * BLAS's by rounding.
 *
 * Threads (OpenMP, torch's thread count) split the columns n in whole tiles; never one dot.
 * The caller (native.py) checks dtypes, shapes, strides and devices.
 */
#include <stdint.h>
#include <string.h>

#include "quire_native.h"

#define ROWS_W 2
#define ROWS_X 6
#define MAX_W 8 /* the widest tile in W (one row of x) */

/* One tile: rows x[0 .. MX), W rows w[0 .. NW), both compile-time counts after inlining, so
 * the accumulators live in registers. `ahead` (or NULL) is W a few tiles on, prefetched one
 * 64-byte line per row every 16 floats: the rows of W are consecutive in memory, but each tile
 * streams several of them at once and the hardware prefetcher alone lags behind. When x has
 * `groups` row groups, each group's pass over the tile prefetches its share (the lines whose
 * 16-float chunk index is `group` modulo `groups`), so the next tiles' weights arrive while
 * every group computes, not only the first. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_stride,
                                                       const int MX, const float *w, const int NW,
                                                       int64_t K, const float *bias, float *y,
                                                       int64_t y_stride, const float *ahead,
                                                       int64_t group, int64_t groups)
{
    vec acc[ROWS_X * MAX_W]; /* acc[i * NW + j]: x row i, W row j */
    const int64_t k_vec = K - K % LANES;
#pragma GCC unroll 16
    for (int c = 0; c < MX * NW; c++)
        acc[c] = (vec){0};
    for (int64_t k = 0; k < k_vec; k += LANES) {
        if (MX == 1) {
            /* One row of x: each W vector is used once, straight from memory (an operand of the
             * multiply-add), so NW accumulators and x fit the 16 registers with none spilled. */
            const vec xv = vec_load(x + k);
#pragma GCC unroll 8
            for (int j = 0; j < NW; j++)
                acc[j] = vec_madd(acc[j], xv, vec_load(w + j * K + k));
            continue;
        }
        vec wv[MAX_W];
#pragma GCC unroll 8
        for (int j = 0; j < NW; j++)
            wv[j] = vec_load(w + j * K + k);
#if defined(__GNUC__)
        if (ahead != NULL && k % 16 == 0 && (k / 16) % groups == group)
#pragma GCC unroll 8
            for (int j = 0; j < NW; j++)
                __builtin_prefetch(ahead + j * K + k, 0, 0);
#endif
#pragma GCC unroll 8
        for (int i = 0; i < MX; i++) {
            vec xv = vec_load(x + i * x_stride + k);
            IN_REGISTER(xv);
#pragma GCC unroll 8
            for (int j = 0; j < NW; j++)
                acc[i * NW + j] = vec_madd(acc[i * NW + j], xv, wv[j]);
        }
    }
    float s[ROWS_X * MAX_W];
    lanes_sums(acc, MX * NW, s);
    for (int i = 0; i < MX; i++)
        for (int j = 0; j < NW; j++) {
            float t = s[i * NW + j];
            for (int64_t k = k_vec; k < K; k++)
                t += x[i * x_stride + k] * w[j * K + k];
            y[i * y_stride + j] = bias != NULL ? t + bias[j] : t;
        }
}

/* The tile functions, one per (rows of x, rows of W): constant trip counts for the compiler. */
#define TILE_FN(MX, NW)                                                                            \
    static void tile_##MX##_##NW(const float *x, int64_t xs, const float *w, int64_t K,           \
                                 const float *b, float *y, int64_t ys, const float *ahead,         \
                                 int64_t g, int64_t G)                                             \
    {                                                                                              \
        tile(x, xs, MX, w, NW, K, b, y, ys, ahead, g, G);                                          \
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
TILE_FN(1, 8)
TILE_FN(2, 4)
TILE_FN(3, 4)
TILE_FN(4, 3)

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, const float *, float *,
                        int64_t, const float *, int64_t, int64_t);
static const tile_fn TILES[ROWS_W][ROWS_X] = {
    {tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1},
    {tile_1_2, tile_2_2, tile_3_2, tile_4_2, tile_5_2, tile_6_2},
};

/* The tile wide in W for M = 1..4 rows of x (see the header); beyond, ROWS_W-row tiles. */
static const struct {
    int64_t rows;
    tile_fn fn;
} WIDE[5] = {{0, NULL}, {8, tile_1_8}, {4, tile_2_4}, {4, tile_3_4}, {3, tile_4_3}};

void quire_skinny_linear(const float *x, int64_t x_stride, int64_t M, const float *w,
                         const float *bias, int64_t N, int64_t K, float *y, int64_t y_stride,
                         int64_t num_threads)
{
    /* Tiles of `wide` rows of W, then the N % wide rows left in tiles of ROWS_W (or one). */
    const tile_fn wide_fn = M <= 4 ? WIDE[M].fn : NULL;
    const int64_t wide = wide_fn != NULL ? WIDE[M].rows : ROWS_W;
    const int64_t num_wide = N / wide, rest = N - num_wide * wide;
    const int64_t num_tiles = num_wide + (rest + ROWS_W - 1) / ROWS_W;
    const int64_t groups = (M + ROWS_X - 1) / ROWS_X;
#pragma omp parallel for schedule(static) num_threads(num_threads > 1 ? (int)num_threads : 1) \
    if (num_threads > 1 && num_tiles > 1)
    for (int64_t t = 0; t < num_tiles; t++) {
        const int64_t n = t < num_wide ? t * wide : num_wide * wide + (t - num_wide) * ROWS_W;
        const int64_t width = t < num_wide ? wide : ROWS_W;
        const int64_t nw = N - n < width ? N - n : width;
        /* Prefetch 4 tiles ahead; not at one row, where the 8-row tile streams best alone. */
        const int64_t ahead_n = n + 4 * width;
        const float *ahead = M > 1 && ahead_n + width <= N ? w + ahead_n * K : NULL;
        const float *b = bias != NULL ? bias + n : NULL;
        if (nw == wide && wide_fn != NULL) {
            wide_fn(x, x_stride, w + n * K, K, b, y + n, y_stride, ahead, 0, 1);
            continue;
        }
        for (int64_t m = 0; m < M; m += ROWS_X) {
            const int64_t mx = M - m < ROWS_X ? M - m : ROWS_X;
            TILES[nw - 1][mx - 1](x + m * x_stride, x_stride, w + n * K, K, b, y + m * y_stride + n,
                                  y_stride, ahead, m / ROWS_X, groups);
        }
    }
}
