/* zero.h: the public API of zero's plain-C core.
 *
 * Everything here works on flat, contiguous host buffers. The core never
 * prints, exits or aborts: every entry point returns a zero_status, and the
 * Python binding (module.c) turns a status into an exception. Callers (the
 * binding, tests/c) validate pointers, sizes and hyperparameters before they
 * get here; the core re-checks only what would otherwise crash.
 */
#ifndef ZERO_H
#define ZERO_H

#include <stddef.h>
#include <stdint.h>

#include "zero/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    ZERO_OK = 0,
    ZERO_ERR_INVALID_ARGUMENT = 1, /* a null pointer, a negative size... */
    ZERO_ERR_UNSUPPORTED_DTYPE = 2,
    ZERO_ERR_UNSUPPORTED_ISA = 3,  /* asked for a SIMD path this CPU lacks */
    ZERO_ERR_OUT_OF_MEMORY = 4,
    ZERO_ERR_THREADS = 5,          /* pthread_create failed */
    ZERO_ERR_CUDA_UNAVAILABLE = 6, /* no kernels, driver or device here */
    ZERO_ERR_CUDA = 7,             /* a CUDA driver call failed */
    ZERO_ERR_IO = 8,               /* a read or write failed: see its result */
    ZERO_ERR_TIMEOUT = 9,          /* a wait ended with the request in flight */
    ZERO_ERR_UNAVAILABLE = 10      /* the asked-for I/O backend is not here */
} zero_status;

const char *zero_status_string(zero_status status);

/* Element types of the buffers the core reads and writes: zero_dtype,
 * ZERO_F32, ZERO_BF16, ZERO_F16 (include/zero/dtype.h, which the kernels
 * share). */

size_t zero_dtype_size(zero_dtype dtype);
const char *zero_dtype_name(zero_dtype dtype);

/* ---- CPU features and SIMD dispatch (cpu_features.c) ---------------- */

typedef enum {
    ZERO_ISA_SCALAR = 0,
    ZERO_ISA_AVX2 = 1,   /* AVX2 + FMA + F16C */
    ZERO_ISA_AVX512 = 2, /* AVX-512 F + BW + VL */
    ZERO_ISA_COUNT = 3
} zero_isa;

/* Environment variable read once, on first use, to force a path:
 * "scalar", "avx2" or "avx512". An unsupported or unknown value falls back to
 * the best path and is reported by zero_isa_env_error(). */
#define ZERO_SIMD_ENV "ZERO_SIMD"

const char *zero_isa_name(zero_isa isa);
int zero_isa_from_name(const char *name, zero_isa *isa); /* 0 on success */
int zero_isa_supported(zero_isa isa);
zero_isa zero_isa_best(void);
zero_isa zero_isa_active(void);
zero_status zero_isa_set(zero_isa isa);
/* The value of ZERO_SIMD that could not be honoured, or NULL. */
const char *zero_isa_env_error(void);
/* Space-separated names of the detected features ("avx2 fma f16c ..."). */
const char *zero_cpu_features(void);

/* ---- thread pool (threadpool.c) ------------------------------------- */

/* Threads used by the core, the calling thread included. Defaults to the
 * CPUs this process may run on (sched_getaffinity). */
int zero_threads_get(void);
zero_status zero_threads_set(int nthreads);

/* ---- async disk I/O (aio.c, aio_uring.c) ----------------------------- */

/* Reads and writes of (fd, buffer, length, offset) that run while the
 * caller computes. A request is cut into blocks of block_size bytes; at
 * most queue_depth blocks are in flight at once. Short transfers are
 * resumed; a failure is kept per request (the lowest failing offset).
 * The engine takes descriptors as they are: one opened with O_DIRECT needs
 * buffers, offsets and lengths aligned to ZERO_AIO_ALIGN, which the
 * caller checks (docs/offload.md, "Disk I/O"). */

typedef enum {
    ZERO_AIO_AUTO = 0,    /* io_uring where the kernel allows it, else threads */
    ZERO_AIO_THREADS = 1, /* queue_depth threads doing pread/pwrite */
    ZERO_AIO_URING = 2    /* io_uring, through raw system calls */
} zero_aio_backend;

/* Read by ZERO_AIO_AUTO: "threads" or "io_uring" forces a backend (io_uring
 * still falls back to threads where the kernel refuses it). */
#define ZERO_AIO_ENV "ZERO_AIO"
#define ZERO_AIO_ALIGN 4096          /* O_DIRECT's alignment, bytes */
#define ZERO_AIO_MAX_QUEUE_DEPTH 1024
#define ZERO_AIO_MAX_BLOCK ((int64_t)1 << 30)
/* zero_aio_result.error of a read that met the end of the file (or a write
 * that moved nothing): not an errno. */
#define ZERO_AIO_END_OF_FILE (-1)

typedef struct zero_aio zero_aio;

typedef struct {
    int fd;
    void *buf;             /* [length] bytes */
    int64_t length;        /* bytes */
    int64_t offset;        /* bytes into the file */
    int write;             /* 1: buf to the file, 0: the file to buf */
} zero_aio_request;

typedef struct {
    int error;             /* 0, an errno, or ZERO_AIO_END_OF_FILE */
    int64_t error_offset;  /* the file offset where the failure happened */
    int64_t moved;         /* bytes transferred, all blocks together */
} zero_aio_result;

/* queue_depth in [1, ZERO_AIO_MAX_QUEUE_DEPTH]; block_size a multiple of
 * ZERO_AIO_ALIGN up to ZERO_AIO_MAX_BLOCK. ZERO_AIO_URING where io_uring
 * cannot start: ZERO_ERR_UNAVAILABLE; ZERO_AIO_AUTO falls back silently
 * (zero_aio_backend_of says which runs). */
zero_status zero_aio_create(zero_aio **out, zero_aio_backend backend,
                            int queue_depth, int64_t block_size);
/* Waits for every request still in flight, then frees the engine. */
void zero_aio_destroy(zero_aio *aio);
zero_aio_backend zero_aio_backend_of(const zero_aio *aio);
const char *zero_aio_backend_name(zero_aio_backend backend);
/* 0 when io_uring can run here, else the errno that stopped it (ENOSYS
 * where it was not built in). */
int zero_aio_uring_probe(void);

/* Queue a request; *id names it for zero_aio_wait. The buffer must stay
 * valid until the request has been waited for (or the engine destroyed).
 * An engine is its creator process's: in a forked child, submit and wait
 * return ZERO_ERR_INVALID_ARGUMENT (destroy still frees it). */
zero_status zero_aio_submit(zero_aio *aio, const zero_aio_request *request,
                            int64_t *id);
/* Wait up to timeout_ms (< 0: no limit) for request id. ZERO_ERR_TIMEOUT
 * leaves it in flight; otherwise the id is forgotten, *result filled and
 * the request's status returned: ZERO_OK, or ZERO_ERR_IO with the failure
 * in *result. An unknown id is ZERO_ERR_INVALID_ARGUMENT. */
zero_status zero_aio_wait(zero_aio *aio, int64_t id, int timeout_ms,
                          zero_aio_result *result);

/* ---- optimizers over flat fp32 buffers (optim.c) -------------------- */

/* Buffers shared by every optimizer. All hold n elements. The gradient is
 * read as grad_dtype and multiplied by grad_scale before use (loss-scale
 * unscaling, clipping and `maximize` fold into that one factor). When
 * copy_out is not NULL, the updated parameter is also written there, cast to
 * copy_dtype with round-to-nearest-even. */
typedef struct {
    float *param;          /* [n] fp32 master parameters, updated in place */
    const void *grad;      /* [n] gradients, grad_dtype */
    zero_dtype grad_dtype;
    void *copy_out;        /* [n] or NULL: updated params, copy_dtype */
    zero_dtype copy_dtype;
    int64_t n;
} zero_flat;

typedef struct {
    double lr;
    double beta1, beta2;
    double eps;
    double weight_decay;
    int decoupled;         /* 1: AdamW (decay the weights), 0: Adam (L2) */
    int amsgrad;
    int64_t step;          /* 1 on the first update; sets bias correction */
    double grad_scale;
} zero_adam_hparams;

typedef struct {
    float *exp_avg;        /* [n] first moment */
    float *exp_avg_sq;     /* [n] second moment */
    float *max_exp_avg_sq; /* [n] running max of exp_avg_sq; amsgrad only */
} zero_adam_state;

zero_status zero_adam_step(const zero_flat *buf, const zero_adam_state *state,
                           const zero_adam_hparams *hp);

typedef struct {
    double lr;
    double momentum;
    double dampening;
    double weight_decay;
    int nesterov;
    int first_step;        /* the momentum buffer starts as the gradient */
    double grad_scale;
} zero_sgd_hparams;

/* momentum_buffer: [n], may be NULL when momentum == 0. */
zero_status zero_sgd_step(const zero_flat *buf, float *momentum_buffer,
                          const zero_sgd_hparams *hp);

typedef struct {
    double lr;
    double beta1, beta2;
    double weight_decay;   /* decoupled, as in the Lion paper */
    double grad_scale;
} zero_lion_hparams;

zero_status zero_lion_step(const zero_flat *buf, float *exp_avg,
                           const zero_lion_hparams *hp);

typedef struct {
    double lr;
    double lr_decay;
    double weight_decay;
    double eps;
    int64_t step;          /* 1 on the first update */
    double grad_scale;
} zero_adagrad_hparams;

zero_status zero_adagrad_step(const zero_flat *buf, float *state_sum,
                              const zero_adagrad_hparams *hp);

/* ---- reductions and conversions (reduce.c) -------------------------- */

/* Sum of squares of n elements, accumulated in fixed-size blocks whose
 * partial sums are added in order, so the result does not depend on the
 * thread count. Infinite or NaN when the data holds an inf or NaN. */
zero_status zero_sum_squares(const void *data, zero_dtype dtype, int64_t n,
                             double *out);

/* *all_finite = 1 when no element is inf or NaN. */
zero_status zero_check_finite(const void *data, zero_dtype dtype, int64_t n,
                              int *all_finite);

/* dst[i] = (dst_dtype) src[i]; narrowing rounds to nearest even. */
zero_status zero_convert(void *dst, zero_dtype dst_dtype, const void *src,
                         zero_dtype src_dtype, int64_t n);

/* a[i] = b[i] + scalar * c[i]: the STREAM triad, the bandwidth ceiling the
 * benchmarks compare against. With b == NULL it runs in place,
 * a[i] = a[i] + scalar * c[i] (read a and c, write a). */
zero_status zero_stream_triad(float *a, const float *b, const float *c,
                              float scalar, int64_t n);

/* ---- gradient buckets (buckets.c) ------------------------------------ */

/* [Note: the bucket plan] A flat group's parameters lie in units (stage 3's
 * gather units; one unit at stages 0-2), each at an offset of its unit's
 * flat span. Buckets are fixed ranges of a unit's span of at most
 * bucket_elements, numbered from the last unit's end: the order backward
 * produces gradients. A parameter's gradient lands in each bucket it
 * overlaps, as one piece per bucket, in bucket order. Bucket b may leave
 * once every parameter expected to get a gradient has added its piece and
 * every bucket before it has left; a piece for a bucket that has left
 * goes to that bucket's late buffer, reduced at the end of the backward.
 * The caller owns the buffers and the collectives; the plan says where
 * each piece goes and when each bucket leaves.
 *
 * [Note: small units share a bucket] Stage 3 lays each unit out in
 * `chunks` chunks of unit_part[u] elements, chunk r being rank r's. A
 * bucket over a part of one unit costs a collective (a reduce per rank on
 * gloo) whatever its size, so a model of many small units paid hundreds
 * a step where stage 2 paid two. Given the parts, consecutive units whose
 * chunks all fit (chunks * part <= bucket_elements) share one bucket of
 * at most bucket_elements, laid out rank-major: segment r holds chunk r of
 * each of its units, lowest unit first. Rank r's segment is then one
 * contiguous range of its partition (its chunks follow unit by unit), so
 * the bucket is one reduce per rank, or one reduce-scatter. A unit alone
 * (no small neighbour) keeps the ranges of its span. */
typedef struct zero_buckets zero_buckets;

/* The most buckets a plan may have: past it, laying them out walked every
 * one (2^62 elements in buckets of 1 held the GIL for good) and their
 * bookkeeping alone took gigabytes. A flat group of a billion elements in
 * buckets of 64 needs fewer. */
#define ZERO_BUCKETS_MAX_COUNT (INT64_C(1) << 24)

/* The buckets units of these spans need, counted without laying them out;
 * -1 for a bad argument, -2 past ZERO_BUCKETS_MAX_COUNT. */
int64_t zero_buckets_needed(int64_t n_units, const int64_t *unit_span,
                            int64_t bucket_elements);

typedef struct {
    int64_t bucket;       /* the bucket's index */
    int64_t bucket_start; /* where the piece starts in the bucket */
    int64_t grad_start;   /* where it starts in the flat gradient */
    int64_t count;        /* elements */
} zero_bucket_piece;

/* Parameter i lies in unit param_unit[i] at param_offset[i], param_numel[i]
 * elements; units are [0, n_units) with spans unit_span[]. Every parameter
 * must lie inside its unit, and no two may share an element. All
 * parameters start expected. */
zero_status zero_buckets_create(zero_buckets **out, int64_t n_params,
                                const int64_t *param_unit,
                                const int64_t *param_offset,
                                const int64_t *param_numel, int64_t n_units,
                                const int64_t *unit_span,
                                int64_t bucket_elements);
/* The same with [Note: small units share a bucket]: unit_part[u] (>= 0,
 * chunks * unit_part[u] >= unit_span[u]) and chunks >= 1. unit_part NULL
 * is zero_buckets_create. */
zero_status zero_buckets_create_chunked(zero_buckets **out, int64_t n_params,
                                        const int64_t *param_unit,
                                        const int64_t *param_offset,
                                        const int64_t *param_numel,
                                        int64_t n_units,
                                        const int64_t *unit_span,
                                        const int64_t *unit_part,
                                        int64_t chunks,
                                        int64_t bucket_elements);
void zero_buckets_destroy(zero_buckets *plan);

int64_t zero_buckets_count(const zero_buckets *plan);
/* Bucket b's unit and its range [start, end) of the unit's span; for a
 * bucket units share, its first unit and [0, its size). */
zero_status zero_buckets_range(const zero_buckets *plan, int64_t b,
                               int64_t *unit, int64_t *start, int64_t *end);
/* The units bucket b holds: first == last but for a shared bucket. */
zero_status zero_buckets_units(const zero_buckets *plan, int64_t b,
                               int64_t *first, int64_t *last);
/* Parameter i's pieces, in bucket order; returns their number. */
int64_t zero_buckets_pieces(const zero_buckets *plan, int64_t param,
                            const zero_bucket_piece **pieces);

/* A new backward: nothing arrived, no bucket left. expected[i] (n_params
 * bytes) says which parameters the buckets wait for; NULL keeps the last. A
 * unit whose parameters are not all expected is never reported done (it
 * waits for the end of the backward). */
zero_status zero_buckets_reset(zero_buckets *plan, const uint8_t *expected);

/* Flags of zero_buckets_arrive. */
enum {
    ZERO_ARRIVE_FIRST = 1,    /* the parameter's first gradient this backward */
    ZERO_ARRIVE_COUNTED = 2,  /* ... and it was expected: its pieces count */
    ZERO_ARRIVE_BACKWARD = 4  /* the backward's first gradient of all */
};
/* Parameter i's gradient arrived; returns ZERO_ARRIVE_* flags, or -1 for
 * an index out of range. */
int zero_buckets_arrive(zero_buckets *plan, int64_t param);
/* [Note: no zero-fill] in buckets.c. Piece k of parameter i is about to be
 * written into its bucket's staging (late 0) or late buffer: 1 when it is
 * the first write there this backward (copy), 0 when not (add); marks it
 * written. -1 for an index out of range. */
int zero_buckets_claim(zero_buckets *plan, int64_t param, int64_t k, int late);
/* fn(ctx, start, count) for each range of bucket b's staging (late 0) or
 * late buffer that no piece wrote this backward, in order, adjacent ones
 * as one; stops at and returns the first nonzero fn returns. 0 when done,
 * -1 for bad arguments. */
typedef int (*zero_gap_fn)(void *ctx, int64_t start, int64_t count);
int zero_buckets_each_gap(const zero_buckets *plan, int64_t b, int late,
                          zero_gap_fn fn, void *ctx);
/* 1 when bucket b has left (a piece for it goes to its late buffer). */
int zero_buckets_left(const zero_buckets *plan, int64_t b);
/* A counted piece was added into bucket b. */
void zero_buckets_piece_added(zero_buckets *plan, int64_t b);
/* The bucket to send next, marked as left, or -1 when the next in order
 * still waits for a piece; force sends it regardless. */
int64_t zero_buckets_next(zero_buckets *plan, int force);
/* After the pieces of a FIRST arrival: the unit of parameter i when that
 * was the last of its parameters to arrive, else -1. */
int64_t zero_buckets_unit_arrived(zero_buckets *plan, int64_t param);
/* Which parameters got a gradient this backward ([n_params], 0 or 1). */
const uint8_t *zero_buckets_arrived(const zero_buckets *plan);
/* Buckets that have left; 1 when any gradient arrived this backward. */
int64_t zero_buckets_sent(const zero_buckets *plan);
int zero_buckets_started(const zero_buckets *plan);

/* dst[i] += src[i] for n elements of one dtype, the sum rounded to nearest
 * even for bfloat16 and float16 (what torch's add_ does). */
zero_status zero_accumulate(void *dst, const void *src, zero_dtype dtype,
                            int64_t n);
/* dst[i] = src[i] for n elements of one dtype (threads for large n). */
zero_status zero_copy(void *dst, const void *src, zero_dtype dtype, int64_t n);

#ifdef __cplusplus
}
#endif

#endif /* ZERO_H */
