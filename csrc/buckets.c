/* buckets.c: the gradient bucket plan of a flat group and its per-backward
 * counts ([Note: the bucket plan] in zero.h; the copy and accumulate a
 * piece lands with are elementwise.c's). The Python binding (module_buckets.c)
 * drives it from the post-accumulate-grad hooks; the counts follow what
 * sharding/_buckets.py documents ([Note: expected gradients]).
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

struct zero_buckets {
    int64_t n_params, n_units, n_buckets;
    int64_t *param_unit;     /* [n_params] */
    int64_t *first_piece;    /* [n_params + 1]: pieces of i are [first[i], first[i+1]) */
    zero_bucket_piece *pieces;
    int64_t *bucket_unit, *bucket_start, *bucket_end; /* [n_buckets] */
    /* [Note: small units share a bucket]: chunks and unit_part are NULL
     * without it; bucket_last[b] > bucket_unit[b] for a shared bucket, whose
     * segments are bucket_segment[b] elements; unit_prefix[u]: where a
     * sharing unit's chunk starts in a segment, -1 for the others */
    int64_t chunks;
    int64_t *unit_part, *unit_prefix;       /* [n_units] */
    int64_t *bucket_last, *bucket_segment;  /* [n_buckets] */
    int64_t *unit_members;   /* [n_units] parameters in each unit */
    int64_t n_pieces;
    int64_t *bucket_first;   /* [n_buckets + 1]: bucket b's pieces are */
    int64_t *by_bucket;      /* by_bucket[bucket_first[b] .. bucket_first[b + 1]),
                              * piece indices by their start in the bucket */
    /* per backward */
    uint8_t *written;        /* [n_pieces] WRITTEN_STAGING | WRITTEN_LATE */
    int64_t *pending;        /* [n_buckets] expected pieces still to come */
    int64_t *unit_pending;   /* [n_units] parameters still to come; -1: never reported */
    uint8_t *expected;       /* [n_params] */
    uint8_t *arrived;        /* [n_params] */
    int64_t arrivals;        /* parameters arrived this backward */
    int64_t next_bucket;     /* buckets [0, next_bucket) have left */
};

void zero_buckets_destroy(zero_buckets *plan)
{
    if (!plan) {
        return;
    }
    free(plan->param_unit);
    free(plan->first_piece);
    free(plan->pieces);
    free(plan->bucket_unit);
    free(plan->bucket_start);
    free(plan->bucket_end);
    free(plan->unit_part);
    free(plan->unit_prefix);
    free(plan->bucket_last);
    free(plan->bucket_segment);
    free(plan->unit_members);
    free(plan->bucket_first);
    free(plan->by_bucket);
    free(plan->written);
    free(plan->pending);
    free(plan->unit_pending);
    free(plan->expected);
    free(plan->arrived);
    free(plan);
}

static void *zeroed(int64_t count, size_t size)
{
    /* one element at least, so that an empty array is not NULL */
    return calloc((size_t)(count > 0 ? count : 1), size);
}

int64_t zero_buckets_needed(int64_t n_units, const int64_t *unit_span,
                            int64_t bucket_elements)
{
    if (n_units < 0 || bucket_elements <= 0 || (n_units > 0 && !unit_span)) {
        return -1;
    }
    int64_t total = 0;
    for (int64_t u = 0; u < n_units; u++) {
        if (unit_span[u] < 0) {
            return -1;
        }
        total += unit_span[u] / bucket_elements +
                 (unit_span[u] % bucket_elements != 0);
        if (total > ZERO_BUCKETS_MAX_COUNT) { /* before any overflow */
            return -2;
        }
    }
    return total;
}

static int plan_arguments_valid(int64_t n_params, const int64_t *param_unit,
                                const int64_t *param_offset,
                                const int64_t *param_numel, int64_t n_units,
                                const int64_t *unit_span,
                                const int64_t *unit_part, int64_t chunks,
                                int64_t bucket_elements)
{
    if (n_params < 0 ||
        (n_params > 0 && (!param_unit || !param_offset || !param_numel)) ||
        zero_buckets_needed(n_units, unit_span, bucket_elements) < 0) {
        return 0;
    }
    if (unit_part) { /* every span inside its chunks, their product in range */
        if (chunks < 1) {
            return 0;
        }
        for (int64_t u = 0; u < n_units; u++) {
            if (unit_part[u] < 0 || unit_part[u] > INT64_MAX / chunks ||
                unit_span[u] > chunks * unit_part[u]) {
                return 0;
            }
        }
    }
    for (int64_t i = 0; i < n_params; i++) {
        int64_t u = param_unit[i];
        if (u < 0 || u >= n_units || param_offset[i] < 0 ||
            param_numel[i] < 0 ||
            param_offset[i] > unit_span[u] - param_numel[i]) {
            return 0;
        }
    }
    return 1;
}

/* The elements all of unit u's chunks take; -1 without chunks. */
static int64_t chunked_size(const zero_buckets *plan, int64_t u)
{
    return plan->unit_part ? plan->chunks * plan->unit_part[u] : -1;
}

/* Buckets from the last unit's end backwards; returns their number, and
 * fills the plan's bucket arrays when `fill`. Units that fit share buckets
 * ([Note: small units share a bucket]); the others are cut into ranges of
 * their spans from the end. */
static int64_t lay_buckets(zero_buckets *plan, const int64_t *unit_span,
                           int64_t bucket_elements, int fill)
{
    int64_t b = 0;
    for (int64_t u = plan->n_units - 1; u >= 0;) {
        int64_t first = u, size = 0;
        while (first >= 0 && chunked_size(plan, first) >= 0 &&
               chunked_size(plan, first) <= bucket_elements - size) {
            size += chunked_size(plan, first);
            first--;
        }
        first++; /* the sharing units are [first, u]; none when first > u */
        if (first < u) {
            if (size > 0 && fill) { /* units all empty need no bucket */
                plan->bucket_unit[b] = first;
                plan->bucket_last[b] = u;
                plan->bucket_start[b] = 0;
                plan->bucket_end[b] = size;
                plan->bucket_segment[b] = size / plan->chunks;
                for (int64_t v = first, at = 0; v <= u; v++) {
                    plan->unit_prefix[v] = at;
                    at += plan->unit_part[v];
                }
            }
            b += size > 0;
            u = first - 1;
            continue;
        }
        for (int64_t end = unit_span[u]; end > 0;) {
            int64_t start = end > bucket_elements ? end - bucket_elements : 0;
            if (fill) {
                plan->bucket_unit[b] = u;
                plan->bucket_last[b] = u;
                plan->bucket_start[b] = start;
                plan->bucket_end[b] = end;
            }
            b++;
            end = start;
        }
        u--;
    }
    return b;
}

/* Parameter i's pieces in a bucket its unit shares: one per chunk it
 * crosses, each at its place in that chunk's segment. Returns the count
 * after them. */
static int64_t lay_shared_pieces(zero_buckets *plan, int64_t b, int64_t u,
                                 int64_t lo, int64_t hi, int64_t total,
                                 int fill)
{
    if (lo >= hi) {
        return total; /* an empty parameter has none (its unit may be too) */
    }
    int64_t part = plan->unit_part[u], segment = plan->bucket_segment[b];
    for (int64_t r = lo / part; r * part < hi; r++) {
        int64_t s = lo > r * part ? lo : r * part;
        int64_t e = hi < (r + 1) * part ? hi : (r + 1) * part;
        if (fill) {
            zero_bucket_piece piece = {
                b, r * segment + plan->unit_prefix[u] + s - r * part, s - lo,
                e - s};
            plan->pieces[total] = piece;
        }
        total++;
    }
    return total;
}

/* The pieces of every parameter: the buckets of its unit it overlaps. Each
 * parameter's pieces come out in bucket order. fill 0 counts them only. */
static int64_t lay_pieces(zero_buckets *plan, const int64_t *param_offset,
                          const int64_t *param_numel, int fill)
{
    int64_t total = 0;
    /* a unit's buckets are consecutive: the first of each unit */
    int64_t *unit_first = zeroed(plan->n_units + 1, sizeof *unit_first);
    int64_t *unit_count = zeroed(plan->n_units, sizeof *unit_count);
    if (!unit_first || !unit_count) {
        free(unit_first);
        free(unit_count);
        return -1;
    }
    for (int64_t b = plan->n_buckets - 1; b >= 0; b--) {
        for (int64_t u = plan->bucket_unit[b]; u <= plan->bucket_last[b]; u++) {
            unit_first[u] = b;
            unit_count[u]++;
        }
    }
    for (int64_t i = 0; i < plan->n_params; i++) {
        int64_t u = plan->param_unit[i];
        int64_t lo = param_offset[i], hi = lo + param_numel[i];
        if (fill) {
            plan->first_piece[i] = total;
        }
        if (plan->unit_prefix && plan->unit_prefix[u] >= 0) {
            /* a parameter of a non-empty span lies in a bucket */
            total = lay_shared_pieces(plan, unit_first[u], u, lo, hi, total, fill);
            continue;
        }
        for (int64_t k = 0; k < unit_count[u]; k++) {
            int64_t b = unit_first[u] + k;
            int64_t bs = plan->bucket_start[b], be = plan->bucket_end[b];
            if (lo < hi && lo < be && bs < hi) { /* an empty parameter has none */
                if (fill) {
                    int64_t s = lo > bs ? lo : bs, e = hi < be ? hi : be;
                    zero_bucket_piece piece = {b, s - bs, s - lo, e - s};
                    plan->pieces[total] = piece;
                }
                total++;
            }
        }
    }
    if (fill) {
        plan->first_piece[plan->n_params] = total;
    }
    free(unit_first);
    free(unit_count);
    return total;
}

/* [Note: no zero-fill] A bucket's buffer is made empty: the first piece
 * written into its staging (or late) buffer in a backward copies, a later
 * one (reentrant checkpointing's second part) adds, and at the send the
 * ranges no piece wrote (padding, parameters without a gradient) are
 * zeroed. A gradient then lands in its bucket in one pass, and no pass
 * zeroes what the gradients overwrite. Each piece has a written bit per
 * buffer; the pieces of a bucket are kept sorted by start so the unwritten
 * ranges come out in one walk. */
enum { WRITTEN_STAGING = 1, WRITTEN_LATE = 2 };

typedef struct {
    int64_t start, index;
} piece_at;

static int by_start(const void *a, const void *b)
{
    int64_t sa = ((const piece_at *)a)->start, sb = ((const piece_at *)b)->start;
    return (sa > sb) - (sa < sb);
}

/* bucket_first and by_bucket from the pieces: a counting sort by bucket,
 * then each bucket's by start. -1 out of memory; -2 when two pieces of a
 * bucket overlap (parameters sharing elements: a first write would then
 * overwrite another's gradient). */
static int index_pieces_by_bucket(zero_buckets *plan)
{
    int64_t nb = plan->n_buckets, np = plan->n_pieces;
    plan->bucket_first = zeroed(nb + 1, sizeof *plan->bucket_first);
    plan->by_bucket = zeroed(np, sizeof *plan->by_bucket);
    plan->written = zeroed(np, 1);
    int64_t *fill = zeroed(nb, sizeof *fill);
    piece_at *sorting = zeroed(np, sizeof *sorting);
    if (!plan->bucket_first || !plan->by_bucket || !plan->written || !fill ||
        !sorting) {
        free(fill);
        free(sorting);
        return -1;
    }
    for (int64_t k = 0; k < np; k++) {
        plan->bucket_first[plan->pieces[k].bucket + 1]++;
    }
    for (int64_t b = 0; b < nb; b++) {
        plan->bucket_first[b + 1] += plan->bucket_first[b];
    }
    for (int64_t k = 0; k < np; k++) {
        int64_t b = plan->pieces[k].bucket;
        piece_at at = {plan->pieces[k].bucket_start, k};
        sorting[plan->bucket_first[b] + fill[b]++] = at;
    }
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = plan->bucket_first[b], n = plan->bucket_first[b + 1] - lo;
        qsort(sorting + lo, (size_t)n, sizeof *sorting, by_start);
    }
    int overlap = 0;
    for (int64_t k = 0; k < np; k++) {
        plan->by_bucket[k] = sorting[k].index;
        const zero_bucket_piece *piece = &plan->pieces[sorting[k].index];
        if (k + 1 < np && plan->pieces[sorting[k + 1].index].bucket == piece->bucket &&
            sorting[k + 1].start < piece->bucket_start + piece->count) {
            overlap = 1; /* two parameters share elements of their unit */
        }
    }
    free(fill);
    free(sorting);
    return overlap ? -2 : 0;
}

zero_status zero_buckets_create(zero_buckets **out, int64_t n_params,
                                const int64_t *param_unit,
                                const int64_t *param_offset,
                                const int64_t *param_numel, int64_t n_units,
                                const int64_t *unit_span,
                                int64_t bucket_elements)
{
    return zero_buckets_create_chunked(out, n_params, param_unit, param_offset,
                                       param_numel, n_units, unit_span, NULL, 1,
                                       bucket_elements);
}

zero_status zero_buckets_create_chunked(zero_buckets **out, int64_t n_params,
                                        const int64_t *param_unit,
                                        const int64_t *param_offset,
                                        const int64_t *param_numel,
                                        int64_t n_units,
                                        const int64_t *unit_span,
                                        const int64_t *unit_part,
                                        int64_t chunks,
                                        int64_t bucket_elements)
{
    if (!out) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    *out = NULL;
    if (!plan_arguments_valid(n_params, param_unit, param_offset, param_numel,
                              n_units, unit_span, unit_part, chunks,
                              bucket_elements)) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    zero_buckets *plan = calloc(1, sizeof *plan);
    if (!plan) {
        return ZERO_ERR_OUT_OF_MEMORY;
    }
    plan->n_params = n_params;
    plan->n_units = n_units;
    if (unit_part) {
        plan->chunks = chunks;
        plan->unit_part = zeroed(n_units, sizeof *plan->unit_part);
        plan->unit_prefix = zeroed(n_units, sizeof *plan->unit_prefix);
        if (!plan->unit_part || !plan->unit_prefix) {
            zero_buckets_destroy(plan);
            return ZERO_ERR_OUT_OF_MEMORY;
        }
        for (int64_t u = 0; u < n_units; u++) {
            plan->unit_part[u] = unit_part[u];
            plan->unit_prefix[u] = -1;
        }
    }
    plan->n_buckets = lay_buckets(plan, unit_span, bucket_elements, 0);
    int64_t nb = plan->n_buckets;
    plan->param_unit = zeroed(n_params, sizeof *plan->param_unit);
    plan->first_piece = zeroed(n_params + 1, sizeof *plan->first_piece);
    plan->bucket_unit = zeroed(nb, sizeof *plan->bucket_unit);
    plan->bucket_start = zeroed(nb, sizeof *plan->bucket_start);
    plan->bucket_end = zeroed(nb, sizeof *plan->bucket_end);
    plan->bucket_last = zeroed(nb, sizeof *plan->bucket_last);
    plan->bucket_segment = zeroed(nb, sizeof *plan->bucket_segment);
    plan->unit_members = zeroed(n_units, sizeof *plan->unit_members);
    plan->pending = zeroed(nb, sizeof *plan->pending);
    plan->unit_pending = zeroed(n_units, sizeof *plan->unit_pending);
    plan->expected = zeroed(n_params, 1);
    plan->arrived = zeroed(n_params, 1);
    if (!plan->param_unit || !plan->first_piece || !plan->bucket_unit ||
        !plan->bucket_start || !plan->bucket_end || !plan->bucket_last ||
        !plan->bucket_segment || !plan->unit_members ||
        !plan->pending || !plan->unit_pending || !plan->expected ||
        !plan->arrived) {
        zero_buckets_destroy(plan);
        return ZERO_ERR_OUT_OF_MEMORY;
    }
    lay_buckets(plan, unit_span, bucket_elements, 1);
    for (int64_t i = 0; i < n_params; i++) {
        plan->param_unit[i] = param_unit[i];
        plan->unit_members[param_unit[i]]++;
        plan->expected[i] = 1;
    }
    int64_t total = lay_pieces(plan, param_offset, param_numel, 0);
    plan->pieces = total >= 0 ? zeroed(total, sizeof *plan->pieces) : NULL;
    if (!plan->pieces ||
        lay_pieces(plan, param_offset, param_numel, 1) != total) {
        zero_buckets_destroy(plan);
        return ZERO_ERR_OUT_OF_MEMORY;
    }
    plan->n_pieces = total;
    int indexed = index_pieces_by_bucket(plan);
    if (indexed != 0) {
        zero_buckets_destroy(plan);
        return indexed == -2 ? ZERO_ERR_INVALID_ARGUMENT : ZERO_ERR_OUT_OF_MEMORY;
    }
    zero_buckets_reset(plan, NULL);
    *out = plan;
    return ZERO_OK;
}

int64_t zero_buckets_count(const zero_buckets *plan)
{
    return plan ? plan->n_buckets : 0;
}

zero_status zero_buckets_range(const zero_buckets *plan, int64_t b,
                               int64_t *unit, int64_t *start, int64_t *end)
{
    if (!plan || b < 0 || b >= plan->n_buckets || !unit || !start || !end) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    *unit = plan->bucket_unit[b];
    *start = plan->bucket_start[b];
    *end = plan->bucket_end[b];
    return ZERO_OK;
}

zero_status zero_buckets_units(const zero_buckets *plan, int64_t b,
                               int64_t *first, int64_t *last)
{
    if (!plan || b < 0 || b >= plan->n_buckets || !first || !last) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    *first = plan->bucket_unit[b];
    *last = plan->bucket_last[b];
    return ZERO_OK;
}

int64_t zero_buckets_pieces(const zero_buckets *plan, int64_t param,
                            const zero_bucket_piece **pieces)
{
    if (!plan || param < 0 || param >= plan->n_params || !pieces) {
        return 0;
    }
    *pieces = plan->pieces + plan->first_piece[param];
    return plan->first_piece[param + 1] - plan->first_piece[param];
}

zero_status zero_buckets_reset(zero_buckets *plan, const uint8_t *expected)
{
    if (!plan) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    if (expected) {
        for (int64_t i = 0; i < plan->n_params; i++) {
            plan->expected[i] = expected[i] != 0;
        }
    }
    memset(plan->pending, 0, (size_t)plan->n_buckets * sizeof *plan->pending);
    for (int64_t u = 0; u < plan->n_units; u++) {
        plan->unit_pending[u] = plan->unit_members[u];
    }
    for (int64_t i = 0; i < plan->n_params; i++) {
        if (plan->expected[i]) {
            for (int64_t k = plan->first_piece[i]; k < plan->first_piece[i + 1];
                 k++) {
                plan->pending[plan->pieces[k].bucket]++;
            }
        } else {
            /* autograd may still read it after the unit's other gradients
             * are in: the unit waits for the end of the backward */
            plan->unit_pending[plan->param_unit[i]] = -1;
        }
    }
    if (plan->n_params > 0) {
        memset(plan->arrived, 0, (size_t)plan->n_params);
    }
    if (plan->n_pieces > 0) {
        memset(plan->written, 0, (size_t)plan->n_pieces);
    }
    plan->arrivals = 0;
    plan->next_bucket = 0;
    return ZERO_OK;
}

int zero_buckets_arrive(zero_buckets *plan, int64_t param)
{
    if (!plan || param < 0 || param >= plan->n_params) {
        return -1;
    }
    if (plan->arrived[param]) {
        return 0; /* a second part (reentrant checkpointing): adds, counts nothing */
    }
    plan->arrived[param] = 1;
    int flags = ZERO_ARRIVE_FIRST;
    if (plan->arrivals++ == 0) {
        flags |= ZERO_ARRIVE_BACKWARD;
    }
    if (plan->expected[param]) {
        flags |= ZERO_ARRIVE_COUNTED;
    }
    return flags;
}

int zero_buckets_claim(zero_buckets *plan, int64_t param, int64_t k, int late)
{
    if (!plan || param < 0 || param >= plan->n_params || k < 0 ||
        k >= plan->first_piece[param + 1] - plan->first_piece[param]) {
        return -1;
    }
    uint8_t bit = late ? WRITTEN_LATE : WRITTEN_STAGING;
    uint8_t *written = &plan->written[plan->first_piece[param] + k];
    int first = !(*written & bit);
    *written |= bit;
    return first;
}

int zero_buckets_each_gap(const zero_buckets *plan, int64_t b, int late,
                          zero_gap_fn fn, void *ctx)
{
    if (!plan || b < 0 || b >= plan->n_buckets || !fn) {
        return -1;
    }
    uint8_t bit = late ? WRITTEN_LATE : WRITTEN_STAGING;
    int64_t size = plan->bucket_end[b] - plan->bucket_start[b], at = 0;
    for (int64_t k = plan->bucket_first[b]; k < plan->bucket_first[b + 1]; k++) {
        int64_t index = plan->by_bucket[k];
        if (!(plan->written[index] & bit)) {
            continue;
        }
        const zero_bucket_piece *piece = &plan->pieces[index];
        if (piece->bucket_start > at) {
            int error = fn(ctx, at, piece->bucket_start - at);
            if (error) {
                return error;
            }
        }
        int64_t end = piece->bucket_start + piece->count;
        at = end > at ? end : at;
    }
    return size > at ? fn(ctx, at, size - at) : 0;
}

int zero_buckets_left(const zero_buckets *plan, int64_t b)
{
    return plan && b < plan->next_bucket;
}

void zero_buckets_piece_added(zero_buckets *plan, int64_t b)
{
    if (plan && b >= 0 && b < plan->n_buckets && plan->pending[b] > 0) {
        plan->pending[b]--;
    }
}

int64_t zero_buckets_next(zero_buckets *plan, int force)
{
    if (!plan || plan->next_bucket >= plan->n_buckets ||
        (!force && plan->pending[plan->next_bucket] != 0)) {
        return -1;
    }
    return plan->next_bucket++;
}

int64_t zero_buckets_unit_arrived(zero_buckets *plan, int64_t param)
{
    if (!plan || param < 0 || param >= plan->n_params) {
        return -1;
    }
    int64_t u = plan->param_unit[param];
    if (plan->unit_pending[u] > 0 && --plan->unit_pending[u] == 0) {
        return u;
    }
    return -1;
}

const uint8_t *zero_buckets_arrived(const zero_buckets *plan)
{
    return plan ? plan->arrived : NULL;
}

int64_t zero_buckets_sent(const zero_buckets *plan)
{
    return plan ? plan->next_bucket : 0;
}

int zero_buckets_started(const zero_buckets *plan)
{
    return plan && (plan->next_bucket > 0 || plan->arrivals > 0);
}
