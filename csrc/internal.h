/* internal.h: what the core's files share and callers of zero.h never see:
 * the argument blocks the optimizer kernels take, the per-ISA kernel table,
 * and the parallel-for of the thread pool.
 *
 * [Note: kernel ranges] A kernel processes elements [begin, end) of its
 * buffers. The SIMD variants do the whole vectors and hand the tail to the
 * scalar kernel, which is the definition of every operation; the SIMD code is
 * tested against it (tests/c).
 */
#ifndef ZERO_INTERNAL_H
#define ZERO_INTERNAL_H

#include "zero.h"
#include "zero/optim_math.h"

typedef struct {
    float *param;          /* [n] */
    const void *grad;      /* [n] grad_dtype */
    void *copy_out;        /* [n] copy_dtype, or NULL */
    float *state1;         /* [n] Adam/Lion exp_avg, SGD momentum, Adagrad sum */
    float *state2;         /* [n] Adam exp_avg_sq */
    float *state3;         /* [n] Adam max_exp_avg_sq (amsgrad) */
    zero_dtype grad_dtype;
    zero_dtype copy_dtype;
    float grad_scale;
    optim_consts k;
} optim_args;

typedef void (*optim_kernel)(const optim_args *a, int64_t begin, int64_t end);

/* One entry per ISA; a NULL entry means "not built for this target". */
typedef struct {
    optim_kernel adam, sgd, lion, adagrad;
    /* Sum of squares of [begin, end) as fp32 lanes widened to double. */
    double (*sum_squares)(const void *data, zero_dtype dtype, int64_t begin,
                          int64_t end);
    /* 1 when [begin, end) holds no inf or NaN. */
    int (*all_finite)(const void *data, zero_dtype dtype, int64_t begin,
                      int64_t end);
    void (*convert)(void *dst, zero_dtype dst_dtype, const void *src,
                    zero_dtype src_dtype, int64_t begin, int64_t end);
    void (*triad)(float *a, const float *b, const float *c, float s,
                  int64_t begin, int64_t end);
    /* dst[i] += src[i], both of dtype; narrow sums round to nearest even */
    void (*accumulate)(void *dst, const void *src, zero_dtype dtype,
                       int64_t begin, int64_t end);
} isa_kernels;

extern const isa_kernels scalar_kernels;
#if defined(__x86_64__) || defined(_M_X64)
extern const isa_kernels avx2_kernels;
extern const isa_kernels avx512_kernels;
#endif

/* Adam's constants for hp (optim.c): the same for the CPU step and the
 * CUDA launcher, which recomputes the step-dependent two on the device. */
void adam_consts(const zero_adam_hparams *hp, optim_consts *k);

static inline int dtype_valid(zero_dtype dtype)
{
    return dtype == ZERO_F32 || dtype == ZERO_BF16 || dtype == ZERO_F16;
}

/* The kernels of the active ISA (cpu_features.c). */
const isa_kernels *active_kernels(void);

/* Run fn(ctx, begin, end) over [0, n) split into contiguous chunks, one per
 * thread, each a multiple of `grain` elements except the last. Blocks until
 * every chunk is done. Small n runs on the calling thread alone. */
typedef void (*range_fn)(void *ctx, int64_t begin, int64_t end);
zero_status parallel_for(int64_t n, int64_t grain, range_fn fn, void *ctx);

#endif /* ZERO_INTERNAL_H */
