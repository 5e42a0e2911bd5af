/* test_bucket_gaps.c: [Note: no zero-fill] in buckets.c without Python.
 * A bucket's buffer starts as garbage; random plans (padding, empty
 * parameters) get random writes (first ones copy, later ones add, into the
 * staging or the late buffer), then the unwritten ranges are zeroed; every
 * buffer must then equal the sum of what was written into it. Also: the
 * gaps come in order and merged, a callback's error stops the walk, a
 * reset forgets what was written, overlapping parameters are refused, bad
 * arguments, and the copy kernel. Run under AddressSanitizer and UBSan by
 * `make test-c`.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/zero.h"
#include "check.h"

typedef struct {
    float *buffer;
    int64_t size;
    int64_t last_end; /* where the previous gap ended; -1 before the first */
    int in_order;
    int calls, stop_after;
} gap_record;

static int zero_and_record(void *ctx, int64_t start, int64_t count)
{
    gap_record *r = ctx;
    /* in order, not touching the previous one (adjacent gaps are one) */
    r->in_order &= count > 0 && start > r->last_end &&
                   start + count <= r->size;
    r->last_end = start + count;
    for (int64_t k = start; k < start + count && k < r->size; k++) {
        r->buffer[k] = 0.0f;
    }
    return ++r->calls == r->stop_after ? 7 : 0;
}

static void test_random_writes(void)
{
    srand(11);
    for (int trial = 0; trial < 300; trial++) {
        int64_t n_units = 1 + rand() % 3, n_params = 0;
        int64_t unit_of[48], off[48], num[48], span[3];
        for (int64_t u = 0; u < n_units; u++) {
            int64_t at = rand() % 3, members = 1 + rand() % 6; /* leading padding */
            for (int64_t m = 0; m < members; m++) {
                unit_of[n_params] = u;
                off[n_params] = at;
                num[n_params] = rand() % 9;
                at += num[n_params] + rand() % 3;
                n_params++;
            }
            span[u] = at;
        }
        zero_buckets *plan = NULL;
        if (zero_buckets_create(&plan, n_params, unit_of, off, num, n_units, span,
                                1 + rand() % 10) != ZERO_OK) {
            CHECK(0, "trial %d: create failed", trial);
            continue;
        }
        int64_t nb = zero_buckets_count(plan); /* at most 3 x 62 */
        /* [bucket][late] buffers of garbage, and what they must end as */
        float *buf[256][2], *want[256][2];
        int64_t size[256];
        for (int64_t b = 0; b < nb; b++) {
            int64_t u, s, e;
            zero_buckets_range(plan, b, &u, &s, &e);
            size[b] = e - s;
            for (int late = 0; late < 2; late++) {
                buf[b][late] = malloc((size_t)(size[b] + 1) * sizeof(float));
                want[b][late] = calloc((size_t)(size[b] + 1), sizeof(float));
                for (int64_t k = 0; k < size[b]; k++) {
                    buf[b][late][k] = NAN;
                }
            }
        }
        int ok = 1;
        for (int round = 0; round < 2; round++) { /* the second after a reset */
            for (int64_t w = 0; w < 2 * n_params; w++) {
                int64_t i = rand() % n_params;
                const zero_bucket_piece *p;
                int64_t n = zero_buckets_pieces(plan, i, &p);
                for (int64_t k = 0; k < n; k++) {
                    int late = rand() % 2;
                    int first = zero_buckets_claim(plan, i, k, late);
                    float *dst = buf[p[k].bucket][late] + p[k].bucket_start;
                    float *ref = want[p[k].bucket][late] + p[k].bucket_start;
                    ok &= first == 0 || first == 1;
                    for (int64_t e = 0; e < p[k].count; e++) {
                        float v = (float)(1 + w + e);
                        dst[e] = first ? v : dst[e] + v;
                        ref[e] += v;
                    }
                }
            }
            for (int64_t b = 0; b < nb; b++) {
                for (int late = 0; late < 2; late++) {
                    gap_record r = {buf[b][late], size[b], -1, 1, 0, 0};
                    ok &= zero_buckets_each_gap(plan, b, late, zero_and_record, &r) == 0;
                    ok &= r.in_order;
                    ok &= memcmp(buf[b][late], want[b][late],
                                 (size_t)size[b] * sizeof(float)) == 0;
                    /* the next round starts from garbage again */
                    for (int64_t k = 0; k < size[b]; k++) {
                        buf[b][late][k] = NAN;
                        want[b][late][k] = 0.0f;
                    }
                }
            }
            CHECK(ok, "trial %d round %d: a buffer is not what was written", trial,
                  round);
            zero_buckets_reset(plan, NULL);
        }
        for (int64_t b = 0; b < nb; b++) {
            for (int late = 0; late < 2; late++) {
                free(buf[b][late]);
                free(want[b][late]);
            }
        }
        zero_buckets_destroy(plan);
    }
}

/* One unit of span 12, p0 [1, 4), p1 [6, 9), buckets of 5 from the end:
 * b0 = [7, 12), b1 = [2, 7), b2 = [0, 2). */
static void test_known_gaps(void)
{
    const int64_t unit[] = {0, 0}, off[] = {1, 6}, num[] = {3, 3}, span[] = {12};
    zero_buckets *plan = NULL;
    CHECK(zero_buckets_create(&plan, 2, unit, off, num, 1, span, 5) == ZERO_OK &&
              zero_buckets_count(plan) == 3,
          "create");
    if (!plan) {
        return;
    }
    float b1[5];
    gap_record r = {b1, 5, -1, 1, 0, 0};
    /* nothing written: the whole bucket is one gap */
    CHECK(zero_buckets_each_gap(plan, 1, 0, zero_and_record, &r) == 0 &&
              r.calls == 1 && r.last_end == 5,
          "an unwritten bucket is one gap");
    /* p1's pieces: b0 [0, 2) (elements 7, 8), b1 [4, 5) (element 6) */
    CHECK(zero_buckets_claim(plan, 1, 1, 0) == 1, "p1's b1 piece: first");
    CHECK(zero_buckets_claim(plan, 1, 1, 0) == 0, "then not");
    CHECK(zero_buckets_claim(plan, 1, 1, 1) == 1, "the late buffer apart");
    CHECK(zero_buckets_claim(plan, 0, 0, 0) == 1, "p0's b1 piece [0, 2)");
    gap_record g = {b1, 5, -1, 1, 0, 0};
    zero_buckets_each_gap(plan, 1, 0, zero_and_record, &g);
    CHECK(g.calls == 1 && g.last_end == 4 && g.in_order,
          "b1: one gap [2, 4) between p0 and p1 (%d calls, end %lld)", g.calls,
          (long long)g.last_end);
    gap_record late = {b1, 5, -1, 1, 0, 0};
    zero_buckets_each_gap(plan, 1, 1, zero_and_record, &late);
    CHECK(late.calls == 1 && late.last_end == 4, "late b1: [0, 4)");
    float b0[5];
    gap_record stop = {b0, 5, -1, 1, 0, 1};
    CHECK(zero_buckets_each_gap(plan, 0, 0, zero_and_record, &stop) == 7 &&
              stop.calls == 1,
          "the callback's error stops the walk and comes back");
    zero_buckets_reset(plan, NULL);
    CHECK(zero_buckets_claim(plan, 1, 1, 0) == 1, "a reset forgets the writes");
    /* bad arguments */
    CHECK(zero_buckets_claim(plan, 2, 0, 0) == -1 &&
              zero_buckets_claim(plan, 0, 2, 0) == -1 && /* p0 has 2 */
              zero_buckets_claim(plan, 0, -1, 0) == -1 &&
              zero_buckets_claim(NULL, 0, 0, 0) == -1,
          "claim out of range");
    CHECK(zero_buckets_each_gap(plan, 3, 0, zero_and_record, &r) == -1 &&
              zero_buckets_each_gap(plan, 0, 0, NULL, &r) == -1 &&
              zero_buckets_each_gap(NULL, 0, 0, zero_and_record, &r) == -1,
          "each_gap's bad arguments");
    zero_buckets_destroy(plan);
    /* parameters sharing elements: a first write would overwrite */
    const int64_t overlap_off[] = {1, 3};
    plan = NULL;
    CHECK(zero_buckets_create(&plan, 2, unit, overlap_off, num, 1, span, 5) ==
                  ZERO_ERR_INVALID_ARGUMENT && !plan,
          "overlapping parameters refused");
    const int64_t same_off[] = {6, 6}, sizes[] = {0, 3};
    CHECK(zero_buckets_create(&plan, 2, unit, same_off, sizes, 1, span, 5) == ZERO_OK,
          "an empty parameter may sit where another starts");
    zero_buckets_destroy(plan);
}

static void test_copy(void)
{
    int64_t n = 300000; /* above the threaded size */
    uint16_t *src = malloc((size_t)n * 2), *dst = calloc((size_t)n, 2);
    float *src32 = malloc((size_t)n * 4), *dst32 = calloc((size_t)n, 4);
    for (int64_t k = 0; k < n; k++) {
        src[k] = (uint16_t)(k * 2654435761u >> 16);
        src32[k] = (float)k * 0.5f;
    }
    CHECK(zero_copy(dst, src, ZERO_BF16, n) == ZERO_OK &&
              memcmp(dst, src, (size_t)n * 2) == 0,
          "bf16 copy");
    CHECK(zero_copy(dst32 + 1, src32 + 1, ZERO_F32, 5) == ZERO_OK &&
              dst32[0] == 0.0f && dst32[6] == 0.0f && dst32[5] == src32[5],
          "a short f32 copy touches its range only");
    CHECK(zero_copy(dst32, src32, ZERO_F32, n) == ZERO_OK &&
              memcmp(dst32, src32, (size_t)n * 4) == 0,
          "f32 copy");
    CHECK(zero_copy(NULL, src, ZERO_F16, 3) == ZERO_ERR_INVALID_ARGUMENT &&
              zero_copy(dst, src, ZERO_F16, -1) == ZERO_ERR_INVALID_ARGUMENT &&
              zero_copy(dst, src, (zero_dtype)99, 3) == ZERO_ERR_UNSUPPORTED_DTYPE &&
              zero_copy(NULL, NULL, ZERO_F32, 0) == ZERO_OK,
          "copy's bad arguments");
    free(src);
    free(dst);
    free(src32);
    free(dst32);
}

int main(void)
{
    test_known_gaps();
    test_random_writes();
    test_copy();
    printf("test_bucket_gaps: %d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
