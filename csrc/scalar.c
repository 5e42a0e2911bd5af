/* scalar.c: the scalar kernels, the definition of every operation.
 *
 * Each SIMD variant (x86/) must agree with these to within rounding, and
 * hands its tail elements to them. The update formulas follow torch.optim's
 * single-tensor implementations operation by operation (lerp for the first
 * moment, division by the bias-corrected root), so a run matches torch to a
 * few ulps per step; Adam's element formula lives in optim_math.h, which
 * the CUDA kernels share. See [Note: kernel ranges] in internal.h.
 */
#include <math.h>

#include "internal.h"
#include "zero/half.h"

/* The updated parameter, and its copy-out cast when there is one. */
static inline void store_param(const optim_args *a, int64_t i, float p)
{
    a->param[i] = p;
    if (a->copy_out) {
        store_from_f32(a->copy_out, a->copy_dtype, i, p);
    }
}

static void adam_scalar(const optim_args *a, int64_t begin, int64_t end)
{
    for (int64_t i = begin; i < end; i++) {
        float g = load_as_f32(a->grad, a->grad_dtype, i) * a->grad_scale;
        float *max_v = a->k.amsgrad ? &a->state3[i] : NULL;
        float p = adam_update(&a->k, a->param[i], g, &a->state1[i],
                              &a->state2[i], max_v);
        store_param(a, i, p);
    }
}

static void sgd_scalar(const optim_args *a, int64_t begin, int64_t end)
{
    const optim_consts *k = &a->k;
    for (int64_t i = begin; i < end; i++) {
        float p = a->param[i];
        float g = load_as_f32(a->grad, a->grad_dtype, i) * a->grad_scale;
        if (k->l2 != 0.0f) { /* see adam_update */
            g = g + k->l2 * p;
        }
        if (a->state1) {
            float buf = k->first_step
                            ? g
                            : a->state1[i] * k->momentum +
                                  k->one_minus_dampening * g;
            a->state1[i] = buf;
            g = k->nesterov ? g + k->momentum * buf : buf;
        }
        p = p - k->step_size * g;
        store_param(a, i, p);
    }
}

static inline float sign_of(float x)
{
    return (float)(x > 0.0f) - (float)(x < 0.0f);
}

static void lion_scalar(const optim_args *a, int64_t begin, int64_t end)
{
    const optim_consts *k = &a->k;
    for (int64_t i = begin; i < end; i++) {
        float p = a->param[i];
        float g = load_as_f32(a->grad, a->grad_dtype, i) * a->grad_scale;
        float m = a->state1[i];
        float direction = lerp(m, g, k->one_minus_beta1);
        p = p * k->weight_factor - k->step_size * sign_of(direction);
        a->state1[i] = lerp(m, g, k->one_minus_beta2);
        store_param(a, i, p);
    }
}

static void adagrad_scalar(const optim_args *a, int64_t begin, int64_t end)
{
    const optim_consts *k = &a->k;
    for (int64_t i = begin; i < end; i++) {
        float p = a->param[i];
        float g = load_as_f32(a->grad, a->grad_dtype, i) * a->grad_scale;
        if (k->l2 != 0.0f) { /* see adam_update */
            g = g + k->l2 * p;
        }
        float sum = a->state1[i] + g * g;
        a->state1[i] = sum;
        p = p - k->step_size * (g / (sqrtf(sum) + k->eps));
        store_param(a, i, p);
    }
}

static double sum_squares_scalar(const void *data, zero_dtype dtype,
                                 int64_t begin, int64_t end)
{
    double sum = 0.0;
    for (int64_t i = begin; i < end; i++) {
        double x = load_as_f32(data, dtype, i);
        sum += x * x;
    }
    return sum;
}

static int all_finite_scalar(const void *data, zero_dtype dtype, int64_t begin,
                             int64_t end)
{
    for (int64_t i = begin; i < end; i++) {
        if (!isfinite(load_as_f32(data, dtype, i))) {
            return 0;
        }
    }
    return 1;
}

static void convert_scalar(void *dst, zero_dtype dst_dtype, const void *src,
                           zero_dtype src_dtype, int64_t begin, int64_t end)
{
    if (dst_dtype == src_dtype) {
        size_t size = zero_dtype_size(dst_dtype);
        memcpy((char *)dst + begin * size, (const char *)src + begin * size,
               (size_t)(end - begin) * size);
        return;
    }
    for (int64_t i = begin; i < end; i++) {
        store_from_f32(dst, dst_dtype, i, load_as_f32(src, src_dtype, i));
    }
}

static void triad_scalar(float *a, const float *b, const float *c, float s,
                         int64_t begin, int64_t end)
{
    for (int64_t i = begin; i < end; i++) {
        a[i] = (b ? b[i] : a[i]) + s * c[i];
    }
}

/* dst += src in one dtype, each sum rounded once (to nearest even) */
static void accumulate_scalar(void *dst, const void *src, zero_dtype dtype,
                              int64_t begin, int64_t end)
{
    for (int64_t i = begin; i < end; i++) {
        store_from_f32(dst, dtype, i,
                       load_as_f32(dst, dtype, i) + load_as_f32(src, dtype, i));
    }
}

const isa_kernels scalar_kernels = {
    .adam = adam_scalar,
    .sgd = sgd_scalar,
    .lion = lion_scalar,
    .adagrad = adagrad_scalar,
    .sum_squares = sum_squares_scalar,
    .all_finite = all_finite_scalar,
    .convert = convert_scalar,
    .triad = triad_scalar,
    .accumulate = accumulate_scalar,
};
