/* reduce.c: the reductions and conversions of zero.h (gradient norm,
 * inf/nan check, dtype conversion) and the bandwidth-ceiling triad.
 */
#include <stdatomic.h>
#include <stdlib.h>

#include "internal.h"

/* Sums of squares are taken over blocks of this many elements and added in
 * block order, so the result is the same for any thread count. */
#define NORM_BLOCK 32768
#define GRAIN 64

typedef struct {
    const isa_kernels *kernels;
    const void *data;
    zero_dtype dtype;
    int64_t n;
    double *partials; /* [number of blocks] */
} squares_job;

/* [begin, end) starts on a block boundary: parallel_for's grain is
 * NORM_BLOCK. */
static void squares_blocks(void *ctx, int64_t begin, int64_t end)
{
    squares_job *job = ctx;
    for (int64_t start = begin; start < end; start += NORM_BLOCK) {
        int64_t stop = start + NORM_BLOCK < end ? start + NORM_BLOCK : end;
        job->partials[start / NORM_BLOCK] =
            job->kernels->sum_squares(job->data, job->dtype, start, stop);
    }
}

zero_status zero_sum_squares(const void *data, zero_dtype dtype, int64_t n,
                             double *out)
{
    if (!out || n < 0 || (n > 0 && !data)) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    if (!dtype_valid(dtype)) {
        return ZERO_ERR_UNSUPPORTED_DTYPE;
    }
    int64_t blocks = (n + NORM_BLOCK - 1) / NORM_BLOCK;
    squares_job job = {active_kernels(), data, dtype, n, NULL};
    if (blocks <= 1) {
        *out = n ? job.kernels->sum_squares(data, dtype, 0, n) : 0.0;
        return ZERO_OK;
    }
    job.partials = malloc((size_t)blocks * sizeof *job.partials);
    if (!job.partials) {
        return ZERO_ERR_OUT_OF_MEMORY;
    }
    zero_status status = parallel_for(n, NORM_BLOCK, squares_blocks, &job);
    double sum = 0.0;
    for (int64_t b = 0; b < blocks; b++) {
        sum += job.partials[b];
    }
    free(job.partials);
    *out = sum;
    return status;
}

typedef struct {
    const isa_kernels *kernels;
    const void *data;
    zero_dtype dtype;
    atomic_int found_nonfinite;
} finite_job;

static void finite_range(void *ctx, int64_t begin, int64_t end)
{
    finite_job *job = ctx;
    /* Scan in slices so a chunk stops early once any thread has found one. */
    const int64_t slice = 1 << 16;
    for (int64_t start = begin; start < end; start += slice) {
        if (atomic_load_explicit(&job->found_nonfinite,
                                 memory_order_relaxed)) {
            return;
        }
        int64_t stop = start + slice < end ? start + slice : end;
        if (!job->kernels->all_finite(job->data, job->dtype, start, stop)) {
            atomic_store(&job->found_nonfinite, 1);
            return;
        }
    }
}

zero_status zero_check_finite(const void *data, zero_dtype dtype, int64_t n,
                              int *all_finite)
{
    if (!all_finite || n < 0 || (n > 0 && !data)) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    if (!dtype_valid(dtype)) {
        return ZERO_ERR_UNSUPPORTED_DTYPE;
    }
    finite_job job = {.kernels = active_kernels(), .data = data,
                      .dtype = dtype};
    atomic_init(&job.found_nonfinite, 0);
    zero_status status = parallel_for(n, GRAIN, finite_range, &job);
    *all_finite = !atomic_load(&job.found_nonfinite);
    return status;
}

typedef struct {
    const isa_kernels *kernels;
    void *dst;
    zero_dtype dst_dtype;
    const void *src;
    zero_dtype src_dtype;
} convert_job;

static void convert_range(void *ctx, int64_t begin, int64_t end)
{
    convert_job *job = ctx;
    job->kernels->convert(job->dst, job->dst_dtype, job->src, job->src_dtype,
                          begin, end);
}

zero_status zero_convert(void *dst, zero_dtype dst_dtype, const void *src,
                         zero_dtype src_dtype, int64_t n)
{
    if (n < 0 || (n > 0 && (!dst || !src))) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    if (!dtype_valid(dst_dtype) || !dtype_valid(src_dtype)) {
        return ZERO_ERR_UNSUPPORTED_DTYPE;
    }
    convert_job job = {active_kernels(), dst, dst_dtype, src, src_dtype};
    return parallel_for(n, GRAIN, convert_range, &job);
}

typedef struct {
    const isa_kernels *kernels;
    float *a;
    const float *b, *c;
    float scalar;
} triad_job;

static void triad_range(void *ctx, int64_t begin, int64_t end)
{
    triad_job *job = ctx;
    job->kernels->triad(job->a, job->b, job->c, job->scalar, begin, end);
}

zero_status zero_stream_triad(float *a, const float *b, const float *c,
                              float scalar, int64_t n)
{
    if (n < 0 || (n > 0 && (!a || !c))) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    triad_job job = {active_kernels(), a, b, c, scalar};
    return parallel_for(n, GRAIN, triad_range, &job);
}
