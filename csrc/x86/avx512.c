/* avx512.c: the AVX-512 kernels (16 floats a vector; F, BW and VL).
 *
 * Maps the vector vocabulary of simd_kernels.h onto AVX-512 intrinsics, as
 * avx2.c does for AVX2. The bf16 rounding is done with integer arithmetic,
 * not VCVTNEPS2BF16: that instruction flushes subnormals to zero and would
 * break the bit-exact match with torch's cast.
 */
#include <immintrin.h>
#include <stdint.h>

#include "../internal.h"

#define ISA_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define ISA_TABLE avx512_kernels
#define W 16

typedef __m512 vec;

#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, v) _mm512_storeu_ps((p), (v))
#define vstream(p, v) _mm512_stream_ps((p), (v))
#define vset1(x) _mm512_set1_ps(x)
#define vadd(a, b) _mm512_add_ps((a), (b))
#define vsub(a, b) _mm512_sub_ps((a), (b))
#define vmul(a, b) _mm512_mul_ps((a), (b))
#define vdiv(a, b) _mm512_div_ps((a), (b))
#define vsqrt(a) _mm512_sqrt_ps(a)
#define vfmadd(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define vfnmadd(a, b, c) _mm512_fnmadd_ps((a), (b), (c))

/* max(a, b), NaN where either is NaN (max_keeping_nan in optim_math.h) */
static ISA_TARGET inline vec vmax_keeping_nan(vec a, vec b)
{
    return _mm512_mask_add_ps(_mm512_max_ps(a, b), _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q),
                              a, b);
}

static ISA_TARGET inline vec vload_bf16(const uint16_t *p)
{
    __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static ISA_TARGET inline void vstore_bf16(uint16_t *p, vec v)
{
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16),
                                   _mm512_set1_epi32(1));
    __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb);
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
    __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, is_nan,
                                    _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(rounded));
}

static ISA_TARGET inline vec vload_f16(const uint16_t *p)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

static ISA_TARGET inline void vstore_f16(uint16_t *p, vec v)
{
    __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT |
                                       _MM_FROUND_NO_EXC);
    _mm256_storeu_si256((__m256i *)p, h);
}

/* as in avx2.c: zeros and NaN give +0 */
static ISA_TARGET inline vec vsign(vec x)
{
    __m512 zero = _mm512_setzero_ps();
    __mmask16 positive = _mm512_cmp_ps_mask(x, zero, _CMP_GT_OQ);
    __mmask16 negative = _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ);
    __m512 r = _mm512_mask_mov_ps(zero, positive, _mm512_set1_ps(1.0f));
    return _mm512_mask_mov_ps(r, negative, _mm512_set1_ps(-1.0f));
}

static ISA_TARGET inline int vany_nonfinite(vec x)
{
    __m512i exp_mask = _mm512_set1_epi32(0x7f800000);
    __m512i e = _mm512_and_si512(_mm512_castps_si512(x), exp_mask);
    return _mm512_cmpeq_epi32_mask(e, exp_mask) != 0;
}

typedef struct {
    __m512d lo, hi;
} vsum;

static ISA_TARGET inline vsum vsum_zero(void)
{
    vsum s = {_mm512_setzero_pd(), _mm512_setzero_pd()};
    return s;
}

/* Adds the squares of x's lanes, squared in double as the scalar code does
 * (squared in fp32, 1e20 overflowed to inf where the scalar sum is finite,
 * and each square lost ~1e-8 of itself). A float's square is exact in
 * double, so the product rounds nothing; only the order of the sum (by
 * lanes) differs from the scalar code's, within n * 2^-53. */
static ISA_TARGET inline vsum vsum_add_squares(vsum s, vec x)
{
    __m512d low = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    __m512d high = _mm512_cvtps_pd(_mm256_castpd_ps(
        _mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    s.lo = _mm512_add_pd(s.lo, _mm512_mul_pd(low, low));
    s.hi = _mm512_add_pd(s.hi, _mm512_mul_pd(high, high));
    return s;
}

static ISA_TARGET inline double vsum_total(vsum s)
{
    double lanes[8];
    _mm512_storeu_pd(lanes, _mm512_add_pd(s.lo, s.hi));
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
           ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

#include "simd_kernels.h"
