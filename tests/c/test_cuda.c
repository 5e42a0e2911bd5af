/* test_cuda.c: the CUDA path's host code without a GPU, under
 * AddressSanitizer and UBSan (make test-c): the planning of multi-tensor
 * launches, argument checks, and the driver loader's failure paths (a
 * missing library, a library that is not a driver, no embedded kernels),
 * each of which must end in a status and a message, never a crash.
 *
 * Given the emulated driver's path (tests/emulated_cuda) as its argument,
 * it then launches through it: every argument block the launcher packs
 * runs the kernels' source on host memory, checked against the CPU core.
 */
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/cuda_internal.h"
#include "zero/half.h"
#include "check.h"

static int error_mentions(const char *text)
{
    return strstr(zero_cuda_error(), text) != NULL;
}

/* ---- launch planning ------------------------------------------------ */

static int64_t blocks_of(int64_t n)
{
    return (n + ZERO_K_CHUNK - 1) / ZERO_K_CHUNK;
}

/* 60 tensors of odd sizes go into launches of at most ZERO_K_TENSORS;
 * within a launch, tensor t owns blocks [first_block[t], first_block[t+1])
 * and every block maps to a chunk inside its tensor. */
static void test_map_fills_and_maps_blocks(void)
{
    zero_k_map map;
    cuda_map_reset(&map);
    CHECK(cuda_map_blocks(&map) == 0, "empty map has no blocks");
    int64_t sizes[60];
    for (int i = 0; i < 60; i++) {
        sizes[i] = 1 + (int64_t)i * 7919 % 50000 + (i % 3) * ZERO_K_CHUNK;
    }
    int added = 0;
    int64_t expected_blocks = 0;
    while (added < 60) {
        if (cuda_map_add(&map, sizes[added]) < 0) {
            break;
        }
        expected_blocks += blocks_of(sizes[added]);
        added++;
    }
    CHECK(added == ZERO_K_TENSORS, "a launch takes %d tensors, got %d",
          ZERO_K_TENSORS, added);
    CHECK(map.count == ZERO_K_TENSORS, "count %d", map.count);
    CHECK(cuda_map_blocks(&map) == expected_blocks, "blocks %lld vs %lld",
          (long long)cuda_map_blocks(&map), (long long)expected_blocks);
    for (int t = 0; t < map.count; t++) {
        int64_t owned = map.first_block[t + 1] - map.first_block[t];
        CHECK(owned == blocks_of(sizes[t]), "tensor %d owns %lld blocks", t,
              (long long)owned);
        CHECK(map.numel[t] == sizes[t], "tensor %d numel", t);
        /* the last chunk ends at the tensor's end, not past it */
        int64_t last_begin = (owned - 1) * ZERO_K_CHUNK;
        CHECK(last_begin < sizes[t] && sizes[t] <= last_begin + ZERO_K_CHUNK,
              "tensor %d last chunk", t);
    }
    cuda_map_reset(&map);
    CHECK(cuda_map_add(&map, sizes[added]) == 0, "a reset map starts over");
}

static void test_map_refuses_a_grid_too_large(void)
{
    zero_k_map map;
    cuda_map_reset(&map);
    int64_t too_many = ((int64_t)INT32_MAX + 1) * ZERO_K_CHUNK;
    CHECK(cuda_map_add(&map, too_many) == -1, "past INT32_MAX blocks");
    CHECK(cuda_map_add(&map, (int64_t)INT32_MAX * ZERO_K_CHUNK) == 0,
          "exactly INT32_MAX blocks fit");
    CHECK(cuda_map_add(&map, 1) == -1, "and nothing more");
}

static void test_norm_partials_count_chunks(void)
{
    int64_t sizes[] = {1, ZERO_K_CHUNK, ZERO_K_CHUNK + 1, 0, 1000003};
    int64_t want = 1 + 1 + 2 + 0 + blocks_of(1000003);
    CHECK(zero_cuda_norm_partials(sizes, 5) == want, "partials %lld",
          (long long)zero_cuda_norm_partials(sizes, 5));
    CHECK(zero_cuda_norm_partials(sizes, 0) == 0, "no tensors");
}

/* ---- argument checks (before any driver call) ------------------------ */

static float fake_device_memory[64];

static zero_cuda_adam_tensor adam_tensor(int64_t n)
{
    zero_cuda_adam_tensor t = {fake_device_memory, fake_device_memory + 16,
                               fake_device_memory + 32,
                               fake_device_memory + 48, NULL, ZERO_F32,
                               ZERO_F32, n};
    return t;
}

static zero_adam_hparams adam_hparams(void)
{
    zero_adam_hparams hp = {1e-3, 0.9, 0.999, 1e-8, 0.01, 1, 0, 1, 1.0};
    return hp;
}

static void test_bad_arguments_are_refused_first(void)
{
    zero_cuda_where where = {0, 0};
    zero_cuda_adam_tensor t = adam_tensor(16);
    zero_adam_hparams hp = adam_hparams();
    float *step = fake_device_memory;
    CHECK(zero_cuda_adam_step(&where, &t, -1, &hp, step, NULL) ==
              ZERO_ERR_INVALID_ARGUMENT,
          "negative count");
    CHECK(zero_cuda_adam_step(&where, &t, 1, &hp, NULL, NULL) ==
              ZERO_ERR_INVALID_ARGUMENT,
          "no step");
    hp.amsgrad = 1;
    CHECK(zero_cuda_adam_step(&where, &t, 1, &hp, step, NULL) ==
              ZERO_ERR_INVALID_ARGUMENT &&
              error_mentions("amsgrad"),
          "amsgrad: %s", zero_cuda_error());
    hp.amsgrad = 0;
    t.grad = NULL;
    CHECK(zero_cuda_adam_step(&where, &t, 1, &hp, step, NULL) ==
              ZERO_ERR_INVALID_ARGUMENT && error_mentions("tensor 0"),
          "NULL grad: %s", zero_cuda_error());
    zero_cuda_span span = {fake_device_memory, (zero_dtype)7, 4};
    float out;
    CHECK(zero_cuda_l2_norm(&where, &span, 1, &out, &out, 0) ==
              ZERO_ERR_INVALID_ARGUMENT,
          "bad dtype");
    span.dtype = ZERO_BF16;
    CHECK(zero_cuda_unscale_check(&where, &span, 1, 1.0f, NULL) ==
              ZERO_ERR_INVALID_ARGUMENT,
          "no found_inf");
    zero_cuda_copy copy = {NULL, fake_device_memory, ZERO_F32, ZERO_F32, 4};
    CHECK(zero_cuda_cast_copy(&where, &copy, 1, 1.0f) ==
              ZERO_ERR_INVALID_ARGUMENT,
          "NULL dst");
    CHECK(zero_cuda_driver_version() == 0, "no driver was loaded");
}

/* ---- the loader's failure paths -------------------------------------- */

static const unsigned char not_a_fatbin[16] = "not a fatbin";

/* Every entry point answers UNAVAILABLE with the same reason, again and
 * again, and nothing touches the (fake) device memory. */
static void expect_unavailable_everywhere(const char *reason)
{
    zero_cuda_where where = {0, 0};
    zero_cuda_adam_tensor t = adam_tensor(16);
    zero_adam_hparams hp = adam_hparams();
    zero_cuda_span span = {fake_device_memory, ZERO_F32, 16};
    zero_cuda_copy copy = {fake_device_memory, fake_device_memory + 16,
                           ZERO_F32, ZERO_F32, 16};
    float *step = fake_device_memory;
    memset(fake_device_memory, 0, sizeof fake_device_memory);
    zero_status got[6] = {
        zero_cuda_probe(),
        zero_cuda_probe(),
        zero_cuda_adam_step(&where, &t, 1, &hp, step, NULL),
        zero_cuda_l2_norm(&where, &span, 1, fake_device_memory + 32,
                          fake_device_memory + 48, 0),
        zero_cuda_unscale_check(&where, &span, 1, 0.5f, step),
        zero_cuda_cast_copy(&where, &copy, 1, 1.0f),
    };
    for (int i = 0; i < 6; i++) {
        CHECK(got[i] == ZERO_ERR_CUDA_UNAVAILABLE, "call %d: status %d", i,
              (int)got[i]);
    }
    CHECK(error_mentions(reason), "'%s' not in '%s'", reason,
          zero_cuda_error());
    int untouched = 1;
    for (int i = 0; i < 64; i++) {
        untouched = untouched && fake_device_memory[i] == 0.0f;
    }
    CHECK(untouched, "memory was written");
    CHECK(zero_cuda_driver_version() == 0, "no driver version");
}

static void test_loader_failures(void)
{
    zero_cuda_image none = {not_a_fatbin, 0, "",
                            "built without nvcc (test)"};
    zero_cuda_set_image(&none);
    expect_unavailable_everywhere("built without nvcc (test)");

    zero_cuda_image fake = {not_a_fatbin, sizeof not_a_fatbin, "sm_80",
                            "test image"};
    zero_cuda_set_image(&fake);
    CHECK(zero_cuda_set_library("libzero-no-such-driver.so.1") == ZERO_OK,
          "set library");
    expect_unavailable_everywhere("libzero-no-such-driver.so.1 could not be "
                                  "loaded");

    /* a real library that is not a driver: the first missing symbol is
     * named, and the library is closed again (ASan would see a leak of
     * anything else we allocated) */
    CHECK(zero_cuda_set_library("libm.so.6") == ZERO_OK, "set library");
    expect_unavailable_everywhere("libm.so.6 has no cuInit");

    char long_name[300];
    memset(long_name, 'x', sizeof long_name - 1);
    long_name[sizeof long_name - 1] = '\0';
    CHECK(zero_cuda_set_library(long_name) == ZERO_ERR_INVALID_ARGUMENT,
          "a name longer than the buffer");
    CHECK(zero_cuda_set_library(NULL) == ZERO_ERR_INVALID_ARGUMENT, "NULL");
}

/* ---- launches through the emulated driver ----------------------------- */

#define TENSORS 60

static float *random_floats(int64_t n, unsigned seed, int positive)
{
    float *x = malloc((size_t)(n > 0 ? n : 1) * sizeof *x);
    for (int64_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        float u = (float)(seed >> 8) * 0x1p-24f * 2.0f - 1.0f;
        x[i] = positive ? fabsf(u) * 0.01f : u;
    }
    return x;
}

/* 60 tensors (two launches), two steps, against zero_adam_step on the
 * scalar path: the same formula, so the same bits. */
static void test_emulated_adam(void)
{
    zero_cuda_where where = {1, 0};
    zero_cuda_adam_tensor t[TENSORS];
    float *reference[TENSORS][3];
    uint16_t *reference_copy[TENSORS];
    float step = 0.0f;
    zero_adam_hparams hp = adam_hparams();
    zero_isa_set(ZERO_ISA_SCALAR);
    for (int i = 0; i < TENSORS; i++) {
        int64_t n = i == 7 ? 0 : 1 + (int64_t)i * 7919 % 40000;
        t[i] = (zero_cuda_adam_tensor){
            random_floats(n, i, 0), random_floats(n, 100 + i, 0),
            random_floats(n, 200 + i, 0), random_floats(n, 300 + i, 1),
            i % 2 ? calloc((size_t)n + 1, 2) : NULL, ZERO_F32,
            i % 4 == 1 ? ZERO_F16 : ZERO_BF16, n};
        reference_copy[i] = i % 2 ? calloc((size_t)n + 1, 2) : NULL;
        for (int k = 0; k < 3; k++) {
            reference[i][k] = malloc((size_t)(n + 1) * sizeof(float));
        }
        memcpy(reference[i][0], t[i].param, (size_t)n * sizeof(float));
        memcpy(reference[i][1], t[i].exp_avg, (size_t)n * sizeof(float));
        memcpy(reference[i][2], t[i].exp_avg_sq, (size_t)n * sizeof(float));
    }
    for (int s = 1; s <= 2; s++) {
        zero_status status =
            zero_cuda_adam_step(&where, t, TENSORS, &hp, &step, NULL);
        CHECK(status == ZERO_OK, "emulated adam: %s", zero_cuda_error());
        for (int i = 0; i < TENSORS; i++) {
            zero_flat flat = {reference[i][0], t[i].grad, ZERO_F32,
                              reference_copy[i], t[i].copy_dtype, t[i].n};
            zero_adam_state state = {reference[i][1], reference[i][2], NULL};
            hp.step = s;
            zero_adam_step(&flat, &state, &hp);
        }
    }
    CHECK(step == 2.0f, "step %g", (double)step);
    for (int i = 0; i < TENSORS; i++) {
        size_t bytes = (size_t)t[i].n * sizeof(float);
        CHECK(!memcmp(t[i].param, reference[i][0], bytes) &&
                  !memcmp(t[i].exp_avg, reference[i][1], bytes) &&
                  !memcmp(t[i].exp_avg_sq, reference[i][2], bytes),
              "tensor %d differs from the CPU step", i);
        CHECK(!t[i].copy_out ||
                  !memcmp(t[i].copy_out, reference_copy[i], bytes / 2),
              "tensor %d copy-out", i);
        free(t[i].param);
        free((void *)t[i].grad);
        free(t[i].exp_avg);
        free(t[i].exp_avg_sq);
        free(t[i].copy_out);
        free(reference_copy[i]);
        for (int k = 0; k < 3; k++) {
            free(reference[i][k]);
        }
    }
}

static void test_emulated_norm_unscale_cast(void)
{
    zero_cuda_where where = {0, 0};
    zero_cuda_span spans[TENSORS];
    int64_t numel[TENSORS];
    double want = 0.0;
    for (int i = 0; i < TENSORS; i++) {
        numel[i] = 1 + (int64_t)i * 104729 % 30000;
        spans[i] = (zero_cuda_span){random_floats(numel[i], 7 * i, 0),
                                    ZERO_F32, numel[i]};
        for (int64_t j = 0; j < numel[i]; j++) {
            double x = ((float *)spans[i].data)[j];
            want += x * x;
        }
    }
    int64_t chunks = zero_cuda_norm_partials(numel, TENSORS);
    float *partials = malloc((size_t)chunks * sizeof *partials);
    float norm = 0.0f, found_inf = 0.0f;
    CHECK(zero_cuda_l2_norm(&where, spans, TENSORS, partials, &norm, 0) ==
              ZERO_OK,
          "norm: %s", zero_cuda_error());
    CHECK(fabs(norm - sqrt(want)) <= 1e-6 * sqrt(want), "norm %g vs %g",
          (double)norm, sqrt(want));
    float *last = spans[TENSORS - 1].data;
    float kept = last[3];
    CHECK(zero_cuda_unscale_check(&where, spans, TENSORS, 0.5f, &found_inf) ==
                  ZERO_OK &&
              found_inf == 0.0f && last[3] == kept * 0.5f,
          "unscale");
    last[3] = INFINITY;
    zero_cuda_unscale_check(&where, spans, TENSORS, 1.0f, &found_inf);
    CHECK(found_inf == 1.0f, "inf found");
    uint16_t *bucket = calloc(64, 2);
    zero_cuda_copy copy = {bucket + 5, last, ZERO_BF16, ZERO_F32, 3};
    CHECK(zero_cuda_cast_copy(&where, &copy, 1, 2.0f) == ZERO_OK &&
              bucket[4] == 0 && bucket[5] == f32_to_bf16(last[0] * 2.0f) &&
              bucket[8] == 0,
          "cast into a bucket slice");
    free(bucket);
    free(partials);
    for (int i = 0; i < TENSORS; i++) {
        free(spans[i].data);
    }
}

static void test_emulated_driver(const char *path)
{
    zero_cuda_image fake = {not_a_fatbin, sizeof not_a_fatbin, "sm_80",
                            "test image"};
    zero_cuda_set_image(&fake);
    CHECK(zero_cuda_set_library(path) == ZERO_OK, "set library");
    CHECK(zero_cuda_probe() == ZERO_OK, "probe: %s", zero_cuda_error());
    CHECK(zero_cuda_driver_version() == 13000, "driver version");
    test_emulated_adam();
    test_emulated_norm_unscale_cast();

    /* a stream of another device, a device that does not exist */
    zero_cuda_span span = {fake_device_memory, ZERO_F32, 4};
    zero_cuda_where bad_stream = {0, 0xbad0}, no_device = {5, 0};
    CHECK(zero_cuda_unscale_check(&bad_stream, &span, 1, 1.0f,
                                  fake_device_memory + 8) ==
                  ZERO_ERR_INVALID_ARGUMENT &&
              error_mentions("belongs to another context"),
          "stream check: %s", zero_cuda_error());
    CHECK(zero_cuda_unscale_check(&no_device, &span, 1, 1.0f,
                                  fake_device_memory + 8) ==
                  ZERO_ERR_INVALID_ARGUMENT &&
              error_mentions("CUDA device 5 does not exist"),
          "device check: %s", zero_cuda_error());
    CHECK(zero_cuda_set_library("other.so") == ZERO_ERR_INVALID_ARGUMENT,
          "the loaded driver stays");

    /* every call popped what it pushed; each device retained once */
    void *driver = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    CHECK(driver != NULL, "the emulated driver is loaded");
    if (driver) {
        int (*depth)(void), (*retained)(int);
        void *symbol = dlsym(driver, "fake_cuda_context_depth");
        memcpy(&depth, &symbol, sizeof symbol);
        symbol = dlsym(driver, "fake_cuda_retained");
        memcpy(&retained, &symbol, sizeof symbol);
        CHECK(depth() == 0, "contexts left pushed");
        CHECK(retained(0) == 1 && retained(1) == 1, "retains");
        dlclose(driver);
    }
}

int main(int argc, char **argv)
{
    test_map_fills_and_maps_blocks();
    test_map_refuses_a_grid_too_large();
    test_norm_partials_count_chunks();
    test_bad_arguments_are_refused_first();
    test_loader_failures();
    if (argc > 1) {
        test_emulated_driver(argv[1]);
    }
    printf("test_cuda: %d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
