/* optim_math.h: the per-element Adam formula and its constants, shared by
 * the scalar reference (csrc/scalar.c, csrc/optim.c) and the CUDA kernels
 * (kernels/adam.cuh), which nvcc compiles from this same text; hence in
 * include/zero/ (dtype.h).
 *
 * One definition keeps the GPU computing the reference's operations in the
 * reference's order (the kernels are built with --fmad=false, so nvcc does
 * not fuse them either): the GPU parity tests then check indexing, dtypes
 * and the skip flag, not a second transcription of the formula.
 * Plain C that nvcc also accepts; no host-only calls.
 */
#ifndef ZERO_OPTIM_MATH_H
#define ZERO_OPTIM_MATH_H

#include <math.h>

#ifdef __CUDACC__
#define ZERO_HOST_DEVICE __host__ __device__
#else
#define ZERO_HOST_DEVICE
#endif

/* Constants of one optimizer step, computed once in double precision the way
 * torch.optim computes them, then rounded to float for the kernels. */
typedef struct {
    float weight_factor;   /* 1 - lr * weight_decay (AdamW, Lion), else 1 */
    float l2;              /* weight_decay added to the gradient (Adam, SGD,
                              Adagrad), else 0 */
    float beta1, beta2;
    float one_minus_beta1, one_minus_beta2;
    float step_size;       /* Adam: lr / (1 - beta1^t); SGD, Lion: lr;
                              Adagrad: lr / (1 + (t - 1) * lr_decay) */
    float bias_correction2_sqrt; /* Adam: sqrt(1 - beta2^t) */
    float eps;
    float momentum, one_minus_dampening; /* SGD */
    int amsgrad, nesterov, first_step;
} optim_consts;

/* torch's lerp: exact at both ends, stable for weights on either side. */
static inline ZERO_HOST_DEVICE float lerp(float start, float end, float weight)
{
    if (weight < 0.5f) {
        return start + weight * (end - start);
    }
    return end - (end - start) * (1.0f - weight);
}

/* Adam's step-dependent constants for step t (1 on the first update), in
 * double as torch.optim computes them in Python. */
static inline ZERO_HOST_DEVICE void adam_bias_corrections(
    double lr, double beta1, double beta2, double t, float *step_size,
    float *bias_correction2_sqrt)
{
    *step_size = (float)(lr / (1.0 - pow(beta1, t)));
    *bias_correction2_sqrt = (float)sqrt(1.0 - pow(beta2, t));
}

/* max(a, b), NaN when either is NaN, as torch.maximum (fmaxf drops a NaN:
 * amsgrad's max_exp_avg_sq would then differ from torch's). */
static inline ZERO_HOST_DEVICE float max_keeping_nan(float a, float b)
{
    if (a != a || b != b) {
        return a + b;
    }
    return a > b ? a : b;
}

/* One Adam/AdamW update of one element, following torch.optim's
 * single-tensor implementation operation by operation. g is the gradient
 * already multiplied by grad_scale; m, v (and max_v for amsgrad, else NULL)
 * are updated in place; returns the new parameter. */
static inline ZERO_HOST_DEVICE float adam_update(const optim_consts *k,
                                                 float p, float g, float *m,
                                                 float *v, float *max_v)
{
    if (k->l2 != 0.0f) { /* as torch: 0 * inf would make an inf parameter NaN */
        g = g + k->l2 * p;
    }
    p = p * k->weight_factor;
    float m1 = lerp(*m, g, k->one_minus_beta1);
    float v1 = *v * k->beta2 + k->one_minus_beta2 * g * g;
    *m = m1;
    *v = v1;
    if (max_v) {
        v1 = max_keeping_nan(*max_v, v1);
        *max_v = v1;
    }
    float denom = sqrtf(v1) / k->bias_correction2_sqrt + k->eps;
    return p - k->step_size * (m1 / denom);
}

#endif /* ZERO_OPTIM_MATH_H */
