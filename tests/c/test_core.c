/* test_core.c: tests of the C core without Python, run under AddressSanitizer
 * and UBSan (make test-c).
 *
 * Every SIMD path this CPU has is checked against the scalar reference, the
 * definition of each operation: random data, lengths 0 to a few thousand,
 * starts that are not vector-aligned, every gradient and copy-out dtype.
 * The reference itself is checked against independent facts (known fp16 and
 * bf16 encodings, a double-precision sum of squares).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/zero.h"
#include "zero/half.h"
#include "check.h"

/* xorshift64*: deterministic random data, no libc rand state. */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t next_u64(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545f4914f6cdd1dull;
}

/* uniform in [-1, 1) */
static float uniform(void)
{
    return (float)((double)(next_u64() >> 11) * 0x1p-52 - 1.0);
}

static float *random_floats(int64_t n, float scale, int positive)
{
    float *x = malloc((size_t)(n + 32) * sizeof *x);
    for (int64_t i = 0; i < n + 32; i++) {
        float u = uniform() * scale;
        x[i] = positive ? fabsf(u) : u;
    }
    return x;
}

/* Relative closeness with an absolute floor for values near zero. */
static int close_enough(float got, float want, float rtol, float atol)
{
    if (isnan(got) || isnan(want)) {
        return isnan(got) && isnan(want);
    }
    return fabsf(got - want) <= atol + rtol * fabsf(want);
}

/* ---- conversions ----------------------------------------------------- */

static void test_known_encodings(void)
{
    CHECK(f32_to_f16(1.0f) == 0x3c00, "fp16(1)");
    CHECK(f32_to_f16(-2.0f) == 0xc000, "fp16(-2)");
    CHECK(f32_to_f16(65504.0f) == 0x7bff, "fp16(65504)");
    CHECK(f32_to_f16(65519.0f) == 0x7bff, "fp16(65519) stays finite");
    CHECK(f32_to_f16(65520.0f) == 0x7c00, "fp16(65520) rounds to inf");
    CHECK(f32_to_f16(0x1p-24f) == 0x0001, "fp16 smallest subnormal");
    CHECK(f32_to_f16(0x1p-25f) == 0x0000, "fp16 half of smallest: even 0");
    CHECK(f32_to_f16(0x1.8p-24f) == 0x0002, "fp16 1.5 units: even 2");
    CHECK(f32_to_f16(0x1p-14f) == 0x0400, "fp16 smallest normal");
    CHECK(f16_to_f32(0x0001) == 0x1p-24f, "fp16 subnormal to fp32");
    CHECK(f16_to_f32(0xfbff) == -65504.0f, "fp16 lowest to fp32");
    /* 1 + 2^-11 is halfway between 1 and the next half: ties to even */
    CHECK(f32_to_f16(1.0f + 0x1p-11f) == 0x3c00, "fp16 tie to even");
    CHECK(f32_to_f16(1.0f + 0x1p-11f + 0x1p-20f) == 0x3c01,
          "fp16 above tie");
    CHECK(f32_to_bf16(1.0f) == 0x3f80, "bf16(1)");
    CHECK(f32_to_bf16(f32_from_bits(0x3f808000u)) == 0x3f80,
          "bf16 tie to even (down)");
    CHECK(f32_to_bf16(f32_from_bits(0x3f818000u)) == 0x3f82,
          "bf16 tie to even (up)");
    CHECK(f32_to_bf16(NAN) == 0x7fc0, "bf16 NaN");
    CHECK(f32_to_bf16(f32_from_bits(0x7f7fffffu)) == 0x7f80,
          "bf16 max float rounds to inf");
}

static const zero_dtype all_dtypes[] = {ZERO_F32, ZERO_BF16, ZERO_F16};

/* Every 16-bit pattern widened, and random plus special fp32 values
 * narrowed, must match the scalar reference bit for bit on every path. */
static void test_convert_paths(zero_isa isa)
{
    int64_t n = 65536 + 7;
    uint16_t *halves = malloc((size_t)n * 2);
    float *wide = malloc((size_t)n * 4), *ref = malloc((size_t)n * 4);
    uint16_t *narrow = malloc((size_t)n * 2), *narrow_ref = malloc((size_t)n * 2);
    for (int64_t i = 0; i < n; i++) {
        halves[i] = (uint16_t)i;
    }
    for (int d = 1; d < 3; d++) {
        zero_dtype half = all_dtypes[d];
        zero_isa_set(ZERO_ISA_SCALAR);
        zero_convert(ref, ZERO_F32, halves, half, n);
        zero_isa_set(isa);
        zero_convert(wide, ZERO_F32, halves, half, n);
        CHECK(memcmp(wide, ref, (size_t)n * 4) == 0,
              "%s: widening %s differs from scalar", zero_isa_name(isa),
              zero_dtype_name(half));

        float *values = malloc((size_t)n * 4);
        for (int64_t i = 0; i < n; i++) {
            uint32_t bits = (uint32_t)next_u64();
            /* mostly values in the 16-bit ranges, some raw bit patterns */
            values[i] = (i % 4) ? uniform() * 70000.0f * powf(2.0f, -(float)(i % 40))
                                : f32_from_bits(bits);
        }
        values[0] = INFINITY;
        values[1] = -INFINITY;
        values[2] = -0.0f;
        values[3] = 65520.0f;
        values[4] = 0x1p-25f;
        values[5] = f32_from_bits(0x7fa00001u); /* signalling NaN */
        zero_isa_set(ZERO_ISA_SCALAR);
        zero_convert(narrow_ref, half, values, ZERO_F32, n);
        zero_isa_set(isa);
        zero_convert(narrow, half, values, ZERO_F32, n);
        int64_t mismatches = 0;
        for (int64_t i = 0; i < n; i++) {
            mismatches += narrow[i] != narrow_ref[i];
        }
        CHECK(mismatches == 0, "%s: narrowing to %s: %lld of %lld differ",
              zero_isa_name(isa), zero_dtype_name(half),
              (long long)mismatches, (long long)n);
        free(values);
    }
    free(halves);
    free(wide);
    free(ref);
    free(narrow);
    free(narrow_ref);
}

/* ---- optimizers ------------------------------------------------------ */

enum { ADAMW, ADAM_AMSGRAD, SGD_NESTEROV, SGD_FIRST, LION, ADAGRAD, NKINDS };
static const char *const kind_names[NKINDS] = {
    "adamw", "adam+amsgrad", "sgd nesterov", "sgd first step", "lion",
    "adagrad"};

typedef struct {
    float *param, *s1, *s2, *s3;
    void *grad, *copy;
} case_buffers;

static zero_status run_kind(int kind, case_buffers *b, int64_t n,
                            zero_dtype grad_dtype, int copy_mode)
{
    zero_flat flat = {b->param, b->grad, grad_dtype,
                      copy_mode < 0 ? NULL : b->copy, (zero_dtype)(copy_mode < 0 ? 0 : copy_mode), n};
    switch (kind) {
    case ADAMW:
    case ADAM_AMSGRAD: {
        zero_adam_state st = {b->s1, b->s2, b->s3};
        zero_adam_hparams hp = {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999,
                                .eps = 1e-8, .weight_decay = 0.01,
                                .decoupled = kind == ADAMW,
                                .amsgrad = kind == ADAM_AMSGRAD, .step = 3,
                                .grad_scale = 0.5};
        return zero_adam_step(&flat, &st, &hp);
    }
    case SGD_NESTEROV:
    case SGD_FIRST: {
        zero_sgd_hparams hp = {.lr = 0.1, .momentum = 0.9, .dampening = 0.0,
                               .weight_decay = 1e-3,
                               .nesterov = kind == SGD_NESTEROV,
                               .first_step = kind == SGD_FIRST,
                               .grad_scale = 2.0};
        return zero_sgd_step(&flat, b->s1, &hp);
    }
    case LION: {
        zero_lion_hparams hp = {.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.99,
                                .weight_decay = 0.1, .grad_scale = 1.0};
        return zero_lion_step(&flat, b->s1, &hp);
    }
    default: {
        zero_adagrad_hparams hp = {.lr = 1e-2, .lr_decay = 0.01,
                                   .weight_decay = 0.0, .eps = 1e-10,
                                   .step = 4, .grad_scale = 1.0};
        return zero_adagrad_step(&flat, b->s1, &hp);
    }
    }
}

static void fill_case(case_buffers *b, const float *param, const float *s1,
                      const float *s2, const float *s3, int64_t n)
{
    memcpy(b->param, param, (size_t)n * 4);
    memcpy(b->s1, s1, (size_t)n * 4);
    memcpy(b->s2, s2, (size_t)n * 4);
    memcpy(b->s3, s3, (size_t)n * 4);
}

static int64_t compare_floats(const float *got, const float *want, int64_t n)
{
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        /* bit for bit: every ISA computes the scalar reference's operations
         * in its order, with no fused multiply-add (a NaN is a NaN: its
         * payload is not part of the contract) */
        bad += memcmp(&got[i], &want[i], sizeof(float)) != 0 &&
               !(isnan(got[i]) && isnan(want[i]));
    }
    return bad;
}

/* Non-finite inputs sprinkled over the vector bodies and scalar tails: a
 * NaN or inf gradient, an inf parameter. Every path must still give the
 * scalar reference's result (before, Lion's SIMD sign kept a NaN the
 * scalar code turns into 0, and amsgrad's SIMD max kept one fmaxf drops). */
static int with_specials = 0;

static void add_specials(float *param, float *grad32, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        if (i % 13 == 5 || i == n - 1) {
            grad32[i] = NAN;
        } else if (i % 17 == 3) {
            grad32[i] = (i & 1) ? INFINITY : -INFINITY;
        } else if (i % 19 == 7) {
            param[i] = (i & 1) ? INFINITY : -INFINITY;
        }
    }
}

static void test_optimizer_case(zero_isa isa, int kind, int64_t n,
                                int offset, zero_dtype grad_dtype,
                                int copy_mode)
{
    float *param = random_floats(n, 1.0f, 0);
    /* Adagrad's state is a sum of squares: never negative */
    float *s1 = random_floats(n, 0.1f, kind == ADAGRAD);
    float *s2 = random_floats(n, 0.01f, 1);
    float *s3 = random_floats(n, 0.01f, 1);
    float *grad32 = random_floats(n, 1.0f, 0);
    if (with_specials) {
        add_specials(param, grad32, n);
    }
    /* gradient buffer in the wanted dtype */
    void *grad = malloc((size_t)(n + 32) * 4);
    zero_isa_set(ZERO_ISA_SCALAR);
    zero_convert(grad, grad_dtype, grad32, ZERO_F32, n + 32);

    case_buffers ref, out;
    case_buffers *all[2] = {&ref, &out};
    for (int k = 0; k < 2; k++) {
        case_buffers *b = all[k];
        /* allocate with slack, then shift the start by `offset` elements so
         * vectors are not aligned */
        b->param = (float *)malloc((size_t)(n + 32) * 4) + offset;
        b->s1 = (float *)malloc((size_t)(n + 32) * 4) + offset;
        b->s2 = (float *)malloc((size_t)(n + 32) * 4) + offset;
        b->s3 = (float *)malloc((size_t)(n + 32) * 4) + offset;
        b->copy = (char *)malloc((size_t)(n + 32) * 4) + offset * 4;
        b->grad = (char *)grad + offset * zero_dtype_size(grad_dtype);
        fill_case(b, param, s1, s2, s3, n);
    }
    zero_isa_set(ZERO_ISA_SCALAR);
    zero_status st_ref = run_kind(kind, &ref, n, grad_dtype, copy_mode);
    zero_isa_set(isa);
    zero_status st_out = run_kind(kind, &out, n, grad_dtype, copy_mode);
    CHECK(st_ref == ZERO_OK && st_out == ZERO_OK, "status %d %d", st_ref,
          st_out);

    int64_t bad = compare_floats(out.param, ref.param, n) +
                  compare_floats(out.s1, ref.s1, n) +
                  compare_floats(out.s2, ref.s2, n) +
                  compare_floats(out.s3, ref.s3, n);
    CHECK(bad == 0, "%s %s n=%lld offset=%d grad=%s copy=%d specials=%d: %lld "
          "elements off", zero_isa_name(isa), kind_names[kind], (long long)n,
          offset, zero_dtype_name(grad_dtype), copy_mode, with_specials,
          (long long)bad);
    if (copy_mode >= 0) {
        /* The copy-out must be exactly the cast of this path's own result. */
        int64_t mismatches = 0;
        for (int64_t i = 0; i < n; i++) {
            float p = out.param[i];
            if (copy_mode == ZERO_F32) {
                mismatches += ((float *)out.copy)[i] != p;
            } else {
                uint16_t want = copy_mode == ZERO_BF16 ? f32_to_bf16(p)
                                                       : f32_to_f16(p);
                mismatches += ((uint16_t *)out.copy)[i] != want;
            }
        }
        CHECK(mismatches == 0, "%s %s copy-out %s: %lld mismatches",
              zero_isa_name(isa), kind_names[kind],
              zero_dtype_name((zero_dtype)copy_mode), (long long)mismatches);
    }
    for (int k = 0; k < 2; k++) {
        case_buffers *b = all[k];
        free(b->param - offset);
        free(b->s1 - offset);
        free(b->s2 - offset);
        free(b->s3 - offset);
        free((char *)b->copy - offset * 4);
    }
    free(param);
    free(s1);
    free(s2);
    free(s3);
    free(grad32);
    free(grad);
}

static void test_optimizer_paths(zero_isa isa)
{
    static const int64_t lengths[] = {0, 1, 7, 8, 15, 16, 17, 31, 33, 100,
                                      257, 1000, 4099};
    for (size_t li = 0; li < sizeof lengths / sizeof *lengths; li++) {
        for (int kind = 0; kind < NKINDS; kind++) {
            for (int g = 0; g < 3; g++) {
                for (int copy = -1; copy < 3; copy++) {
                    int offset = (int)((li + kind + g) % 4);
                    test_optimizer_case(isa, kind, lengths[li], offset,
                                        all_dtypes[g], copy);
                }
            }
        }
    }
    with_specials = 1;
    for (int64_t n = 1; n <= 70; n += 23) {
        for (int kind = 0; kind < NKINDS; kind++) {
            for (int g = 0; g < 3; g++) {
                test_optimizer_case(isa, kind, n, (int)(n % 4), all_dtypes[g], ZERO_BF16);
            }
        }
    }
    with_specials = 0;
}

/* ---- reductions ------------------------------------------------------ */

static void test_reductions(zero_isa isa)
{
    int64_t n = 100003; /* several norm blocks and a ragged tail */
    float *x = random_floats(n, 3.0f, 0);
    void *buf = malloc((size_t)n * 4);
    for (int d = 0; d < 3; d++) {
        zero_dtype dtype = all_dtypes[d];
        zero_isa_set(ZERO_ISA_SCALAR);
        zero_convert(buf, dtype, x, ZERO_F32, n);
        double exact = 0.0;
        for (int64_t i = 0; i < n; i++) {
            double v = load_as_f32(buf, dtype, i);
            exact += v * v;
        }
        zero_isa_set(isa);
        double got = -1.0;
        CHECK(zero_sum_squares(buf, dtype, n, &got) == ZERO_OK, "status");
        /* each square exact in double, n positive terms summed in another
         * order: at most n * 2^-53 apart, 1.1e-11 here (squared in fp32,
         * SIMD was ~4e-10 off: each square rounded to 24 bits) */
        CHECK(fabs(got - exact) <= 1.2e-11 * exact, "%s sum_squares %s: "
              "%.17g vs %.17g", zero_isa_name(isa), zero_dtype_name(dtype),
              got, exact);
        int finite = 0;
        zero_check_finite(buf, dtype, n, &finite);
        CHECK(finite == 1, "%s all finite %s", zero_isa_name(isa),
              zero_dtype_name(dtype));
        /* a non-finite value anywhere, the tail included, is found */
        int64_t spots[] = {0, 5, n / 2, n - 1};
        for (size_t s = 0; s < 4; s++) {
            float bad = s % 2 ? NAN : -INFINITY;
            zero_convert((char *)buf + spots[s] * zero_dtype_size(dtype),
                         dtype, &bad, ZERO_F32, 1);
            zero_check_finite(buf, dtype, n, &finite);
            CHECK(finite == 0, "%s non-finite at %lld (%s) missed",
                  zero_isa_name(isa), (long long)spots[s],
                  zero_dtype_name(dtype));
            double with_bad = 0.0;
            zero_sum_squares(buf, dtype, n, &with_bad);
            CHECK(!isfinite(with_bad), "sum of squares hides a non-finite");
            zero_convert((char *)buf + spots[s] * zero_dtype_size(dtype),
                         dtype, x + spots[s], ZERO_F32, 1);
        }
    }
    /* squares past fp32's range, in vectors and in the tail alike: the sum
     * is finite in double (SIMD squared in fp32 and gave inf) */
    float big[37];
    for (int i = 0; i < 37; i++) {
        big[i] = 1e20f;
    }
    double big_sum = 0.0;
    zero_isa_set(isa);
    CHECK(zero_sum_squares(big, ZERO_F32, 37, &big_sum) == ZERO_OK, "status");
    double big_exact = 37.0 * ((double)big[0] * (double)big[0]);
    CHECK(isfinite(big_sum) && fabs(big_sum - big_exact) <= 1e-12 * big_exact,
          "%s sum_squares of 1e20s: %.17g", zero_isa_name(isa), big_sum);
    float *a = malloc((size_t)n * 4), *c = random_floats(n, 1.0f, 0);
    zero_stream_triad(a, x, c, 3.0f, n);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        bad += !close_enough(a[i], x[i] + 3.0f * c[i], 1e-6f, 1e-6f);
    }
    CHECK(bad == 0, "%s triad: %lld off", zero_isa_name(isa), (long long)bad);
    /* in place: a = a + 3c, starting from the triad's result */
    zero_stream_triad(a, NULL, c, 3.0f, n);
    bad = 0;
    for (int64_t i = 0; i < n; i++) {
        bad += !close_enough(a[i], x[i] + 6.0f * c[i], 1e-5f, 1e-5f);
    }
    CHECK(bad == 0, "%s in-place triad: %lld off", zero_isa_name(isa),
          (long long)bad);
    free(a);
    free(c);
    free(x);
    free(buf);
}

/* The pool must give the same bits for any thread count: elementwise
 * kernels trivially, the sum of squares by its fixed blocks. */
static void test_threads(void)
{
    int64_t n = (1 << 20) + 5;
    float *x = random_floats(n, 1.0f, 0);
    double sums[3];
    int counts[3] = {1, 2, 5};
    for (int t = 0; t < 3; t++) {
        CHECK(zero_threads_set(counts[t]) == ZERO_OK, "threads_set");
        CHECK(zero_threads_get() == counts[t], "threads_get");
        zero_sum_squares(x, ZERO_F32, n, &sums[t]);
    }
    CHECK(sums[0] == sums[1] && sums[1] == sums[2],
          "sum of squares depends on threads: %.17g %.17g %.17g", sums[0],
          sums[1], sums[2]);
    float *p1 = random_floats(n, 1.0f, 0), *p2 = malloc((size_t)n * 4);
    float *m1 = calloc((size_t)n, 4), *m2 = calloc((size_t)n, 4);
    float *v1 = calloc((size_t)n, 4), *v2 = calloc((size_t)n, 4);
    memcpy(p2, p1, (size_t)n * 4);
    zero_adam_hparams hp = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999,
                            .eps = 1e-8, .weight_decay = 0.01, .decoupled = 1,
                            .step = 1, .grad_scale = 1.0};
    zero_flat f1 = {p1, x, ZERO_F32, NULL, ZERO_F32, n};
    zero_flat f2 = {p2, x, ZERO_F32, NULL, ZERO_F32, n};
    zero_adam_state s1 = {m1, v1, NULL}, s2 = {m2, v2, NULL};
    zero_threads_set(1);
    zero_adam_step(&f1, &s1, &hp);
    zero_threads_set(3);
    zero_adam_step(&f2, &s2, &hp);
    CHECK(memcmp(p1, p2, (size_t)n * 4) == 0, "adam differs across threads");
    CHECK(zero_threads_set(-1) == ZERO_ERR_INVALID_ARGUMENT,
          "negative thread count accepted");
    zero_threads_set(0);
    free(x);
    free(p1);
    free(p2);
    free(m1);
    free(m2);
    free(v1);
    free(v2);
}

static void test_bad_arguments(void)
{
    float p[4] = {0}, g[4] = {0}, m[4] = {0}, v[4] = {0};
    zero_adam_state st = {m, v, NULL};
    zero_adam_hparams hp = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999,
                            .step = 1, .grad_scale = 1.0};
    zero_flat negative = {p, g, ZERO_F32, NULL, ZERO_F32, -1};
    CHECK(zero_adam_step(&negative, &st, &hp) == ZERO_ERR_INVALID_ARGUMENT,
          "negative n");
    zero_flat null_param = {NULL, g, ZERO_F32, NULL, ZERO_F32, 4};
    CHECK(zero_adam_step(&null_param, &st, &hp) == ZERO_ERR_INVALID_ARGUMENT,
          "null param");
    zero_flat bad_dtype = {p, g, (zero_dtype)7, NULL, ZERO_F32, 4};
    CHECK(zero_adam_step(&bad_dtype, &st, &hp) == ZERO_ERR_UNSUPPORTED_DTYPE,
          "bad dtype");
    zero_flat ok = {p, g, ZERO_F32, NULL, ZERO_F32, 4};
    hp.step = 0;
    CHECK(zero_adam_step(&ok, &st, &hp) == ZERO_ERR_INVALID_ARGUMENT,
          "step 0");
    hp.step = 1;
    hp.amsgrad = 1;
    CHECK(zero_adam_step(&ok, &st, &hp) == ZERO_ERR_INVALID_ARGUMENT,
          "amsgrad without its buffer");
    CHECK(zero_isa_set((zero_isa)99) == ZERO_ERR_UNSUPPORTED_ISA, "isa 99");
    double out;
    CHECK(zero_sum_squares(NULL, ZERO_F32, 3, &out) ==
              ZERO_ERR_INVALID_ARGUMENT, "null data");
}

int main(void)
{
    printf("cpu features: %s; best path: %s\n", zero_cpu_features(),
           zero_isa_name(zero_isa_best()));
    test_known_encodings();
    test_bad_arguments();
    test_threads();
    for (int isa = 0; isa < ZERO_ISA_COUNT; isa++) {
        if (!zero_isa_supported((zero_isa)isa)) {
            printf("path %s: not supported by this CPU, not tested\n",
                   zero_isa_name((zero_isa)isa));
            continue;
        }
        printf("path %s\n", zero_isa_name((zero_isa)isa));
        test_convert_paths((zero_isa)isa);
        test_optimizer_paths((zero_isa)isa);
        test_reductions((zero_isa)isa);
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
