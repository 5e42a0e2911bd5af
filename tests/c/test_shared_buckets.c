/* test_shared_buckets.c: [Note: small units share a bucket] (zero.h,
 * buckets.c) without Python: a known plan written out by hand (a unit too
 * big to share, three that share, their pieces and the gaps of padding),
 * random plans against the definition (each shared bucket's segment r
 * holds chunk r of its units, lowest first; every gradient element in
 * exactly one piece at that place; buckets leave in order), and bad
 * chunked arguments. Run under AddressSanitizer and UBSan by `make test-c`.
 */
#include <stdlib.h>
#include <string.h>

#include "../../csrc/zero.h"
#include "check.h"

/* Four units on 2 chunks, buckets of 22 elements:
 *   unit 0: span 10, part 5: p0 [0, 4), p1 [4, 10)
 *   unit 1: span 7, part 4:  p2 [0, 3), p3 [3, 7)
 *   unit 2: span 3, part 2:  p4 [0, 3)
 *   unit 3: span 20, part 10: p5 [0, 20)
 * From the last unit: unit 3 takes 20 and unit 2 would make 24, so unit 3
 * is alone: b0 = its span [0, 20). Units 2, 1, 0 take 4 + 8 + 10 = 22: b1,
 * segments of 11, unit 0's chunk at 0, unit 1's at 5, unit 2's at 9. */
static const int64_t units[] = {0, 0, 1, 1, 2, 3},
                     offsets[] = {0, 4, 0, 3, 0, 0},
                     numels[] = {4, 6, 3, 4, 3, 20}, spans[] = {10, 7, 3, 20},
                     parts[] = {5, 4, 2, 10};

typedef struct {
    int64_t starts[8], counts[8];
    int n;
} gaps_seen;

static int record_gap(void *ctx, int64_t start, int64_t count)
{
    gaps_seen *seen = ctx;
    if (seen->n < 8) {
        seen->starts[seen->n] = start;
        seen->counts[seen->n] = count;
    }
    seen->n++;
    return 0;
}

static void test_known_shared_plan(void)
{
    zero_buckets *plan = NULL;
    zero_status s = zero_buckets_create_chunked(&plan, 6, units, offsets, numels,
                                                4, spans, parts, 2, 22);
    CHECK(s == ZERO_OK && plan, "create: status %d", (int)s);
    if (!plan) {
        return;
    }
    CHECK(zero_buckets_count(plan) == 2, "2 buckets, got %lld",
          (long long)zero_buckets_count(plan));
    int64_t u, st, e, first, last;
    zero_buckets_range(plan, 0, &u, &st, &e);
    zero_buckets_units(plan, 0, &first, &last);
    CHECK(u == 3 && st == 0 && e == 20 && first == 3 && last == 3,
          "b0 is unit 3's span alone: (%lld %lld %lld) units %lld-%lld",
          (long long)u, (long long)st, (long long)e, (long long)first,
          (long long)last);
    zero_buckets_range(plan, 1, &u, &st, &e);
    zero_buckets_units(plan, 1, &first, &last);
    CHECK(u == 0 && st == 0 && e == 22 && first == 0 && last == 2,
          "b1 is units 0-2 shared: (%lld %lld %lld) units %lld-%lld",
          (long long)u, (long long)st, (long long)e, (long long)first,
          (long long)last);
    /* {bucket, bucket_start, grad_start, count}: one piece per chunk */
    const zero_bucket_piece want[6][2] = {
        {{1, 0, 0, 4}, {0}},
        {{1, 4, 0, 1}, {1, 11, 1, 5}},
        {{1, 5, 0, 3}, {0}},
        {{1, 8, 0, 1}, {1, 16, 1, 3}},
        {{1, 9, 0, 2}, {1, 20, 2, 1}},
        {{0, 0, 0, 20}, {0}}};
    const int64_t want_count[6] = {1, 2, 1, 2, 2, 1};
    for (int i = 0; i < 6; i++) {
        const zero_bucket_piece *pieces;
        int64_t n = zero_buckets_pieces(plan, i, &pieces);
        CHECK(n == want_count[i], "param %d: %lld pieces", i, (long long)n);
        for (int64_t k = 0; k < n && k < want_count[i]; k++) {
            CHECK(memcmp(&pieces[k], &want[i][k], sizeof pieces[k]) == 0,
                  "param %d piece %lld: {%lld %lld %lld %lld}", i, (long long)k,
                  (long long)pieces[k].bucket, (long long)pieces[k].bucket_start,
                  (long long)pieces[k].grad_start, (long long)pieces[k].count);
        }
    }
    /* every piece written: the gaps are the padding of units 1 and 2's
     * second chunks, [19, 20) and [21, 22) */
    for (int i = 0; i < 6; i++) {
        const zero_bucket_piece *pieces;
        int64_t n = zero_buckets_pieces(plan, i, &pieces);
        for (int64_t k = 0; k < n; k++) {
            zero_buckets_claim(plan, i, k, 0);
        }
    }
    gaps_seen seen = {{0}, {0}, 0};
    zero_buckets_each_gap(plan, 1, 0, record_gap, &seen);
    CHECK(seen.n == 2 && seen.starts[0] == 19 && seen.counts[0] == 1 &&
              seen.starts[1] == 21 && seen.counts[1] == 1,
          "gaps of b1: %d", seen.n);
    /* the shared bucket leaves once all three units' pieces are in */
    for (int i = 5; i >= 0; i--) {
        zero_buckets_arrive(plan, i);
        const zero_bucket_piece *pieces;
        int64_t n = zero_buckets_pieces(plan, i, &pieces);
        for (int64_t k = 0; k < n; k++) {
            zero_buckets_piece_added(plan, pieces[k].bucket);
        }
        int64_t b = zero_buckets_next(plan, 0);
        CHECK(b == (i == 5 ? 0 : i == 0 ? 1 : -1),
              "after param %d, bucket %lld left", i, (long long)b);
    }
    zero_buckets_destroy(plan);
}

/* Random plans: where each gradient element lands, worked out from the
 * definition, against the pieces. */
static void test_random_shared_plans(void)
{
    srand(5);
    for (int trial = 0; trial < 400; trial++) {
        int64_t n_units = 1 + rand() % 6, n_params = 0, chunks = 1 + rand() % 4;
        int64_t unit_of[64], off[64], num[64], span[6], part[6];
        for (int64_t u = 0; u < n_units; u++) {
            int64_t at = 0, members = rand() % 4; /* empty units too */
            for (int64_t m = 0; m < members; m++) {
                unit_of[n_params] = u;
                off[n_params] = at;
                num[n_params] = rand() % 9;
                at += num[n_params] + rand() % 3;
                n_params++;
            }
            span[u] = at;
            part[u] = (at + chunks - 1) / chunks + rand() % 3; /* padding */
        }
        int64_t bucket_elements = 1 + rand() % 40;
        zero_buckets *plan = NULL;
        if (zero_buckets_create_chunked(&plan, n_params, unit_of, off, num,
                                        n_units, span, part, chunks,
                                        bucket_elements) != ZERO_OK) {
            CHECK(0, "trial %d: create failed", trial);
            continue;
        }
        int ok = 1;
        int64_t nb = zero_buckets_count(plan), next_unit = n_units - 1;
        for (int64_t b = 0; b < nb; b++) {
            int64_t u, s, e, first, last;
            zero_buckets_range(plan, b, &u, &s, &e);
            zero_buckets_units(plan, b, &first, &last);
            /* buckets take the units from the last, skipping only empty
             * ones; a bucket past bucket_elements is never shared */
            while (next_unit > last && span[next_unit] == 0) {
                next_unit--;
            }
            ok &= first == u && last <= next_unit && e - s <= bucket_elements;
            if (first < last) {
                int64_t segment = 0;
                for (int64_t v = first; v <= last; v++) {
                    segment += part[v];
                    ok &= chunks * part[v] <= bucket_elements;
                }
                ok &= s == 0 && e == chunks * segment;
                next_unit = first - 1;
            } else if (s == 0) {
                next_unit = u - 1;
            }
        }
        while (next_unit >= 0 && span[next_unit] == 0) {
            next_unit--;
        }
        ok &= next_unit == -1;
        for (int64_t i = 0; i < n_params; i++) {
            const zero_bucket_piece *p;
            int64_t n = zero_buckets_pieces(plan, i, &p), covered = 0;
            for (int64_t k = 0; k < n; k++) {
                int64_t u, s, e, first, last;
                zero_buckets_range(plan, p[k].bucket, &u, &s, &e);
                zero_buckets_units(plan, p[k].bucket, &first, &last);
                int64_t x = off[i] + p[k].grad_start; /* in unit coordinates */
                ok &= p[k].count > 0 && unit_of[i] >= first && unit_of[i] <= last;
                if (first < last) {
                    int64_t segment = 0, prefix = 0, pu = part[unit_of[i]];
                    for (int64_t v = first; v <= last; v++) {
                        segment += part[v];
                        prefix += v < unit_of[i] ? part[v] : 0;
                    }
                    int64_t r = x / pu;
                    ok &= p[k].bucket_start == r * segment + prefix + x - r * pu;
                    ok &= x + p[k].count <= (r + 1) * pu; /* inside one chunk */
                } else {
                    ok &= s + p[k].bucket_start == x;
                }
                ok &= p[k].bucket_start + p[k].count <= e - s;
                covered += p[k].count;
            }
            ok &= covered == num[i];
        }
        /* every bucket leaves once, in order */
        for (int64_t i = n_params - 1; i >= 0; i--) {
            zero_buckets_arrive(plan, i);
            const zero_bucket_piece *p;
            int64_t n = zero_buckets_pieces(plan, i, &p);
            for (int64_t k = 0; k < n; k++) {
                zero_buckets_piece_added(plan, p[k].bucket);
            }
        }
        int64_t b, sent = 0;
        while ((b = zero_buckets_next(plan, 0)) >= 0) {
            ok &= b == sent++;
        }
        ok &= sent == nb;
        CHECK(ok, "trial %d: shared plan wrong", trial);
        zero_buckets_destroy(plan);
    }
}

static void test_bad_chunked(void)
{
    zero_buckets *plan = NULL;
    const int64_t short_parts[] = {4, 4, 2, 10}; /* 2 x 4 < unit 0's span 10 */
    CHECK(zero_buckets_create_chunked(&plan, 6, units, offsets, numels, 4, spans,
                                      short_parts, 2, 22) ==
                  ZERO_ERR_INVALID_ARGUMENT && !plan,
          "chunks short of a span");
    CHECK(zero_buckets_create_chunked(&plan, 6, units, offsets, numels, 4, spans,
                                      parts, 0, 22) == ZERO_ERR_INVALID_ARGUMENT,
          "no chunks");
    const int64_t huge_parts[] = {INT64_MAX / 2 + 1, 4, 2, 10};
    CHECK(zero_buckets_create_chunked(&plan, 6, units, offsets, numels, 4, spans,
                                      huge_parts, 2, 22) ==
              ZERO_ERR_INVALID_ARGUMENT,
          "chunks x part past int64");
    const int64_t negative_parts[] = {5, -4, 2, 10};
    CHECK(zero_buckets_create_chunked(&plan, 6, units, offsets, numels, 4, spans,
                                      negative_parts, 2, 22) ==
              ZERO_ERR_INVALID_ARGUMENT,
          "a negative part");
    /* no parts: the plan of zero_buckets_create, nothing shared */
    CHECK(zero_buckets_create_chunked(&plan, 6, units, offsets, numels, 4, spans,
                                      NULL, 0, 22) == ZERO_OK &&
              zero_buckets_count(plan) == 4,
          "no parts: a bucket per unit");
    int64_t first, last;
    CHECK(zero_buckets_units(plan, 4, &first, &last) == ZERO_ERR_INVALID_ARGUMENT,
          "units out of range");
    zero_buckets_destroy(plan);
}

int main(void)
{
    test_known_shared_plan();
    test_random_shared_plans();
    test_bad_chunked();
    printf("test_shared_buckets: %d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
