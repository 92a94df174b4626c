/* Writing 8-bit KV elements on CPU: kernels/kv_quant.py's write rule in C, bit for bit (that
 * module owns the rule; kv_quant.h reads what this writes).
 *
 * Contract. Called by decoder_decode.c for each new token's K and V rows, and exported for the
 * tests, which hold it to kv_quant.quantize byte for byte. A row of d floats gets
 *   scale s = fixed            when fixed > 0 (the checkpoint's per-layer scale), else
 *           = amax(|row|) / QMAX, or 1 for a row without a positive amax (all zeros),
 * computed as torch does: a float32 division (never a multiply by 1 / QMAX), a row holding a
 * NaN gets 1, as torch.where(amax > 0, ...) gives it; then each element y = x / s (a float32
 * division), clamped to +-QMAX, stored as
 *   int8     round half to even (nearbyintf under the default rounding mode: torch.round);
 *   e4m3fn   round to nearest even, as torch's .to(torch.float8_e4m3fn) (c10's
 *            fp8e4m3fn_from_fp32_value); e5m2 likewise (fp8e5m2_from_fp32_value).
 * The fp8 conversions are c10's algorithm: normal results by integer rounding of the float's
 * bits (add half an ulp minus one, plus the kept lowest bit: ties to even), subnormal ones by a
 * float addition of a power of two that aligns the result's last bit with the float's (the
 * hardware rounds it to nearest even). A float denormal input is 0 after rounding either way,
 * so a denormals-are-zero mode cannot change a result. Past the clamp nothing overflows; a NaN
 * element becomes the fp8 NaN code and 0 in int8 (which has none): not data kv_quant defines.
 *
 * Layout: x [rows, d] contiguous fp32; data [rows, d] bytes of `kind`; scales [rows] fp32.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quire_native.h"

static inline uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float float_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* f -> the bits of an fp8 format with `mant` mantissa bits and exponent bias `bias` (e4m3fn:
 * 3, 7; e5m2: 2, 15), rounded to nearest even; |f| <= the format's QMAX (clamped before), or
 * NaN (then the NaN code 0x7F, signed as f: both formats read it as NaN or, e4m3 in
 * kv_quant.h, as its largest magnitude). */
static uint8_t to_fp8(float f, const int mant, const int bias)
{
    const int shift = 23 - mant;                     /* the float mantissa bits dropped */
    const uint32_t min_normal = (uint32_t)(127 - bias + 1) << 23; /* 2^(1 - bias) */
    /* 2^(1 - bias + shift): a float whose last mantissa bit is the format's subnormal unit */
    const uint32_t denorm_mask = (uint32_t)(127 - bias + 1 + shift) << 23;
    uint32_t u = bits_of(f);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint8_t out;
    if (u > 0x7F800000u) {
        out = 0x7F;
    } else if (u < min_normal) { /* a subnormal of the format (or 0) */
        out = (uint8_t)(bits_of(float_of(u) + float_of(denorm_mask)) - denorm_mask);
    } else {
        const uint32_t odd = (u >> shift) & 1u; /* the kept mantissa's last bit: ties to even */
        u += ((uint32_t)(bias - 127) << 23) + ((1u << (shift - 1)) - 1u) + odd;
        out = (uint8_t)(u >> shift);
    }
    return (uint8_t)(out | (sign >> 24));
}

static float qmax_of(int64_t kind)
{
    return kind == QUIRE_KV_INT8 ? 127.0f : kind == QUIRE_KV_E4M3 ? 448.0f : 57344.0f;
}

void quire_kv_quantize(const float *x, int64_t rows, int64_t d, int64_t kind, float fixed,
                       void *data, float *scales)
{
    const float qmax = qmax_of(kind);
    uint8_t *out = data;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        uint8_t *o = out + r * d;
        float s = fixed;
        if (!(fixed > 0.0f)) {
            float amax = 0.0f;
            for (int64_t i = 0; i < d; i++) {
                const float a = fabsf(xr[i]);
                amax = a > amax || a != a ? a : amax; /* a NaN stays (torch's amax) */
            }
            s = amax > 0.0f ? amax / qmax : 1.0f;
        }
        scales[r] = s;
        for (int64_t i = 0; i < d; i++) {
            float y = xr[i] / s;
            y = y > qmax ? qmax : (y < -qmax ? -qmax : y);
            if (kind == QUIRE_KV_INT8)
                o[i] = (uint8_t)(int8_t)(y != y ? 0.0f : nearbyintf(y));
            else
                o[i] = kind == QUIRE_KV_E4M3 ? to_fp8(y, 3, 7) : to_fp8(y, 2, 15);
        }
    }
}
