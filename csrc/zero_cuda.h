/* zero_cuda.h: the core's CUDA path: the kernels of kernels/ launched
 * through the CUDA driver API, which is opened at run time.
 *
 * Nothing here links against CUDA. The first call that needs the driver
 * dlopens libcuda.so.1 and calls cuInit; a device's primary context (the
 * one torch uses) is retained, and the kernels' module loaded into it, on
 * the first launch on that device. Launches go on the caller's stream and
 * return without waiting for the kernel.
 *
 * Every function returns a zero_status. On ZERO_ERR_CUDA_UNAVAILABLE and
 * ZERO_ERR_CUDA, zero_cuda_error() holds the message (the CUDA call, its
 * error name and string), per thread. Pointers are device addresses on
 * `where->device`; callers validate sizes, dtypes and overlaps before they
 * get here, as for the CPU core.
 */
#ifndef ZERO_CUDA_H
#define ZERO_CUDA_H

#include "zero.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The embedded kernels (generated at build time; size 0 without nvcc). */
typedef struct {
    const void *fatbin;
    size_t size;
    const char *archs;     /* "sm_80 sm_90 compute_90" */
    const char *note;      /* how it was built, or why it is absent */
} zero_cuda_image;

/* Set once, before the first launch (the binding does it at import). */
void zero_cuda_set_image(const zero_cuda_image *image);

/* Before the driver is loaded, use another library than libcuda.so.1 (for
 * tests of the failure path). Clears a remembered load failure;
 * ZERO_ERR_INVALID_ARGUMENT once a driver is loaded. */
zero_status zero_cuda_set_library(const char *name);

/* ZERO_OK when kernels can run here: a fatbin is embedded, the driver
 * loads, cuInit succeeds and there is a device. Creates no context. */
zero_status zero_cuda_probe(void);

/* Why the last call on this thread failed. */
const char *zero_cuda_error(void);

/* The driver's CUDA version (12040 for 12.4), 0 before it is loaded. */
int zero_cuda_driver_version(void);

/* Where a launch runs: the device ordinal of the tensors and a CUstream
 * handle of that device (0: the legacy default stream). */
typedef struct {
    int device;
    uintptr_t stream;
} zero_cuda_where;

/* ---- Adam (kernels/adam.cuh) ----------------------------------------- */

typedef struct {
    float *param;          /* [n] fp32 master, updated in place */
    const void *grad;      /* [n] grad_dtype */
    float *exp_avg;        /* [n] */
    float *exp_avg_sq;     /* [n] */
    void *copy_out;        /* [n] copy_dtype, or NULL */
    zero_dtype grad_dtype;
    zero_dtype copy_dtype;
    int64_t n;
} zero_cuda_adam_tensor;

/* One Adam/AdamW step over count tensors (a flat partition is one). The
 * step count lives on the device: *step (fp32) is advanced by one, then
 * used for the bias corrections; hp->step is not read, and hp->amsgrad
 * must be 0. When found_inf is not NULL and *found_inf != 0 the step is
 * skipped: nothing is written, the count included. */
zero_status zero_cuda_adam_step(const zero_cuda_where *where,
                                const zero_cuda_adam_tensor *tensors,
                                int count, const zero_adam_hparams *hp,
                                float *step, const float *found_inf);

/* ---- norm, unscale, cast (kernels/norm.cuh, unscale.cuh, cast.cuh) ---- */

typedef struct {
    void *data;            /* [n] dtype; only read by the norm */
    zero_dtype dtype;
    int64_t n;
} zero_cuda_span;

/* Elements of the fp32 `partials` buffer the norm of tensors with these
 * sizes needs: one per chunk of each tensor. */
int64_t zero_cuda_norm_partials(const int64_t *numel, int count);

/* out[0] = sqrt(sum of squares of all elements), or the sum itself when
 * squared; the same bits on every call for the same data. */
zero_status zero_cuda_l2_norm(const zero_cuda_where *where,
                              const zero_cuda_span *tensors, int count,
                              float *partials, float *out, int squared);

/* Each element *= scale in place; found_inf[0] = 1 when any result, as
 * stored in the tensor's dtype, is inf or NaN (never cleared here). */
zero_status zero_cuda_unscale_check(const zero_cuda_where *where,
                                    const zero_cuda_span *tensors, int count,
                                    float scale, float *found_inf);

typedef struct {
    void *dst;             /* [n] dst_dtype */
    const void *src;       /* [n] src_dtype */
    zero_dtype dst_dtype;
    zero_dtype src_dtype;
    int64_t n;
} zero_cuda_copy;

/* dst = (dst_dtype)(src * scale) for each pair: bucket packing and
 * unpacking, with the bucket's slices as dst or src. */
zero_status zero_cuda_cast_copy(const zero_cuda_where *where,
                                const zero_cuda_copy *copies, int count,
                                float scale);

#ifdef __cplusplus
}
#endif

#endif /* ZERO_CUDA_H */
