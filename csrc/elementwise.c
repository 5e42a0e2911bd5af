/* elementwise.c: the copy and the accumulate a gradient piece lands in its
 * bucket with (zero_copy, zero_accumulate in zero.h): on the calling thread
 * when small, else split over the thread pool; the accumulate runs the
 * SIMD kernels picked at load (x86/).
 */
#include <string.h>

#include "internal.h"

#define ACCUMULATE_GRAIN 4096

/* What the accumulate and the copy share: one job over [0, n) of one
 * dtype, on the calling thread when small, else split over the pool. */
typedef struct {
    const isa_kernels *kernels;
    char *dst;
    const char *src;
    zero_dtype dtype;
    size_t itemsize;
} elementwise_job;

static zero_status run_elementwise(void *dst, const void *src, zero_dtype dtype,
                                   int64_t n, range_fn fn)
{
    if (n < 0 || (n > 0 && (!dst || !src))) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    if (!dtype_valid(dtype)) {
        return ZERO_ERR_UNSUPPORTED_DTYPE;
    }
    if (n == 0) {
        return ZERO_OK; /* memcpy must not see NULL, even for 0 bytes */
    }
    elementwise_job job = {active_kernels(), dst, src, dtype,
                           dtype == ZERO_F32 ? 4 : 2};
    if (n < 8 * ACCUMULATE_GRAIN) {
        fn(&job, 0, n);
        return ZERO_OK;
    }
    return parallel_for(n, ACCUMULATE_GRAIN, fn, &job);
}

static void accumulate_range(void *ctx, int64_t begin, int64_t end)
{
    const elementwise_job *job = ctx;
    job->kernels->accumulate(job->dst, job->src, job->dtype, begin, end);
}

zero_status zero_accumulate(void *dst, const void *src, zero_dtype dtype,
                            int64_t n)
{
    return run_elementwise(dst, src, dtype, n, accumulate_range);
}

static void copy_range(void *ctx, int64_t begin, int64_t end)
{
    const elementwise_job *job = ctx;
    memcpy(job->dst + (size_t)begin * job->itemsize,
           job->src + (size_t)begin * job->itemsize,
           (size_t)(end - begin) * job->itemsize);
}

zero_status zero_copy(void *dst, const void *src, zero_dtype dtype, int64_t n)
{
    return run_elementwise(dst, src, dtype, n, copy_range);
}
