/* What the native CPU kernels share: each kernel's entry point (so that a kernel calling another
 * is checked against its definition) and the inline math they all use.
 *
 * Compiled into one shared library by quire_engine/kernels/native.py, which also hashes this
 * header into the library's cache key.
 */
#ifndef QUIRE_NATIVE_H
#define QUIRE_NATIVE_H

#include <stdint.h>

/* csrc/paged_decode.c */
int quire_paged_decode(const float *q, int64_t q_tok, int64_t q_head, const float *k,
                       const float *v, const int64_t *rows, const int32_t *tables,
                       int64_t table_stride, const int64_t *lens, int64_t n, int64_t block_size,
                       int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,
                       int64_t window, float softcap, float *out, int64_t num_threads);

/* csrc/skinny_linear.c */
void quire_skinny_linear(const float *x, int64_t x_stride, int64_t M, const float *w,
                         const float *bias, int64_t N, int64_t K, float *y, int64_t y_stride,
                         int64_t num_threads);

/* exp(x) for x <= 0 (a softmax numerator), written so that the compiler vectorizes it: libm's
 * expf is a call per element, a quarter of this kernel's time. Range reduction x = n ln2 + r with
 * n = round(x / ln2) (adding and subtracting 1.5 * 2^23 rounds to nearest), |r| <= ln2 / 2, ln2
 * split in two constants (the high part exact in float); exp(r) by its degree-7 Taylor expansion
 * (truncation ~2e-9 relative at |r| = 0.35, below float rounding); 2^n assembled in the exponent
 * bits. Over every float in [-87, 0]: within 1 ulp of glibc's expf, relative error <= 1.1e-7.
 * Below -87.3 the result would be a denormal, so 0 (a weight under 1e-38 of the row's maximum);
 * NaN stays NaN, so a broken model still shows. The selects vectorize only when the compiler
 * may assume floating-point operations do not trap (-fno-trapping-math, set by native.py). */
static inline float exp_nonpositive(float x)
{
    const float clamped = x < -87.3f ? -87.3f : x;
    const float shifted = clamped * 1.44269504088896341f + 12582912.0f;
    const float n = shifted - 12582912.0f;
    const float r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    /* The low mantissa bits of `shifted` hold n (as 0x4B400000 + n): move it to the exponent. */
    union {
        float f;
        uint32_t i;
    } bits = {.f = shifted};
    /* Unsigned: for a NaN x the bits are garbage (discarded below), and signed overflow or a
     * shift of a negative value would be undefined behaviour. */
    bits.i = (bits.i - 0x4B400000u + 127u) << 23;
    const float value = p * bits.f;
    return x != x ? x : (x < -87.3f ? 0.0f : value);
}

#endif
