/* simd_kernels.h: the SIMD kernels, written once over a small vector
 * vocabulary that avx2.c and avx512.c define before including this file:
 *
 *   vec, W (floats per vector), ISA_TARGET, ISA_TABLE,
 *   vload vstore vstream (aligned, non-temporal) vset1 vadd vsub vmul vdiv vsqrt vfmadd vfnmadd vmax_keeping_nan,
 *   vload_bf16 vstore_bf16 vload_f16 vstore_f16 vsign vany_nonfinite,
 *   vsum vsum_zero vsum_add_squares vsum_total.
 *
 * Each kernel mirrors its scalar definition in scalar.c operation by
 * operation, with no fused multiply-add where the scalar code rounds twice
 * (built in ISO C mode, gcc does not contract either), so every ISA gives
 * the scalar reference's bits: an element's result does not depend on
 * whether it falls in a vector or a tail, nor on the machine a run resumes
 * on. Each runs whole vectors, and hands the tail to the scalar kernel
 * ([Note: kernel ranges] in internal.h). The dtype of the gradient and of
 * the copy-out are passed to always-inline bodies as constants, so the
 * compiler emits one loop per combination with no per-element branching.
 */
#define ALWAYS_INLINE inline __attribute__((always_inline))

static ISA_TARGET ALWAYS_INLINE vec load_vec(const void *base,
                                             zero_dtype dtype, int64_t i)
{
    switch (dtype) {
    case ZERO_BF16:
        return vload_bf16((const uint16_t *)base + i);
    case ZERO_F16:
        return vload_f16((const uint16_t *)base + i);
    default:
        return vload((const float *)base + i);
    }
}

static ISA_TARGET ALWAYS_INLINE void store_vec(void *base, zero_dtype dtype,
                                               int64_t i, vec v)
{
    switch (dtype) {
    case ZERO_BF16:
        vstore_bf16((uint16_t *)base + i, v);
        break;
    case ZERO_F16:
        vstore_f16((uint16_t *)base + i, v);
        break;
    default:
        vstore((float *)base + i, v);
        break;
    }
}

/* torch's lerp; `small` says weight < 0.5, decided once per call. Not
 * fused, so it rounds exactly as the scalar lerp does: Lion takes the sign
 * of a lerp, and a sign flipped by one rounding would move a parameter by
 * 2 * lr. */
static ISA_TARGET ALWAYS_INLINE vec vlerp(vec start, vec end, vec weight,
                                          vec one_minus_weight, int small)
{
    vec diff = vsub(end, start);
    return small ? vadd(start, vmul(weight, diff))
                 : vsub(end, vmul(diff, one_minus_weight));
}

/* The copy-out modes the bodies are specialised for. */
#define COPY_NONE (-1)

/* The updated parameter, and its copy-out cast when there is one. */
static ISA_TARGET ALWAYS_INLINE void store_param(const optim_args *a,
                                                 int64_t i, vec p,
                                                 int copy_mode)
{
    vstore(a->param + i, p);
    if (copy_mode != COPY_NONE) {
        store_vec(a->copy_out, (zero_dtype)copy_mode, i, p);
    }
}

#define DISPATCH_DTYPES(body, a, begin, end)                                \
    do {                                                                    \
        int copy_mode = (a)->copy_out ? (int)(a)->copy_dtype : COPY_NONE;   \
        switch ((a)->grad_dtype * 4 + (copy_mode + 1)) {                    \
        case ZERO_F32 * 4 + 0: body(a, begin, end, ZERO_F32, COPY_NONE); break; \
        case ZERO_F32 * 4 + 1: body(a, begin, end, ZERO_F32, ZERO_F32); break;  \
        case ZERO_F32 * 4 + 2: body(a, begin, end, ZERO_F32, ZERO_BF16); break; \
        case ZERO_F32 * 4 + 3: body(a, begin, end, ZERO_F32, ZERO_F16); break;  \
        case ZERO_BF16 * 4 + 0: body(a, begin, end, ZERO_BF16, COPY_NONE); break; \
        case ZERO_BF16 * 4 + 1: body(a, begin, end, ZERO_BF16, ZERO_F32); break;  \
        case ZERO_BF16 * 4 + 2: body(a, begin, end, ZERO_BF16, ZERO_BF16); break; \
        case ZERO_BF16 * 4 + 3: body(a, begin, end, ZERO_BF16, ZERO_F16); break;  \
        case ZERO_F16 * 4 + 0: body(a, begin, end, ZERO_F16, COPY_NONE); break; \
        case ZERO_F16 * 4 + 1: body(a, begin, end, ZERO_F16, ZERO_F32); break;  \
        case ZERO_F16 * 4 + 2: body(a, begin, end, ZERO_F16, ZERO_BF16); break; \
        case ZERO_F16 * 4 + 3: body(a, begin, end, ZERO_F16, ZERO_F16); break;  \
        default: break; /* dtypes are validated before the core is called */ \
        }                                                                   \
    } while (0)

static ISA_TARGET ALWAYS_INLINE void adam_body(const optim_args *a,
                                               int64_t begin, int64_t end,
                                               zero_dtype grad_dtype,
                                               int copy_mode)
{
    const optim_consts *k = &a->k;
    const vec scale = vset1(a->grad_scale), l2 = vset1(k->l2);
    const vec weight_factor = vset1(k->weight_factor);
    const vec beta1 = vset1(k->beta1), beta2 = vset1(k->beta2);
    const vec one_minus_beta1 = vset1(k->one_minus_beta1);
    const vec one_minus_beta2 = vset1(k->one_minus_beta2);
    const vec step_size = vset1(k->step_size), eps = vset1(k->eps);
    const vec bias_correction2_sqrt = vset1(k->bias_correction2_sqrt);
    const int small = k->one_minus_beta1 < 0.5f;
    int64_t i = begin;
    for (; i + W <= end; i += W) {
        vec p = vload(a->param + i);
        vec g = vmul(load_vec(a->grad, grad_dtype, i), scale);
        if (k->l2 != 0.0f) { /* see adam_update */
            g = vadd(g, vmul(l2, p));
        }
        p = vmul(p, weight_factor);
        vec m = vlerp(vload(a->state1 + i), g, one_minus_beta1, beta1, small);
        vec v = vadd(vmul(vload(a->state2 + i), beta2),
                     vmul(vmul(one_minus_beta2, g), g));
        vstore(a->state1 + i, m);
        vstore(a->state2 + i, v);
        if (k->amsgrad) {
            v = vmax_keeping_nan(vload(a->state3 + i), v);
            vstore(a->state3 + i, v);
        }
        vec denom = vadd(vdiv(vsqrt(v), bias_correction2_sqrt), eps);
        p = vsub(p, vmul(step_size, vdiv(m, denom)));
        store_param(a, i, p, copy_mode);
    }
    scalar_kernels.adam(a, i, end);
}

static ISA_TARGET void adam_simd(const optim_args *a, int64_t begin,
                                 int64_t end)
{
    DISPATCH_DTYPES(adam_body, a, begin, end);
}

static ISA_TARGET ALWAYS_INLINE void sgd_body(const optim_args *a,
                                              int64_t begin, int64_t end,
                                              zero_dtype grad_dtype,
                                              int copy_mode)
{
    const optim_consts *k = &a->k;
    const vec scale = vset1(a->grad_scale), l2 = vset1(k->l2);
    const vec momentum = vset1(k->momentum);
    const vec one_minus_dampening = vset1(k->one_minus_dampening);
    const vec lr = vset1(k->step_size);
    int64_t i = begin;
    for (; i + W <= end; i += W) {
        vec p = vload(a->param + i);
        vec g = vmul(load_vec(a->grad, grad_dtype, i), scale);
        if (k->l2 != 0.0f) { /* see adam_update */
            g = vadd(g, vmul(l2, p));
        }
        if (a->state1) {
            vec buf = k->first_step
                          ? g
                          : vadd(vmul(vload(a->state1 + i), momentum),
                                 vmul(one_minus_dampening, g));
            vstore(a->state1 + i, buf);
            g = k->nesterov ? vadd(g, vmul(momentum, buf)) : buf;
        }
        p = vsub(p, vmul(lr, g));
        store_param(a, i, p, copy_mode);
    }
    scalar_kernels.sgd(a, i, end);
}

static ISA_TARGET void sgd_simd(const optim_args *a, int64_t begin,
                                int64_t end)
{
    DISPATCH_DTYPES(sgd_body, a, begin, end);
}

static ISA_TARGET ALWAYS_INLINE void lion_body(const optim_args *a,
                                               int64_t begin, int64_t end,
                                               zero_dtype grad_dtype,
                                               int copy_mode)
{
    const optim_consts *k = &a->k;
    const vec scale = vset1(a->grad_scale);
    const vec weight_factor = vset1(k->weight_factor);
    const vec lr = vset1(k->step_size);
    const vec beta1 = vset1(k->beta1), beta2 = vset1(k->beta2);
    const vec one_minus_beta1 = vset1(k->one_minus_beta1);
    const vec one_minus_beta2 = vset1(k->one_minus_beta2);
    const int small1 = k->one_minus_beta1 < 0.5f;
    const int small2 = k->one_minus_beta2 < 0.5f;
    int64_t i = begin;
    for (; i + W <= end; i += W) {
        vec p = vload(a->param + i);
        vec g = vmul(load_vec(a->grad, grad_dtype, i), scale);
        vec m = vload(a->state1 + i);
        vec direction = vlerp(m, g, one_minus_beta1, beta1, small1);
        p = vfnmadd(lr, vsign(direction), vmul(p, weight_factor));
        vstore(a->state1 + i, vlerp(m, g, one_minus_beta2, beta2, small2));
        store_param(a, i, p, copy_mode);
    }
    scalar_kernels.lion(a, i, end);
}

static ISA_TARGET void lion_simd(const optim_args *a, int64_t begin,
                                 int64_t end)
{
    DISPATCH_DTYPES(lion_body, a, begin, end);
}

static ISA_TARGET ALWAYS_INLINE void adagrad_body(const optim_args *a,
                                                  int64_t begin, int64_t end,
                                                  zero_dtype grad_dtype,
                                                  int copy_mode)
{
    const optim_consts *k = &a->k;
    const vec scale = vset1(a->grad_scale), l2 = vset1(k->l2);
    const vec clr = vset1(k->step_size), eps = vset1(k->eps);
    int64_t i = begin;
    for (; i + W <= end; i += W) {
        vec p = vload(a->param + i);
        vec g = vmul(load_vec(a->grad, grad_dtype, i), scale);
        if (k->l2 != 0.0f) { /* see adam_update */
            g = vadd(g, vmul(l2, p));
        }
        vec sum = vadd(vload(a->state1 + i), vmul(g, g));
        vstore(a->state1 + i, sum);
        p = vsub(p, vmul(clr, vdiv(g, vadd(vsqrt(sum), eps))));
        store_param(a, i, p, copy_mode);
    }
    scalar_kernels.adagrad(a, i, end);
}

static ISA_TARGET void adagrad_simd(const optim_args *a, int64_t begin,
                                    int64_t end)
{
    DISPATCH_DTYPES(adagrad_body, a, begin, end);
}

static ISA_TARGET ALWAYS_INLINE double sum_squares_body(const void *data,
                                                        zero_dtype dtype,
                                                        int64_t begin,
                                                        int64_t end)
{
    vsum acc = vsum_zero();
    int64_t i = begin;
    for (; i + W <= end; i += W) {
        vec x = load_vec(data, dtype, i);
        acc = vsum_add_squares(acc, x);
    }
    return vsum_total(acc) +
           scalar_kernels.sum_squares(data, dtype, i, end);
}

static ISA_TARGET double sum_squares_simd(const void *data, zero_dtype dtype,
                                          int64_t begin, int64_t end)
{
    switch (dtype) {
    case ZERO_BF16:
        return sum_squares_body(data, ZERO_BF16, begin, end);
    case ZERO_F16:
        return sum_squares_body(data, ZERO_F16, begin, end);
    default:
        return sum_squares_body(data, ZERO_F32, begin, end);
    }
}

static ISA_TARGET ALWAYS_INLINE int all_finite_body(const void *data,
                                                    zero_dtype dtype,
                                                    int64_t begin, int64_t end)
{
    int64_t i = begin;
    for (; i + W <= end; i += W) {
        if (vany_nonfinite(load_vec(data, dtype, i))) {
            return 0;
        }
    }
    return scalar_kernels.all_finite(data, dtype, i, end);
}

static ISA_TARGET int all_finite_simd(const void *data, zero_dtype dtype,
                                      int64_t begin, int64_t end)
{
    switch (dtype) {
    case ZERO_BF16:
        return all_finite_body(data, ZERO_BF16, begin, end);
    case ZERO_F16:
        return all_finite_body(data, ZERO_F16, begin, end);
    default:
        return all_finite_body(data, ZERO_F32, begin, end);
    }
}

static ISA_TARGET ALWAYS_INLINE void convert_body(void *dst,
                                                  zero_dtype dst_dtype,
                                                  const void *src,
                                                  zero_dtype src_dtype,
                                                  int64_t begin, int64_t end)
{
    int64_t i = begin;
    for (; i + W <= end; i += W) {
        store_vec(dst, dst_dtype, i, load_vec(src, src_dtype, i));
    }
    scalar_kernels.convert(dst, dst_dtype, src, src_dtype, i, end);
}

static ISA_TARGET void convert_simd(void *dst, zero_dtype dst_dtype,
                                    const void *src, zero_dtype src_dtype,
                                    int64_t begin, int64_t end)
{
    if (dst_dtype == src_dtype) {
        scalar_kernels.convert(dst, dst_dtype, src, src_dtype, begin, end);
    } else if (dst_dtype == ZERO_F32 && src_dtype == ZERO_BF16) {
        convert_body(dst, ZERO_F32, src, ZERO_BF16, begin, end);
    } else if (dst_dtype == ZERO_F32 && src_dtype == ZERO_F16) {
        convert_body(dst, ZERO_F32, src, ZERO_F16, begin, end);
    } else if (dst_dtype == ZERO_BF16 && src_dtype == ZERO_F32) {
        convert_body(dst, ZERO_BF16, src, ZERO_F32, begin, end);
    } else if (dst_dtype == ZERO_F16 && src_dtype == ZERO_F32) {
        convert_body(dst, ZERO_F16, src, ZERO_F32, begin, end);
    } else {
        /* bf16 <-> fp16 goes through fp32, which is exact for both */
        convert_body(dst, dst_dtype, src, src_dtype, begin, end);
    }
}

/* Non-temporal stores: `a` is only written, and a plain store would first
 * read each line (write-allocate), moving 16 bytes an element where STREAM
 * counts 12. Streaming the stores makes the triad's count its real traffic,
 * so it measures the memory's bandwidth, not the store policy. */
static ISA_TARGET void triad_simd(float *a, const float *b, const float *c,
                                  float s, int64_t begin, int64_t end)
{
    const vec scalar = vset1(s);
    int64_t i = begin;
    if (!b) {
        /* in place, a = a + s * c: every written line was just read, as in
         * an optimizer step, so plain stores cost no extra traffic */
        for (; i + W <= end; i += W) {
            vstore(a + i, vfmadd(scalar, vload(c + i), vload(a + i)));
        }
        scalar_kernels.triad(a, b, c, s, i, end);
        return;
    }
    while (i < end && ((uintptr_t)(a + i) % sizeof(vec)) != 0) {
        i++;
    }
    scalar_kernels.triad(a, b, c, s, begin, i);
    for (; i + W <= end; i += W) {
        vstream(a + i, vfmadd(scalar, vload(c + i), vload(b + i)));
    }
    _mm_sfence();
    scalar_kernels.triad(a, b, c, s, i, end);
}

static ISA_TARGET ALWAYS_INLINE void accumulate_body(void *dst,
                                                     const void *src,
                                                     zero_dtype dtype,
                                                     int64_t begin, int64_t end)
{
    int64_t i = begin;
    for (; i + W <= end; i += W) {
        store_vec(dst, dtype, i, vadd(load_vec(dst, dtype, i), load_vec(src, dtype, i)));
    }
    scalar_kernels.accumulate(dst, src, dtype, i, end);
}

static ISA_TARGET void accumulate_simd(void *dst, const void *src,
                                       zero_dtype dtype, int64_t begin,
                                       int64_t end)
{
    switch (dtype) {
    case ZERO_BF16:
        accumulate_body(dst, src, ZERO_BF16, begin, end);
        break;
    case ZERO_F16:
        accumulate_body(dst, src, ZERO_F16, begin, end);
        break;
    default:
        accumulate_body(dst, src, ZERO_F32, begin, end);
        break;
    }
}

const isa_kernels ISA_TABLE = {
    .adam = adam_simd,
    .sgd = sgd_simd,
    .lion = lion_simd,
    .adagrad = adagrad_simd,
    .sum_squares = sum_squares_simd,
    .all_finite = all_finite_simd,
    .convert = convert_simd,
    .triad = triad_simd,
    .accumulate = accumulate_simd,
};
