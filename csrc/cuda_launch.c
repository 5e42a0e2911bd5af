/* cuda_launch.c: the entry points of zero_cuda.h: check the arguments, pack
 * the kernels' argument blocks (include/zero/kernels.h) and launch them on the
 * caller's stream, ZERO_K_TENSORS tensors per launch.
 *
 * [Note: stream order] Every launch of one call goes on the one stream the
 * caller passed (torch's current stream), so the kernels of a call, and
 * the caller's own work on that stream, run in order: the Adam step sees
 * the count its advance kernel wrote and the found_inf flag an earlier
 * unscale wrote, and torch's caching allocator, which reuses memory in
 * stream order, never hands a buffer out while a kernel still uses it.
 */
#include <string.h>

#include "cuda_internal.h"
#include "internal.h"

void cuda_map_reset(zero_k_map *map)
{
    map->count = 0;
    map->first_block[0] = 0;
}

int cuda_map_add(zero_k_map *map, int64_t numel)
{
    int64_t blocks = (numel + ZERO_K_CHUNK - 1) / ZERO_K_CHUNK;
    int64_t total = cuda_map_blocks(map) + blocks;
    if (map->count == ZERO_K_TENSORS || total > INT32_MAX) {
        return -1;
    }
    int slot = map->count++;
    map->numel[slot] = numel;
    map->first_block[slot + 1] = (int32_t)total;
    return slot;
}

int64_t zero_cuda_norm_partials(const int64_t *numel, int count)
{
    int64_t chunks = 0;
    for (int i = 0; i < count; i++) {
        chunks += (numel[i] + ZERO_K_CHUNK - 1) / ZERO_K_CHUNK;
    }
    return chunks;
}

/* One multi-tensor kernel over a list of items, split into launches. */
typedef struct {
    int kernel;
    void *args;               /* the kernel's argument block */
    zero_k_map *map;          /* in args */
    int64_t *first_partial;   /* in args (the norm's), or NULL */
    const void *items;
    int count;
    int64_t (*numel)(const void *items, int index);
    /* copy item `index`'s pointers and dtypes into args at `slot` */
    void (*fill)(void *args, int slot, const void *items, int index);
} batched;

static zero_status launch_batches(const cuda_device *device,
                                  uintptr_t stream, const batched *b)
{
    int64_t blocks_done = 0;
    cuda_map_reset(b->map);
    for (int i = 0; i <= b->count; i++) {
        int64_t n = i < b->count ? b->numel(b->items, i) : 0;
        int slot = -1;
        if (n > 0) {
            slot = cuda_map_add(b->map, n);
        }
        int flush = i == b->count || (n > 0 && slot < 0);
        if (flush && b->map->count > 0) {
            if (b->first_partial) {
                *b->first_partial = blocks_done;
            }
            int64_t blocks = cuda_map_blocks(b->map);
            zero_status status =
                cuda_launch(device, b->kernel, blocks, stream, b->args);
            if (status != ZERO_OK) {
                return status;
            }
            blocks_done += blocks;
            cuda_map_reset(b->map);
            if (n > 0) {
                slot = cuda_map_add(b->map, n);
            }
        }
        if (n > 0 && slot < 0) {
            return cuda_fail(ZERO_ERR_INVALID_ARGUMENT,
                             "a tensor of %lld elements needs more blocks "
                             "than one launch can have",
                             (long long)n);
        }
        if (n > 0) {
            b->fill(b->args, slot, b->items, i);
        }
    }
    return ZERO_OK;
}

/* Run one call: enter the device, launch, leave. */
static zero_status run(const zero_cuda_where *where,
                       zero_status (*body)(const cuda_device *, uintptr_t,
                                           void *),
                       void *ctx)
{
    const cuda_device *device;
    zero_status status = cuda_enter(where, &device);
    if (status != ZERO_OK) {
        return status;
    }
    return cuda_leave(body(device, where->stream, ctx));
}

static zero_status check_common(const zero_cuda_where *where,
                                const void *list, int count)
{
    if (!where || count < 0 || (count > 0 && !list)) {
        return cuda_fail(ZERO_ERR_INVALID_ARGUMENT,
                         "a NULL argument or a negative count");
    }
    return ZERO_OK;
}

static int aligned(const void *p, size_t bytes)
{
    return (uintptr_t)p % bytes == 0;
}

/* ---- Adam --------------------------------------------------------------- */

typedef struct {
    zero_k_advance_args advance;
    zero_k_adam_args adam;
    batched batches;
} adam_call;

static int64_t adam_numel(const void *items, int index)
{
    return ((const zero_cuda_adam_tensor *)items)[index].n;
}

static void adam_fill(void *args, int slot, const void *items, int index)
{
    zero_k_adam_args *a = args;
    const zero_cuda_adam_tensor *t =
        &((const zero_cuda_adam_tensor *)items)[index];
    a->param[slot] = t->param;
    a->grad[slot] = t->grad;
    a->exp_avg[slot] = t->exp_avg;
    a->exp_avg_sq[slot] = t->exp_avg_sq;
    a->copy_out[slot] = t->copy_out;
    a->grad_dtype[slot] = (uint8_t)t->grad_dtype;
    a->copy_dtype[slot] = (uint8_t)t->copy_dtype;
    /* 4 elements per access when every buffer starts on a 4-element
     * boundary; chunks start on one too (ZERO_K_CHUNK % 4 == 0) */
    a->vector[slot] =
        aligned(t->param, 16) && aligned(t->exp_avg, 16) &&
        aligned(t->exp_avg_sq, 16) &&
        aligned(t->grad, 4 * zero_dtype_size(t->grad_dtype)) &&
        (!t->copy_out ||
         aligned(t->copy_out, 4 * zero_dtype_size(t->copy_dtype)));
}

static zero_status adam_body(const cuda_device *device, uintptr_t stream,
                             void *ctx)
{
    adam_call *call = ctx;
    zero_status status = cuda_launch(device, KERNEL_zero_k_adam_advance, 1,
                                     stream, &call->advance);
    if (status != ZERO_OK) {
        return status;
    }
    return launch_batches(device, stream, &call->batches);
}

static zero_status check_adam_tensor(const zero_cuda_adam_tensor *t)
{
    if (t->n < 0 || !dtype_valid(t->grad_dtype) ||
        (t->copy_out && !dtype_valid(t->copy_dtype))) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    if (t->n > 0 && (!t->param || !t->grad || !t->exp_avg ||
                     !t->exp_avg_sq)) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    return ZERO_OK;
}

zero_status zero_cuda_adam_step(const zero_cuda_where *where,
                                const zero_cuda_adam_tensor *tensors,
                                int count, const zero_adam_hparams *hp,
                                float *step, const float *found_inf)
{
    zero_status status = check_common(where, tensors, count);
    if (status != ZERO_OK) {
        return status;
    }
    if (!hp || !step || hp->amsgrad) {
        return cuda_fail(ZERO_ERR_INVALID_ARGUMENT,
                         "hp and step are required; amsgrad is not "
                         "supported on CUDA");
    }
    for (int i = 0; i < count; i++) {
        if (check_adam_tensor(&tensors[i]) != ZERO_OK) {
            return cuda_fail(ZERO_ERR_INVALID_ARGUMENT,
                             "tensor %d: a NULL buffer, a negative size or "
                             "a bad dtype",
                             i);
        }
    }
    adam_call call;
    memset(&call, 0, sizeof call);
    call.advance.step = step;
    call.advance.found_inf = found_inf;
    zero_k_adam_args *a = &call.adam;
    /* the step-independent constants as the CPU step computes them; the
     * kernel sets the two that depend on the step */
    zero_adam_hparams at_step_one = *hp;
    at_step_one.step = 1;
    adam_consts(&at_step_one, &a->k);
    a->lr = hp->lr;
    a->beta1 = hp->beta1;
    a->beta2 = hp->beta2;
    a->grad_scale = (float)hp->grad_scale;
    a->step = step;
    a->found_inf = found_inf;
    call.batches = (batched){KERNEL_zero_k_adam, a, &a->map, NULL, tensors,
                             count, adam_numel, adam_fill};
    return run(where, adam_body, &call);
}

/* ---- norm, unscale, cast ----------------------------------------------- */

static int64_t span_numel(const void *items, int index)
{
    return ((const zero_cuda_span *)items)[index].n;
}

static zero_status check_spans(const zero_cuda_where *where,
                               const zero_cuda_span *spans, int count)
{
    zero_status status = check_common(where, spans, count);
    for (int i = 0; i < count && status == ZERO_OK; i++) {
        if (spans[i].n < 0 || !dtype_valid(spans[i].dtype) ||
            (spans[i].n > 0 && !spans[i].data)) {
            status = cuda_fail(ZERO_ERR_INVALID_ARGUMENT,
                               "tensor %d: a NULL buffer, a negative size "
                               "or a bad dtype",
                               i);
        }
    }
    return status;
}

typedef struct {
    zero_k_norm_args partials;
    zero_k_norm_finish_args finish;
    batched batches;
} norm_call;

static void norm_fill(void *args, int slot, const void *items, int index)
{
    zero_k_norm_args *a = args;
    const zero_cuda_span *s = &((const zero_cuda_span *)items)[index];
    a->data[slot] = s->data;
    a->dtype[slot] = (uint8_t)s->dtype;
}

static zero_status norm_body(const cuda_device *device, uintptr_t stream,
                             void *ctx)
{
    norm_call *call = ctx;
    zero_status status = launch_batches(device, stream, &call->batches);
    if (status != ZERO_OK) {
        return status;
    }
    return cuda_launch(device, KERNEL_zero_k_norm_finish, 1, stream,
                       &call->finish);
}

zero_status zero_cuda_l2_norm(const zero_cuda_where *where,
                              const zero_cuda_span *tensors, int count,
                              float *partials, float *out, int squared)
{
    zero_status status = check_spans(where, tensors, count);
    if (status != ZERO_OK) {
        return status;
    }
    int64_t chunks = 0;
    for (int i = 0; i < count; i++) {
        chunks += zero_cuda_norm_partials(&tensors[i].n, 1);
    }
    if (!out || (chunks > 0 && !partials)) {
        return cuda_fail(ZERO_ERR_INVALID_ARGUMENT,
                         "out and partials are required");
    }
    norm_call call;
    memset(&call, 0, sizeof call);
    call.partials.partials = partials;
    call.finish = (zero_k_norm_finish_args){partials, chunks, out,
                                            squared != 0};
    call.batches = (batched){KERNEL_zero_k_norm_partials, &call.partials,
                             &call.partials.map, &call.partials.first_partial,
                             tensors, count, span_numel, norm_fill};
    return run(where, norm_body, &call);
}

static zero_status batches_body(const cuda_device *device, uintptr_t stream,
                                void *ctx)
{
    return launch_batches(device, stream, ctx);
}

static void unscale_fill(void *args, int slot, const void *items, int index)
{
    zero_k_unscale_args *a = args;
    const zero_cuda_span *s = &((const zero_cuda_span *)items)[index];
    a->data[slot] = s->data;
    a->dtype[slot] = (uint8_t)s->dtype;
}

zero_status zero_cuda_unscale_check(const zero_cuda_where *where,
                                    const zero_cuda_span *tensors, int count,
                                    float scale, float *found_inf)
{
    zero_status status = check_spans(where, tensors, count);
    if (status != ZERO_OK) {
        return status;
    }
    if (!found_inf) {
        return cuda_fail(ZERO_ERR_INVALID_ARGUMENT, "found_inf is required");
    }
    zero_k_unscale_args args;
    memset(&args, 0, sizeof args);
    args.scale = scale;
    args.found_inf = found_inf;
    batched b = {KERNEL_zero_k_unscale, &args, &args.map, NULL, tensors,
                 count, span_numel, unscale_fill};
    return run(where, batches_body, &b);
}

static int64_t copy_numel(const void *items, int index)
{
    return ((const zero_cuda_copy *)items)[index].n;
}

static void cast_fill(void *args, int slot, const void *items, int index)
{
    zero_k_cast_args *a = args;
    const zero_cuda_copy *c = &((const zero_cuda_copy *)items)[index];
    a->dst[slot] = c->dst;
    a->src[slot] = c->src;
    a->dst_dtype[slot] = (uint8_t)c->dst_dtype;
    a->src_dtype[slot] = (uint8_t)c->src_dtype;
}

zero_status zero_cuda_cast_copy(const zero_cuda_where *where,
                                const zero_cuda_copy *copies, int count,
                                float scale)
{
    zero_status status = check_common(where, copies, count);
    for (int i = 0; i < count && status == ZERO_OK; i++) {
        const zero_cuda_copy *c = &copies[i];
        if (c->n < 0 || !dtype_valid(c->dst_dtype) ||
            !dtype_valid(c->src_dtype) ||
            (c->n > 0 && (!c->dst || !c->src))) {
            status = cuda_fail(ZERO_ERR_INVALID_ARGUMENT,
                               "copy %d: a NULL buffer, a negative size or "
                               "a bad dtype",
                               i);
        }
    }
    if (status != ZERO_OK) {
        return status;
    }
    zero_k_cast_args args;
    memset(&args, 0, sizeof args);
    args.scale = scale;
    batched b = {KERNEL_zero_k_cast, &args, &args.map, NULL, copies, count,
                 copy_numel, cast_fill};
    return run(where, batches_body, &b);
}
