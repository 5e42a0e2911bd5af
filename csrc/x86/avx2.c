/* avx2.c: the AVX2 + FMA + F16C kernels (8 floats a vector).
 *
 * This file only maps the vector vocabulary of simd_kernels.h onto AVX2
 * intrinsics; the kernels themselves are written once, in that template.
 * Every function carries a target attribute, so the file builds without
 * -mavx2 and runs only after cpu_features.c has seen the CPU support it.
 */
#include <immintrin.h>
#include <stdint.h>

#include "../internal.h"

#define ISA_TARGET __attribute__((target("avx2,fma,f16c")))
#define ISA_TABLE avx2_kernels
#define W 8

typedef __m256 vec;

#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, v) _mm256_storeu_ps((p), (v))
#define vstream(p, v) _mm256_stream_ps((p), (v))
#define vset1(x) _mm256_set1_ps(x)
#define vadd(a, b) _mm256_add_ps((a), (b))
#define vsub(a, b) _mm256_sub_ps((a), (b))
#define vmul(a, b) _mm256_mul_ps((a), (b))
#define vdiv(a, b) _mm256_div_ps((a), (b))
#define vsqrt(a) _mm256_sqrt_ps(a)
/* a * b + c and c - a * b, each rounded once */
#define vfmadd(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define vfnmadd(a, b, c) _mm256_fnmadd_ps((a), (b), (c))

/* max(a, b), NaN where either is NaN (max_keeping_nan in optim_math.h):
 * maxps alone returns b then */
static ISA_TARGET inline vec vmax_keeping_nan(vec a, vec b)
{
    return _mm256_blendv_ps(_mm256_max_ps(a, b), _mm256_add_ps(a, b),
                            _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
}

static ISA_TARGET inline vec vload_bf16(const uint16_t *p)
{
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

static ISA_TARGET inline void vstore_bf16(uint16_t *p, vec v)
{
    __m256i bits = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16),
                                   _mm256_set1_epi32(1));
    __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb);
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
    __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), is_nan);
    /* packus works within 128-bit lanes: gather the two low quads. */
    __m256i packed = _mm256_packus_epi32(rounded, rounded);
    packed = _mm256_permute4x64_epi64(packed, 0x08);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

static ISA_TARGET inline vec vload_f16(const uint16_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

static ISA_TARGET inline void vstore_f16(uint16_t *p, vec v)
{
    __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT |
                                       _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i *)p, h);
}

/* x > 0 -> 1, x < 0 -> -1, else (zeros, NaN) +0, as sign_of in scalar.c
 * and torch.sign */
static ISA_TARGET inline vec vsign(vec x)
{
    __m256 zero = _mm256_setzero_ps();
    __m256 r = _mm256_blendv_ps(zero, _mm256_set1_ps(1.0f),
                                _mm256_cmp_ps(x, zero, _CMP_GT_OQ));
    return _mm256_blendv_ps(r, _mm256_set1_ps(-1.0f),
                            _mm256_cmp_ps(x, zero, _CMP_LT_OQ));
}

/* Nonzero when any lane is inf or NaN (exponent bits all ones). */
static ISA_TARGET inline int vany_nonfinite(vec x)
{
    __m256i exp_mask = _mm256_set1_epi32(0x7f800000);
    __m256i e = _mm256_and_si256(_mm256_castps_si256(x), exp_mask);
    return _mm256_movemask_ps(
               _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, exp_mask))) != 0;
}

/* Accumulator of the sum of squares: fp32 lanes widened to double. */
typedef struct {
    __m256d lo, hi;
} vsum;

static ISA_TARGET inline vsum vsum_zero(void)
{
    vsum s = {_mm256_setzero_pd(), _mm256_setzero_pd()};
    return s;
}

/* Adds the squares of x's lanes, squared in double as the scalar code does
 * (see avx512.c: a float's square is exact in double). */
static ISA_TARGET inline vsum vsum_add_squares(vsum s, vec x)
{
    __m256d low = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    __m256d high = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    s.lo = _mm256_add_pd(s.lo, _mm256_mul_pd(low, low));
    s.hi = _mm256_add_pd(s.hi, _mm256_mul_pd(high, high));
    return s;
}

static ISA_TARGET inline double vsum_total(vsum s)
{
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(s.lo, s.hi));
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

#include "simd_kernels.h"
