/* half.h: scalar conversions between fp32 and the 16-bit float formats,
 * for the CPU core and for the emulated driver's stand-ins of nvcc's
 * conversions (tests/emulated_cuda), hence in include/zero/ (dtype.h).
 *
 * These are the reference conversions: the SIMD paths must produce the same
 * bits. Narrowing rounds to nearest, ties to even, the rounding torch uses,
 * so a bf16 copy-out equals torch's `.to(torch.bfloat16)` bit for bit.
 * NaN handling follows the hardware and torch: bf16 NaN becomes 0x7FC0 (as
 * c10::BFloat16 does); fp16 NaN keeps its sign and top payload bits with the
 * quiet bit set (as the F16C instructions do).
 */
#ifndef ZERO_HALF_H
#define ZERO_HALF_H

#include <stdint.h>
#include <string.h>

#include "dtype.h"

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float bf16_to_f32(uint16_t h)
{
    return f32_from_bits((uint32_t)h << 16);
}

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return 0x7fc0;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    if (exponent == 0x1f) {
        /* inf, or NaN made quiet */
        uint32_t quiet = mantissa ? 0x400000u : 0u;
        return f32_from_bits(sign | 0x7f800000u | quiet | (mantissa << 13));
    }
    if (exponent == 0) {
        /* zero or subnormal: mantissa * 2^-24 is exact in fp32 */
        float magnitude = (float)mantissa * 0x1p-24f;
        return sign ? -magnitude : magnitude;
    }
    return f32_from_bits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

static inline uint16_t f32_to_f16(float f)
{
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t magnitude = u & 0x7fffffffu;
    if (magnitude >= 0x7f800000u) {
        if (magnitude == 0x7f800000u) {
            return sign | 0x7c00u;
        }
        return sign | 0x7e00u | (uint16_t)((magnitude >> 13) & 0x3ffu);
    }
    if (magnitude >= 0x477ff000u) {
        /* at or above 65520, halfway past the largest half (65504): inf */
        return sign | 0x7c00u;
    }
    if (magnitude < 0x38800000u) {
        /* Below 2^-14: a subnormal half. Adding 0.5 makes the FPU round the
         * value to a multiple of 2^-24 (nearest even); the low bits of the
         * sum are then the half's mantissa. */
        float shifted = f32_from_bits(magnitude) + 0.5f;
        return sign | (uint16_t)(f32_bits(shifted) - 0x3f000000u);
    }
    /* Normal: re-bias the exponent (127 -> 15) and round the 13 dropped
     * mantissa bits to nearest even. */
    magnitude += 0xc8000fffu + ((magnitude >> 13) & 1u);
    return sign | (uint16_t)(magnitude >> 13);
}

/* Element i of a buffer of the given dtype, as fp32. */
static inline float load_as_f32(const void *data, zero_dtype dtype, int64_t i)
{
    switch (dtype) {
    case ZERO_BF16:
        return bf16_to_f32(((const uint16_t *)data)[i]);
    case ZERO_F16:
        return f16_to_f32(((const uint16_t *)data)[i]);
    default:
        return ((const float *)data)[i];
    }
}

static inline void store_from_f32(void *data, zero_dtype dtype, int64_t i,
                                  float value)
{
    switch (dtype) {
    case ZERO_BF16:
        ((uint16_t *)data)[i] = f32_to_bf16(value);
        break;
    case ZERO_F16:
        ((uint16_t *)data)[i] = f32_to_f16(value);
        break;
    default:
        ((float *)data)[i] = value;
        break;
    }
}

#endif /* ZERO_HALF_H */
