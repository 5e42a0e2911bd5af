/* kernels.h: the CUDA kernels' extern "C" signatures and their argument
 * blocks, shared by the kernels (nvcc, kernels/kernels.cu) and the host
 * launchers (gcc, csrc/cuda_launch.c), which launch them by name through
 * the driver API. Plain C types only, so that gcc can include it; in
 * include/zero/ with the other headers both sides compile (dtype.h).
 *
 * [Note: kernel arguments] Every kernel takes one struct by value: the
 * launcher passes its address as the only entry of cuLaunchKernel's
 * kernelParams, and the two compilers lay the struct out the same way (the
 * CUDA ABI follows the host's). A struct must stay within the 4096 bytes a
 * kernel's parameters may take on every driver; the static asserts below
 * check that for both compilers.
 *
 * [Note: multi-tensor map] The kernels that take many tensors split each
 * tensor into chunks of ZERO_K_CHUNK elements and give each chunk one
 * block. A launch covers up to ZERO_K_TENSORS whole tensors: block b works
 * on the tensor t with first_block[t] <= b < first_block[t + 1], chunk
 * b - first_block[t]. The mapping depends on the tensors' sizes alone, never
 * on the device, so the norm's per-block partial sums (and their sum) are
 * the same on every run.
 */
#ifndef ZERO_KERNELS_H
#define ZERO_KERNELS_H

#include <stdint.h>

#include "dtype.h"
#include "optim_math.h"

#define ZERO_K_THREADS 256      /* threads per block, every kernel */
#define ZERO_K_CHUNK 16384      /* elements per block; a multiple of 4 */
#define ZERO_K_TENSORS 48       /* tensors per launch */
#define ZERO_K_PARAM_BYTES 4096 /* the kernel parameter limit */

/* Element types are zero_dtype values (ZERO_F32, ZERO_BF16, ZERO_F16)
 * stored in a byte. */

typedef struct {
    int64_t numel[ZERO_K_TENSORS];
    int32_t first_block[ZERO_K_TENSORS + 1];
    int32_t count;              /* tensors in this launch, >= 1 */
} zero_k_map;

/* Advances the step count unless the step is skipped. Runs before
 * zero_k_adam on the same stream, so every block of that kernel reads the
 * same, already advanced, count. */
typedef struct {
    float *step;                /* [1] steps taken */
    const float *found_inf;     /* [1] nonzero: skip; or NULL */
} zero_k_advance_args;

typedef struct {
    zero_k_map map;
    float *param[ZERO_K_TENSORS];       /* [numel] fp32 master */
    const void *grad[ZERO_K_TENSORS];   /* [numel] grad_dtype */
    float *exp_avg[ZERO_K_TENSORS];     /* [numel] */
    float *exp_avg_sq[ZERO_K_TENSORS];  /* [numel] */
    void *copy_out[ZERO_K_TENSORS];     /* [numel] copy_dtype, or NULL */
    uint8_t grad_dtype[ZERO_K_TENSORS];
    uint8_t copy_dtype[ZERO_K_TENSORS];
    /* 1 when every buffer of the tensor starts on a 4-element boundary
     * (16 bytes for fp32): the kernel then moves 4 elements per access */
    uint8_t vector[ZERO_K_TENSORS];
    optim_consts k;             /* step_size, bias_correction2_sqrt: set by
                                   the kernel from *step */
    double lr, beta1, beta2;    /* for those two, in double as on the CPU */
    float grad_scale;
    const float *step;          /* [1] steps taken, this one included */
    const float *found_inf;     /* [1] nonzero: skip the step; or NULL */
} zero_k_adam_args;

/* Stage 1 of the L2 norm: block b writes the sum of squares of its chunk to
 * partials[first_partial + b]. */
typedef struct {
    zero_k_map map;
    const void *data[ZERO_K_TENSORS];   /* [numel] dtype */
    uint8_t dtype[ZERO_K_TENSORS];
    float *partials;            /* [all chunks of the call] */
    int64_t first_partial;      /* chunks of the earlier launches */
} zero_k_norm_args;

/* Stage 2: one block adds the partials in a fixed order. */
typedef struct {
    const float *partials;      /* [count] */
    int64_t count;
    float *out;                 /* [1] the norm, or its square */
    int32_t squared;
} zero_k_norm_finish_args;

/* data[i] *= scale in place; *found_inf = 1 when a result is inf or NaN
 * (never reset to 0: the caller clears it before the first check). */
typedef struct {
    zero_k_map map;
    void *data[ZERO_K_TENSORS];         /* [numel] dtype */
    uint8_t dtype[ZERO_K_TENSORS];
    float scale;
    float *found_inf;           /* [1] */
} zero_k_unscale_args;

/* dst[i] = (dst_dtype)(src[i] * scale): packs gradients into a bucket and
 * unpacks gathered parameters (the launcher points dst or src into the
 * bucket). */
typedef struct {
    zero_k_map map;
    void *dst[ZERO_K_TENSORS];          /* [numel] dst_dtype */
    const void *src[ZERO_K_TENSORS];    /* [numel] src_dtype */
    uint8_t dst_dtype[ZERO_K_TENSORS];
    uint8_t src_dtype[ZERO_K_TENSORS];
    float scale;
} zero_k_cast_args;

#ifdef __cplusplus
#define ZERO_K_ASSERT(cond, what) static_assert(cond, what)
#else
#define ZERO_K_ASSERT(cond, what) _Static_assert(cond, what)
#endif
ZERO_K_ASSERT(sizeof(zero_k_adam_args) <= ZERO_K_PARAM_BYTES, "adam args");
ZERO_K_ASSERT(sizeof(zero_k_norm_args) <= ZERO_K_PARAM_BYTES, "norm args");
ZERO_K_ASSERT(sizeof(zero_k_unscale_args) <= ZERO_K_PARAM_BYTES, "unscale");
ZERO_K_ASSERT(sizeof(zero_k_cast_args) <= ZERO_K_PARAM_BYTES, "cast args");
ZERO_K_ASSERT(ZERO_K_CHUNK % 4 == 0, "chunks keep 4-element alignment");

/* The kernels, by name: X(name, argument struct). The driver looks each
 * one up in the module with cuModuleGetFunction. */
#define ZERO_K_LIST(X)                                                       \
    X(zero_k_adam_advance, zero_k_advance_args)                              \
    X(zero_k_adam, zero_k_adam_args)                                         \
    X(zero_k_norm_partials, zero_k_norm_args)                                \
    X(zero_k_norm_finish, zero_k_norm_finish_args)                           \
    X(zero_k_unscale, zero_k_unscale_args)                                   \
    X(zero_k_cast, zero_k_cast_args)

#ifdef __CUDACC__
#define ZERO_K_DECLARE(name, args)                                           \
    extern "C" __global__ void __launch_bounds__(ZERO_K_THREADS)             \
        name(args a);
ZERO_K_LIST(ZERO_K_DECLARE)
#undef ZERO_K_DECLARE
#endif

#endif /* ZERO_KERNELS_H */
