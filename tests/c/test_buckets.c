/* test_buckets.c: the gradient bucket plan and its counts (buckets.c)
 * without Python: the layout of a known plan written out by hand, random
 * plans against their definition (every element of every unit in exactly
 * one bucket, every gradient element in exactly one piece), the order
 * buckets leave in with and without expected parameters, late pieces,
 * bad arguments, and the accumulate kernel against known roundings.
 * Run under AddressSanitizer and UBSan by `make test-c`.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/zero.h"
#include "check.h"
#include "zero/half.h"

/* Two units of spans 10 and 7, buckets of 4 elements:
 *   unit 0: p0 [0, 4), p1 [4, 10)    unit 1: p2 [0, 3), p3 [3, 7)
 * Buckets from the last unit's end: b0 = u1 [3, 7), b1 = u1 [0, 3),
 * b2 = u0 [6, 10), b3 = u0 [2, 6), b4 = u0 [0, 2). */
static const int64_t units[] = {0, 0, 1, 1}, offsets[] = {0, 4, 0, 3},
                     numels[] = {4, 6, 3, 4}, spans[] = {10, 7};

static zero_buckets *known_plan(void)
{
    zero_buckets *plan = NULL;
    zero_status s = zero_buckets_create(&plan, 4, units, offsets, numels, 2,
                                        spans, 4);
    CHECK(s == ZERO_OK && plan, "create: status %d", (int)s);
    return plan;
}

static void test_known_layout(void)
{
    zero_buckets *plan = known_plan();
    if (!plan) {
        return;
    }
    const int64_t want_ranges[5][3] = {
        {1, 3, 7}, {1, 0, 3}, {0, 6, 10}, {0, 2, 6}, {0, 0, 2}};
    CHECK(zero_buckets_count(plan) == 5, "5 buckets, got %lld",
          (long long)zero_buckets_count(plan));
    for (int b = 0; b < 5; b++) {
        int64_t u, s, e;
        zero_buckets_range(plan, b, &u, &s, &e);
        CHECK(u == want_ranges[b][0] && s == want_ranges[b][1] &&
                  e == want_ranges[b][2],
              "bucket %d is (%lld, %lld, %lld)", b, (long long)u, (long long)s,
              (long long)e);
    }
    /* {bucket, bucket_start, grad_start, count} per parameter */
    const zero_bucket_piece want[4][2] = {
        {{3, 0, 2, 2}, {4, 0, 0, 2}},
        {{2, 0, 2, 4}, {3, 2, 0, 2}},
        {{1, 0, 0, 3}, {0}},
        {{0, 0, 0, 4}, {0}}};
    const int64_t want_count[4] = {2, 2, 1, 1};
    for (int i = 0; i < 4; i++) {
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
    zero_buckets_destroy(plan);
}

/* Arrive param i, add its pieces, and collect what leaves into sent[]. */
static int arrive(zero_buckets *plan, int64_t i, int64_t *sent, int *n_sent,
                  int64_t *late_bucket, int64_t *unit_done)
{
    int flags = zero_buckets_arrive(plan, i);
    const zero_bucket_piece *pieces;
    int64_t n = zero_buckets_pieces(plan, i, &pieces);
    for (int64_t k = 0; k < n; k++) {
        if (zero_buckets_left(plan, pieces[k].bucket)) {
            *late_bucket = pieces[k].bucket;
        }
        if (flags & ZERO_ARRIVE_COUNTED) {
            zero_buckets_piece_added(plan, pieces[k].bucket);
            int64_t b;
            while ((b = zero_buckets_next(plan, 0)) >= 0) {
                sent[(*n_sent)++] = b;
            }
        }
    }
    *unit_done = (flags & ZERO_ARRIVE_FIRST) ? zero_buckets_unit_arrived(plan, i)
                                             : -1;
    return flags;
}

static void test_order_all_expected(void)
{
    zero_buckets *plan = known_plan();
    if (!plan) {
        return;
    }
    int64_t sent[8], late = -1, unit;
    int n_sent = 0;
    CHECK(!zero_buckets_started(plan), "not started before any arrival");
    int flags = arrive(plan, 3, sent, &n_sent, &late, &unit);
    CHECK(flags == (ZERO_ARRIVE_FIRST | ZERO_ARRIVE_COUNTED | ZERO_ARRIVE_BACKWARD),
          "first arrival flags %d", flags);
    CHECK(n_sent == 1 && sent[0] == 0 && unit == -1, "p3 sends b0 only");
    arrive(plan, 2, sent, &n_sent, &late, &unit);
    CHECK(n_sent == 2 && sent[1] == 1 && unit == 1, "p2 sends b1, unit 1 done");
    arrive(plan, 1, sent, &n_sent, &late, &unit);
    CHECK(n_sent == 3 && sent[2] == 2 && unit == -1,
          "p1 sends b2; b3 waits for p0 (%d sent)", n_sent);
    flags = arrive(plan, 0, sent, &n_sent, &late, &unit);
    CHECK(flags == (ZERO_ARRIVE_FIRST | ZERO_ARRIVE_COUNTED), "flags %d", flags);
    CHECK(n_sent == 5 && sent[3] == 3 && sent[4] == 4 && unit == 0,
          "p0 sends b3 and b4, unit 0 done");
    CHECK(late == -1, "no late piece");
    /* a second part of p1's gradient (reentrant checkpointing) */
    flags = arrive(plan, 1, sent, &n_sent, &late, &unit);
    CHECK(flags == 0 && late == 3 && unit == -1,
          "a second arrival counts nothing and lands late (flags %d, late %lld)",
          flags, (long long)late);
    const uint8_t *arrived = zero_buckets_arrived(plan);
    CHECK(arrived[0] && arrived[1] && arrived[2] && arrived[3], "all arrived");
    CHECK(zero_buckets_sent(plan) == 5 && zero_buckets_next(plan, 1) == -1,
          "nothing left to send");
    zero_buckets_destroy(plan);
}

static void test_order_unexpected(void)
{
    zero_buckets *plan = known_plan();
    if (!plan) {
        return;
    }
    const uint8_t expected[4] = {1, 0, 1, 1};
    CHECK(zero_buckets_reset(plan, expected) == ZERO_OK, "reset");
    int64_t sent[8], late = -1, unit, units_done = 0;
    int n_sent = 0;
    arrive(plan, 3, sent, &n_sent, &late, &unit);
    units_done += unit >= 0;
    CHECK(n_sent == 1 && sent[0] == 0, "p3 sends b0");
    arrive(plan, 2, sent, &n_sent, &late, &unit);
    units_done += unit >= 0;
    /* b2 waits for no one: it leaves right after b1 */
    CHECK(n_sent == 3 && sent[1] == 1 && sent[2] == 2, "p2 sends b1 and b2");
    int flags = arrive(plan, 1, sent, &n_sent, &late, &unit);
    units_done += unit >= 0;
    CHECK(flags == ZERO_ARRIVE_FIRST && late == 2 && n_sent == 3,
          "unexpected p1 lands late in b2, counts nothing (flags %d)", flags);
    arrive(plan, 0, sent, &n_sent, &late, &unit);
    units_done += unit >= 0;
    CHECK(n_sent == 5 && sent[3] == 3 && sent[4] == 4, "p0 sends b3 and b4");
    CHECK(units_done == 1, "unit 0 (p1 unexpected) is never reported: %lld",
          (long long)units_done);
    /* reset(NULL) keeps the expectations; force sends regardless */
    zero_buckets_reset(plan, NULL);
    CHECK(zero_buckets_next(plan, 0) == -1, "b0 waits for p3");
    CHECK(zero_buckets_next(plan, 1) == 0 && zero_buckets_next(plan, 1) == 1 &&
              zero_buckets_next(plan, 0) == 2,
          "forced b0, b1, then b2 waits for no one");
    CHECK(zero_buckets_started(plan), "started once a bucket left");
    zero_buckets_destroy(plan);
}

/* Random plans against the definition. */
static void test_random_plans(void)
{
    srand(7);
    for (int trial = 0; trial < 200; trial++) {
        int64_t n_units = 1 + rand() % 4, n_params = 0;
        int64_t unit_of[64], off[64], num[64], span[4];
        for (int64_t u = 0; u < n_units; u++) {
            int64_t at = 0, members = 1 + rand() % 6;
            for (int64_t m = 0; m < members; m++) {
                unit_of[n_params] = u;
                off[n_params] = at;
                num[n_params] = rand() % 9; /* empty parameters too */
                at += num[n_params] + rand() % 3; /* padding */
                n_params++;
            }
            span[u] = at;
        }
        int64_t bucket_elements = 1 + rand() % 12;
        zero_buckets *plan = NULL;
        if (zero_buckets_create(&plan, n_params, unit_of, off, num, n_units, span,
                                bucket_elements) != ZERO_OK) {
            CHECK(0, "trial %d: create failed", trial);
            continue;
        }
        int64_t nb = zero_buckets_count(plan);
        int ok = 1, last_unit = (int)n_units;
        /* buckets tile each unit's span, last unit first, from its end */
        int64_t expect_end = 0;
        for (int64_t b = 0; b < nb; b++) {
            int64_t u, s, e;
            zero_buckets_range(plan, b, &u, &s, &e);
            if (u != last_unit) {
                ok &= u < last_unit && (last_unit == (int)n_units || expect_end == 0);
                last_unit = (int)u;
                expect_end = span[u];
            }
            ok &= e == expect_end && s < e && e - s <= bucket_elements;
            expect_end = s;
        }
        ok &= expect_end == 0;
        for (int64_t i = 0; i < n_params; i++) {
            const zero_bucket_piece *p;
            int64_t n = zero_buckets_pieces(plan, i, &p), covered = 0, prev = -1;
            for (int64_t k = 0; k < n; k++) {
                int64_t u, s, e;
                zero_buckets_range(plan, p[k].bucket, &u, &s, &e);
                ok &= u == unit_of[i] && p[k].bucket > prev && p[k].count > 0;
                ok &= p[k].bucket_start + p[k].count <= e - s;
                ok &= s + p[k].bucket_start == off[i] + p[k].grad_start;
                prev = p[k].bucket;
                covered += p[k].count;
            }
            ok &= covered == num[i];
        }
        /* every bucket leaves once, in order, whatever the arrival order */
        int64_t order[64];
        for (int64_t i = 0; i < n_params; i++) {
            order[i] = i;
        }
        for (int64_t i = n_params - 1; i > 0; i--) {
            int64_t j = rand() % (i + 1), t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
        int64_t sent[256], late, unit;
        int n_sent = 0;
        for (int64_t k = 0; k < n_params; k++) {
            arrive(plan, order[k], sent, &n_sent, &late, &unit);
        }
        int64_t b;
        while ((b = zero_buckets_next(plan, 1)) >= 0) {
            sent[n_sent++] = b; /* buckets of empty parameters only */
        }
        ok &= n_sent == nb;
        for (int k = 0; k < n_sent; k++) {
            ok &= sent[k] == k;
        }
        CHECK(ok, "trial %d: plan or order wrong", trial);
        zero_buckets_destroy(plan);
    }
}

static void test_bad_plans(void)
{
    zero_buckets *plan = NULL;
    const int64_t bad_off[] = {0, 5, 0, 3}; /* p1 [5, 11) > span 10 */
    CHECK(zero_buckets_create(&plan, 4, units, bad_off, numels, 2, spans, 4) ==
                  ZERO_ERR_INVALID_ARGUMENT && !plan,
          "a parameter past its unit's span");
    const int64_t bad_unit[] = {0, 0, 2, 1};
    CHECK(zero_buckets_create(&plan, 4, bad_unit, offsets, numels, 2, spans, 4) ==
              ZERO_ERR_INVALID_ARGUMENT,
          "a unit out of range");
    CHECK(zero_buckets_create(&plan, 4, units, offsets, numels, 2, spans, 0) ==
              ZERO_ERR_INVALID_ARGUMENT,
          "bucket_elements 0");
    CHECK(zero_buckets_create(&plan, 4, NULL, offsets, numels, 2, spans, 4) ==
              ZERO_ERR_INVALID_ARGUMENT,
          "no units array");
    CHECK(zero_buckets_create(NULL, 4, units, offsets, numels, 2, spans, 4) ==
              ZERO_ERR_INVALID_ARGUMENT,
          "no out");
    /* more buckets than a plan may have: refused at once, counted without
     * walking them (2^62 elements in buckets of 1 walked for good) */
    const int64_t huge_span[] = {INT64_C(1) << 62};
    const int64_t one_unit[] = {0}, at_zero[] = {0}, one_numel[] = {1};
    CHECK(zero_buckets_needed(1, huge_span, 1) == -2 &&
              zero_buckets_create(&plan, 1, one_unit, at_zero, one_numel, 1,
                                  huge_span, 1) == ZERO_ERR_INVALID_ARGUMENT,
          "2^62 buckets");
    const int64_t at_limit[] = {ZERO_BUCKETS_MAX_COUNT * 3 - 1};
    CHECK(zero_buckets_needed(1, at_limit, 3) == ZERO_BUCKETS_MAX_COUNT &&
              zero_buckets_needed(1, at_limit, 2) == -2 &&
              zero_buckets_needed(2, spans, 4) == 5 &&
              zero_buckets_needed(1, bad_off, 0) == -1,
          "bucket counts");
    CHECK(zero_buckets_create(&plan, 0, NULL, NULL, NULL, 0, NULL, 4) == ZERO_OK &&
              zero_buckets_count(plan) == 0 && zero_buckets_next(plan, 1) == -1,
          "an empty plan");
    zero_buckets_destroy(plan);
    plan = known_plan();
    if (plan) {
        const zero_bucket_piece *p = NULL;
        CHECK(zero_buckets_arrive(plan, 4) == -1 && zero_buckets_arrive(plan, -1) == -1,
              "arrive out of range");
        CHECK(zero_buckets_pieces(plan, 9, &p) == 0, "pieces out of range");
        int64_t u, s, e;
        CHECK(zero_buckets_range(plan, 5, &u, &s, &e) == ZERO_ERR_INVALID_ARGUMENT,
              "range out of range");
        zero_buckets_destroy(plan);
    }
    zero_buckets_destroy(NULL);
}

static void test_accumulate(void)
{
    /* bf16: 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1);
     * (1 + 2^-7) + 2^-8 ties to 1 + 2^-6 */
    uint16_t dst[3] = {0x3f80, 0x3f81, 0x7f80}, src[3] = {0x3b80, 0x3b80, 0xff80};
    CHECK(zero_accumulate(dst, src, ZERO_BF16, 3) == ZERO_OK, "bf16 status");
    CHECK(dst[0] == 0x3f80 && dst[1] == 0x3f82, "bf16 ties to even: %04x %04x",
          dst[0], dst[1]);
    CHECK(dst[2] == 0x7fc0, "inf + -inf is NaN: %04x", dst[2]);
    /* f16: 1 + 2^-11 ties to 1; 2048 + 1 ties to 2048 */
    uint16_t h[2] = {0x3c00, 0x6800}, hs[2] = {0x1000, 0x3c00};
    CHECK(zero_accumulate(h, hs, ZERO_F16, 2) == ZERO_OK && h[0] == 0x3c00 &&
              h[1] == 0x6800,
          "f16 ties to even: %04x %04x", h[0], h[1]);
    /* large: the threaded path, against the element formula */
    int64_t n = 300001;
    float *a = malloc((size_t)n * sizeof *a), *b = malloc((size_t)n * sizeof *b);
    uint16_t *c = malloc((size_t)n * sizeof *c), *d = malloc((size_t)n * sizeof *d);
    if (!a || !b || !c || !d) {
        CHECK(0, "out of memory");
    } else {
        for (int64_t i = 0; i < n; i++) {
            a[i] = (float)((i * 7919) % 1000) / 37.0f;
            b[i] = (float)((i * 104729) % 997) / -53.0f;
            c[i] = f32_to_bf16(a[i]);
            d[i] = f32_to_bf16(b[i]);
        }
        float a5 = a[5] + b[5], alast = a[n - 1] + b[n - 1];
        uint16_t c5 = f32_to_bf16(bf16_to_f32(c[5]) + bf16_to_f32(d[5]));
        uint16_t clast = f32_to_bf16(bf16_to_f32(c[n - 1]) + bf16_to_f32(d[n - 1]));
        CHECK(zero_accumulate(a, b, ZERO_F32, n) == ZERO_OK &&
                  zero_accumulate(c, d, ZERO_BF16, n) == ZERO_OK,
              "large status");
        CHECK(a[5] == a5 && a[n - 1] == alast && c[5] == c5 && c[n - 1] == clast,
              "large sums");
    }
    free(a);
    free(b);
    free(c);
    free(d);
    CHECK(zero_accumulate(NULL, src, ZERO_BF16, 1) == ZERO_ERR_INVALID_ARGUMENT,
          "no dst");
    CHECK(zero_accumulate(dst, src, (zero_dtype)99, 1) == ZERO_ERR_UNSUPPORTED_DTYPE,
          "bad dtype");
    CHECK(zero_accumulate(NULL, NULL, ZERO_F32, 0) == ZERO_OK, "n 0");
}

/* Every SIMD path against the element definition, over lengths that
 * leave tails, with ties, infinities and NaN among the values. */
static void test_accumulate_paths(void)
{
    enum { N = 517 };
    static uint16_t d16[N], s16[N], want16[N];
    static float d32[N], s32[N], want32[N];
    const float specials[] = {1.0f, 0.00390625f, INFINITY, -INFINITY, NAN,
                              65504.0f, 1e-8f, -0.0f};
    for (int isa = 0; isa < ZERO_ISA_COUNT; isa++) {
        if (!zero_isa_supported((zero_isa)isa)) {
            continue;
        }
        for (int dt = 0; dt < 3; dt++) {
            zero_dtype dtype = dt == 0 ? ZERO_F32 : dt == 1 ? ZERO_BF16 : ZERO_F16;
            for (int64_t n = 0; n <= N; n += 47) {
                srand((unsigned)(n + 101 * dt));
                for (int64_t i = 0; i < n; i++) {
                    float a = (i % 11 == 0) ? specials[i % 8]
                                            : (float)(rand() % 20001 - 10000) / 613.0f;
                    float b = (i % 13 == 0) ? specials[(i / 13) % 8]
                                            : (float)(rand() % 20001 - 10000) / 389.0f;
                    d32[i] = a;
                    s32[i] = b;
                    d16[i] = dtype == ZERO_BF16 ? f32_to_bf16(a) : f32_to_f16(a);
                    s16[i] = dtype == ZERO_BF16 ? f32_to_bf16(b) : f32_to_f16(b);
                    want32[i] = a + b;
                    want16[i] = dtype == ZERO_BF16
                                    ? f32_to_bf16(bf16_to_f32(d16[i]) + bf16_to_f32(s16[i]))
                                    : f32_to_f16(f16_to_f32(d16[i]) + f16_to_f32(s16[i]));
                }
                zero_isa_set((zero_isa)isa);
                zero_status st = dtype == ZERO_F32 ? zero_accumulate(d32, s32, dtype, n)
                                                   : zero_accumulate(d16, s16, dtype, n);
                zero_isa_set(ZERO_ISA_SCALAR);
                int same = st == ZERO_OK;
                for (int64_t i = 0; i < n && same; i++) {
                    if (dtype == ZERO_F32) {
                        same = memcmp(&d32[i], &want32[i], 4) == 0 ||
                               (isnan(d32[i]) && isnan(want32[i]));
                    } else {
                        same = d16[i] == want16[i];
                    }
                }
                CHECK(same, "accumulate %s dtype %d n %lld differs from the definition",
                      zero_isa_name((zero_isa)isa), dt, (long long)n);
            }
        }
    }
}

int main(void)
{
    test_known_layout();
    test_order_all_expected();
    test_order_unexpected();
    test_random_plans();
    test_bad_plans();
    test_accumulate();
    test_accumulate_paths();
    printf("test_buckets: %d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
