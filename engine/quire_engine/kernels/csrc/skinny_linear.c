/* y = x W^T + b on CPU (fp32) for a few rows of x: the matmuls of a decode step with a small
 * batch (1-16 sequences), where every step streams all the model's weights from memory and
 * does little arithmetic with each.
 *
 * Loaded by quire_engine/kernels/native.py and called through kernels/linear_cpu.py for
 * nn.Linear forwards with at most linear_cpu.MAX_ROWS rows. Why not the BLAS: a general sgemm
 * packs panels of W into a scratch buffer before it multiplies, which at a handful of rows
 * doubles the memory traffic that bounds the call (measured with MKL on one core: 2 rows cost
 * 1.6x one row; `quire-engine bench linear`). Here every element of W is read
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
 * tiles are wider in W (wide_rows: 8, 4, 4, 3 rows of W): a 2-row tile keeps only 2-8
 * accumulators and two W streams in flight there. Best of 14 alternating passes over the 32.5M
 * Llama's 64 weights, cold, one thread, the 2-row tiles -> these: 0.85-0.92x the time at one
 * row, 0.91 at two, 0.91-0.94 at three, 0.94-0.98 at four (a C harness linking both versions).
 * Order of summation: y[m, n] is
 * lane l summing k = l, l + LANES, ... below K - K % LANES, then the lanes added pairwise, then
 * the scalar tail, then the bias: the same order whatever M, the tile a row lands in, and the
 * thread count. So a row's result is the same bits whatever the batch around it (batch
 * invariance), which the BLAS does not promise; it differs from the BLAS's by rounding.
 *
 * Threads (OpenMP, torch's thread count) split the columns n in whole tiles; never one dot.
 * The caller (native.py) checks dtypes, shapes, strides and devices.
 */
#include <stdint.h>
#include <string.h>

#include "quire_native.h"
#if defined(__AVX__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define LANES 8
#define ROWS_W 2
#define ROWS_X 6
#define MAX_W 8 /* the widest tile in W (one row of x) */

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

static inline vec load(const float *p)
{
    vec v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

/* acc + a * b, one rounding per lane where the CPU has fused multiply-add: written out rather
 * than left to the compiler's contraction (-ffp-contract), which may fuse in one tile and not in
 * another and so break the batch invariance above. Elsewhere two roundings, in every tile. */
static inline vec madd(vec acc, vec a, vec b)
{
#if defined(__AVX__) && defined(__FMA__)
    return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    return acc + a * b;
#endif
}

static inline float lanes_sum(vec a)
{
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* One tile: rows x[0 .. MX), W rows w[0 .. NW), both compile-time counts after inlining, so
 * the accumulators live in registers. `ahead` (or NULL) is W a few tiles on, prefetched one
 * 64-byte line per row every 16 floats: the rows of W are consecutive in memory, but each tile
 * streams ROWS_W of them at once and the hardware prefetcher alone lags behind. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_stride,
                                                       const int MX, const float *w, const int NW,
                                                       int64_t K, const float *bias, float *y,
                                                       int64_t y_stride, const float *ahead)
{
    vec acc[ROWS_X][MAX_W];
    const int64_t k_vec = K - K % LANES;
#pragma GCC unroll 8
    for (int i = 0; i < MX; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NW; j++)
            acc[i][j] = (vec){0};
    for (int64_t k = 0; k < k_vec; k += LANES) {
        if (MX == 1) {
            /* One row of x: each W vector is used once, straight from memory (an operand of the
             * multiply-add), so NW accumulators and x fit the 16 registers with none spilled. */
            const vec xv = load(x + k);
#pragma GCC unroll 8
            for (int j = 0; j < NW; j++)
                acc[0][j] = madd(acc[0][j], xv, load(w + j * K + k));
            continue;
        }
        vec wv[MAX_W];
#pragma GCC unroll 8
        for (int j = 0; j < NW; j++)
            wv[j] = load(w + j * K + k);
#if defined(__GNUC__)
        if (ahead != NULL && k % 16 == 0)
#pragma GCC unroll 8
            for (int j = 0; j < NW; j++)
                __builtin_prefetch(ahead + j * K + k, 0, 0);
#endif
#pragma GCC unroll 8
        for (int i = 0; i < MX; i++) {
            const vec xv = load(x + i * x_stride + k);
#pragma GCC unroll 8
            for (int j = 0; j < NW; j++)
                acc[i][j] = madd(acc[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < MX; i++)
        for (int j = 0; j < NW; j++) {
            float s = lanes_sum(acc[i][j]);
            for (int64_t k = k_vec; k < K; k++)
                s += x[i * x_stride + k] * w[j * K + k];
            y[i * y_stride + j] = bias != NULL ? s + bias[j] : s;
        }
}

/* The tile functions, one per (rows of x, rows of W): constant trip counts for the compiler. */
#define TILE_FN(MX, NW)                                                                            \
    static void tile_##MX##_##NW(const float *x, int64_t xs, const float *w, int64_t K,           \
                                 const float *b, float *y, int64_t ys, const float *ahead)         \
    {                                                                                              \
        tile(x, xs, MX, w, NW, K, b, y, ys, ahead);                                                \
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
                        int64_t, const float *);
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
            wide_fn(x, x_stride, w + n * K, K, b, y + n, y_stride, ahead);
            continue;
        }
        for (int64_t m = 0; m < M; m += ROWS_X) {
            const int64_t mx = M - m < ROWS_X ? M - m : ROWS_X;
            /* W is prefetched by the first row group only: later ones find it in cache. */
            TILES[nw - 1][mx - 1](x + m * x_stride, x_stride, w + n * K, K, b, y + m * y_stride + n,
                                  y_stride, m == 0 ? ahead : NULL);
        }
    }
}
