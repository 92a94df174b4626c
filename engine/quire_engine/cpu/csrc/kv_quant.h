/* Reading 8-bit KV elements on CPU: LANES bytes of a pool row to LANES floats in registers, for
 * the decode kernel (paged_decode.c). The format is kernels/kv_quant.py's (it owns the rule):
 * element q of a row with scale s reads back as float(q) * s. Writing (quantizing) is kv_quant.c.
 *
 * Every conversion here is exact: an 8-bit value is a float with few mantissa bits, so the
 * float it becomes is that value (times a power of two, see below), never rounded, and no
 * float denormal is ever an input or an output (denormals-are-zero or flush-to-zero modes,
 * which a process may set, change nothing).
 *
 *   int8     sign-extended, then converted to float: -127 .. 127.
 *   e4m3fn   (s eeee mmm, bias 7) placed in a half float as s 0eeee mmm0000000: the half's
 *            exponent field is e and its bias 15, so it holds value * 2^-8 whether e4m3 is
 *            normal (2^(e-7) (1 + m/8)) or subnormal (2^-6 m/8, the half then subnormal too,
 *            and every half is a normal float). The reader multiplies the row's scale by
 *            KV_E4M3_UNIT (256) instead of every element (kv8_unit). The NaN code 0x7F reads
 *            as 480: quantized data never holds it (clamped to 448 first), and no NaN is made.
 *   e5m2     (s eeeee mm, bias 15) is a half float's high byte: the byte shifted left by 8.
 *            Its inf and NaN codes are never written (clamped to 57344 first).
 * On x86 with AVX2 and F16C (every AVX-512 CPU has both) the bytes are widened by the vector
 * units (vpmovsx) and halves become floats with vcvtph2ps (exact, and unaffected by
 * denormals-are-zero); elsewhere (an older x86, Arm) by the compiler's vector extensions, which
 * build anywhere but may run lane by lane, with fp8 decoded by integer operations: a normal
 * value's bits moved into a float's exponent and mantissa with the bias difference added (a
 * normal float), a subnormal one's integer mantissa converted and scaled by a power of two, the
 * sign ORed in. Both give the same floats for every code a write produces.
 */
#ifndef QUIRE_KV_QUANT_H
#define QUIRE_KV_QUANT_H

#include <stdint.h>
#include <string.h>

#include "quire_native.h"

#define KV_E4M3_UNIT 256.0f /* an e4m3 value is its read-back float times this */

typedef int8_t i8vec __attribute__((vector_size(LANES)));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));

/* What a row's scale is multiplied by before use: the format's power-of-two read factor. */
static inline float kv8_unit(const int kind)
{
    return kind == QUIRE_KV_E4M3 ? KV_E4M3_UNIT : 1.0f;
}

/* The floats of LANES fp8 bytes by integer operations (see the header): shift places a normal
 * value's exponent field at the float's, bias its exponent bias difference, sub_exp2 the value
 * of a subnormal's mantissa unit, sub_below the first normal magnitude (its bits as a byte). */
static inline vec kv8_fp8_by_bits(const i8vec bytes, const int shift, const int32_t bias,
                                  const float sub_unit, const int32_t sub_below)
{
    const ivec x = __builtin_convertvector(bytes, ivec) & 0xFF;
    const ivec mag = x & 0x7F;
    const ivec sign = (x & 0x80) << 24;
    const ivec normal = (mag << shift) + (bias << 23);
    const vec sub = __builtin_convertvector(mag, vec) * sub_unit;
    ivec sub_bits;
    memcpy(&sub_bits, &sub, sizeof sub);
    const ivec is_sub = mag < sub_below; /* all ones where subnormal */
    const ivec out = (sub_bits & is_sub) | (normal & ~is_sub) | sign;
    vec f;
    memcpy(&f, &out, sizeof f);
    return f;
}

/* LANES elements of `kind` at p (an 8-bit format) as floats: int8 and e5m2 their values, e4m3
 * its value / KV_E4M3_UNIT (see the header). */
static inline __attribute__((always_inline)) vec kv8_load(const int kind, const void *p)
{
    i8vec bytes;
    memcpy(&bytes, p, sizeof bytes); /* unaligned load */
#if LANES == 16
    __m128i b;
    memcpy(&b, &bytes, sizeof b);
    if (kind == QUIRE_KV_INT8)
        return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    __m256i h = _mm256_cvtepi8_epi16(b); /* sign-extended to 16 bits */
    if (kind == QUIRE_KV_E4M3)
        h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xBF80));
    else
        h = _mm256_slli_epi16(h, 8);
    return (vec)_mm512_cvtph_ps(h);
#elif defined(__F16C__) && defined(__AVX2__)
    const __m128i b = _mm_loadl_epi64((const __m128i *)(const void *)&bytes);
    if (kind == QUIRE_KV_INT8)
        return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    __m128i h = _mm_cvtepi8_epi16(b);
    if (kind == QUIRE_KV_E4M3)
        h = _mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16((short)0xBF80));
    else
        h = _mm_slli_epi16(h, 8);
    return (vec)_mm256_cvtph_ps(h);
#else
    if (kind == QUIRE_KV_INT8)
        return __builtin_convertvector(__builtin_convertvector(bytes, ivec), vec);
    /* e4m3 / 256: exponent field e at bit 23 (shift 20), bias 127 - 7 - 8; a subnormal
     * mantissa unit 2^-9 / 256. e5m2: shift 21, bias 127 - 15; unit 2^-16. */
    if (kind == QUIRE_KV_E4M3)
        return kv8_fp8_by_bits(bytes, 20, 112, 0x1p-17f, 0x08);
    return kv8_fp8_by_bits(bytes, 21, 112, 0x1p-16f, 0x04);
#endif
}

/* One element of `kind` at p as kv8_load reads it (the same float), for row tails. */
static inline float kv8_scalar(const int kind, const void *p)
{
    uint8_t b;
    memcpy(&b, p, 1);
    if (kind == QUIRE_KV_INT8)
        return (float)(int8_t)b;
    const int e4m3 = kind == QUIRE_KV_E4M3;
    const uint32_t mag = b & 0x7Fu, sign = (uint32_t)(b & 0x80u) << 24;
    float f;
    if (mag < (e4m3 ? 0x08u : 0x04u)) {
        f = (float)mag * (e4m3 ? 0x1p-17f : 0x1p-16f);
    } else {
        const uint32_t bits = (mag << (e4m3 ? 20 : 21)) + (112u << 23);
        memcpy(&f, &bits, sizeof f);
    }
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits |= sign;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#endif
