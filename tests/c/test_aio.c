/* test_aio.c: tests of the async disk I/O engine (csrc/aio.c,
 * csrc/aio_uring.c) without Python, on every backend this kernel runs,
 * under AddressSanitizer/UBSan and ThreadSanitizer (make test-c).
 *
 * Built with -DZERO_AIO_FAULTS, which compiles the engine's fault hook in:
 * a transfer's result passes through fault() below, which can shorten it
 * or turn it into ENOSPC, EIO or EINTR, so short transfers and failures
 * are tested without a failing disk. Data written is read back through a
 * separate plain pread and compared byte for byte with what was written.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/wait.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../../csrc/aio_internal.h"
#include "check.h"

#define BLOCK 8192

static uint64_t rng_state = 0x2545f4914f6cdd1dull;

static uint8_t next_byte(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint8_t)((rng_state * 0x2545f4914f6cdd1dull) >> 56);
}

static void fill_random(uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        p[i] = next_byte();
    }
}

/* An unlinked temporary file of `size` zero bytes; flags may add
 * O_DIRECT. -1 when it cannot be opened that way. */
static int temp_file(int64_t size, int flags)
{
    const char *dir = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    char path[4096];
    snprintf(path, sizeof path, "%s/zero-test-aio-XXXXXX", dir);
    int fd = mkstemp(path);
    if (fd < 0) {
        return -1;
    }
    int ok = ftruncate(fd, size) == 0;
    if (ok && flags) {
        int direct = open(path, O_RDWR | flags);
        close(fd);
        fd = direct;
    }
    unlink(path);
    if (!ok && fd >= 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

/* ---- the fault hook --------------------------------------------------- */

enum { NONE, SHORT, ENOSPC_WRITES, EIO_READS, EINTR_SOME, SLOW, HELD };
/* HELD: while this is 1 every transfer reports EAGAIN (taken again), so
 * a request cannot finish before the test lets it, however long the
 * machine's load delays the test. (A hook that slept instead raced: the
 * io_uring reaper runs it holding the engine's lock, so a wait's timeout
 * could only return after the request had finished; and one that blocked
 * would deadlock there.) */
static int held;
static int fault_mode;
static int64_t fault_from;   /* the first failing offset */
static int fault_count;      /* transfers the hook changed */
static pthread_mutex_t fault_lock = PTHREAD_MUTEX_INITIALIZER;

static void count_fault(void)
{
    pthread_mutex_lock(&fault_lock);
    fault_count++;
    pthread_mutex_unlock(&fault_lock);
}

static int64_t fault(int write, int64_t offset, int64_t length,
                     int64_t result)
{
    (void)length;
    switch (fault_mode) {
    case SHORT:
        /* report a third (at least one byte): the rest must be moved again */
        if (result > 3) {
            count_fault();
            return result / 3;
        }
        return result;
    case ENOSPC_WRITES:
        if (write && offset + length > fault_from) {
            count_fault();
            return -ENOSPC;
        }
        return result;
    case EIO_READS:
        if (!write && offset + length > fault_from) {
            count_fault();
            return -EIO;
        }
        return result;
    case EINTR_SOME: {
        /* every third transfer is interrupted: it must be taken again */
        pthread_mutex_lock(&fault_lock);
        int interrupt = fault_count % 3 == 0 && fault_count < 3000;
        fault_count++;
        pthread_mutex_unlock(&fault_lock);
        return interrupt ? -EINTR : result;
    }
    case SLOW: {
        struct timespec t = {0, 50 * 1000000L};
        nanosleep(&t, NULL);
        return result;
    }
    case HELD: {
        if (__atomic_load_n(&held, __ATOMIC_ACQUIRE)) {
            struct timespec t = {0, 100000L}; /* not a busy loop */
            nanosleep(&t, NULL);
            return -EAGAIN;
        }
        return result;
    }
    default:
        return result;
    }
}

static void set_faults(int mode, int64_t from)
{
    fault_mode = mode;
    fault_from = from;
    fault_count = 0;
    zero_aio_set_fault(mode == NONE ? NULL : fault);
}

/* ---- helpers ---------------------------------------------------------- */

static zero_aio *engine(zero_aio_backend backend, int depth)
{
    zero_aio *a = NULL;
    zero_status s = zero_aio_create(&a, backend, depth, BLOCK);
    CHECK(s == ZERO_OK && a, "create %s depth %d: %s",
          zero_aio_backend_name(backend), depth, zero_status_string(s));
    CHECK(a && zero_aio_backend_of(a) == backend, "backend %s",
          zero_aio_backend_name(backend));
    return a;
}

static zero_status one(zero_aio *a, int fd, void *buf, int64_t length,
                       int64_t offset, int write, zero_aio_result *result)
{
    zero_aio_request r = {fd, buf, length, offset, write};
    int64_t id;
    zero_status s = zero_aio_submit(a, &r, &id);
    if (s != ZERO_OK) {
        return s;
    }
    return zero_aio_wait(a, id, -1, result);
}

/* The file's bytes [offset, offset + n) equal want. */
static int file_equals(int fd, const uint8_t *want, int64_t n, int64_t offset)
{
    uint8_t *got = malloc((size_t)n);
    ssize_t read_back = pread(fd, got, (size_t)n, offset);
    int same = read_back == n && memcmp(got, want, (size_t)n) == 0;
    free(got);
    return same;
}

/* ---- tests ------------------------------------------------------------ */

/* Many requests of odd lengths and offsets, more than the queue holds, in
 * flight at once; written, then read back through the engine. */
static void test_round_trip(zero_aio_backend backend, int mode)
{
    enum { N = 24 };
    const int64_t piece = 3 * BLOCK + 1234; /* not a whole block */
    int fd = temp_file(N * piece, 0);
    CHECK(fd >= 0, "temp file");
    zero_aio *a = engine(backend, 4);
    uint8_t *data = malloc(N * piece), *back = calloc(N, piece);
    fill_random(data, N * piece);
    set_faults(mode, 0);
    int64_t ids[N];
    for (int i = 0; i < N; i++) { /* reverse order: offsets out of order */
        int k = N - 1 - i;
        zero_aio_request r = {fd, data + k * piece, piece, k * piece, 1};
        CHECK(zero_aio_submit(a, &r, &ids[k]) == ZERO_OK, "submit write");
    }
    for (int k = 0; k < N; k++) {
        zero_aio_result res;
        zero_status s = zero_aio_wait(a, ids[k], -1, &res);
        CHECK(s == ZERO_OK && res.error == 0 && res.moved == piece,
              "%s write %d: %s, error %d, moved %lld",
              zero_aio_backend_name(backend), k, zero_status_string(s),
              res.error, (long long)res.moved);
    }
    CHECK(file_equals(fd, data, N * piece, 0), "%s: the file holds the data",
          zero_aio_backend_name(backend));
    for (int k = 0; k < N; k++) {
        zero_aio_request r = {fd, back + k * piece, piece, k * piece, 0};
        CHECK(zero_aio_submit(a, &r, &ids[k]) == ZERO_OK, "submit read");
    }
    for (int k = 0; k < N; k++) {
        zero_aio_result res;
        CHECK(zero_aio_wait(a, ids[k], -1, &res) == ZERO_OK &&
                  res.moved == piece,
              "read %d", k);
    }
    CHECK(memcmp(data, back, N * piece) == 0, "%s: read back what was written",
          zero_aio_backend_name(backend));
    if (mode != NONE) {
        CHECK(fault_count > 0, "the hook changed some transfers (mode %d)",
              mode);
    }
    set_faults(NONE, 0);
    zero_aio_destroy(a);
    free(data);
    free(back);
    close(fd);
}

/* ENOSPC on writes past `from`, EIO on reads past it: the request fails
 * with that errno at the lowest failing block, the bytes before it are
 * moved, and the engine goes on serving other requests. */
static void test_failures(zero_aio_backend backend)
{
    const int64_t n = 10 * BLOCK, from = 6 * BLOCK + 100;
    int fd = temp_file(n, 0);
    zero_aio *a = engine(backend, 3);
    uint8_t *data = malloc(n), *back = malloc(n);
    fill_random(data, n);
    zero_aio_result res;

    set_faults(ENOSPC_WRITES, from);
    zero_status s = one(a, fd, data, n, 0, 1, &res);
    CHECK(s == ZERO_ERR_IO && res.error == ENOSPC,
          "%s: ENOSPC reported (%s, error %d)", zero_aio_backend_name(backend),
          zero_status_string(s), res.error);
    CHECK(res.error_offset == 6 * BLOCK, "ENOSPC at byte %lld, want %lld",
          (long long)res.error_offset, (long long)(6 * BLOCK));
    CHECK(res.moved <= 6 * BLOCK, "moved %lld", (long long)res.moved);
    CHECK(file_equals(fd, data, 6 * BLOCK, 0),
          "the blocks before the failure were written");

    set_faults(EIO_READS, from);
    s = one(a, fd, back, n, 0, 0, &res);
    CHECK(s == ZERO_ERR_IO && res.error == EIO && res.error_offset == 6 * BLOCK,
          "%s: EIO reported at %lld (%s, error %d)",
          zero_aio_backend_name(backend), (long long)res.error_offset,
          zero_status_string(s), res.error);

    /* a failure is the request's own: the next one succeeds */
    set_faults(NONE, 0);
    s = one(a, fd, data, n, 0, 1, &res);
    CHECK(s == ZERO_OK && res.moved == n && file_equals(fd, data, n, 0),
          "a request after failures succeeds");

    /* a read past the end of the file */
    s = one(a, fd, back, n, n - 100, 0, &res);
    CHECK(s == ZERO_ERR_IO && res.error == ZERO_AIO_END_OF_FILE &&
              res.error_offset == n && res.moved == 100,
          "%s: end of file at %lld after %lld bytes (error %d)",
          zero_aio_backend_name(backend), (long long)res.error_offset,
          (long long)res.moved, res.error);

    /* a real failure: a descriptor opened read-only cannot be written */
    char path[] = "/tmp/zero-test-aio-ro-XXXXXX";
    int rw = mkstemp(path);
    int ro = open(path, O_RDONLY);
    unlink(path);
    close(rw);
    s = one(a, ro, data, BLOCK, 0, 1, &res);
    CHECK(s == ZERO_ERR_IO && res.error == EBADF && res.error_offset == 0,
          "%s: EBADF from the kernel (error %d)",
          zero_aio_backend_name(backend), res.error);
    close(ro);

    zero_aio_destroy(a);
    free(data);
    free(back);
    close(fd);
}

/* A wait with a timeout, an id waited twice, requests never waited for. */
static void test_waits(zero_aio_backend backend)
{
    int fd = temp_file(4 * BLOCK, 0);
    zero_aio *a = engine(backend, 2);
    uint8_t *data = calloc(4, BLOCK);
    zero_aio_result res;
    __atomic_store_n(&held, 1, __ATOMIC_RELEASE);
    set_faults(HELD, 0);
    zero_aio_request r = {fd, data, 4 * BLOCK, 0, 1};
    int64_t id;
    CHECK(zero_aio_submit(a, &r, &id) == ZERO_OK, "submit");
    CHECK(zero_aio_wait(a, id, 1, &res) == ZERO_ERR_TIMEOUT,
          "a 1 ms wait on a request held back times out");
    __atomic_store_n(&held, 0, __ATOMIC_RELEASE);
    CHECK(zero_aio_wait(a, id, -1, &res) == ZERO_OK && res.moved == 4 * BLOCK,
          "then, let go, it completes");
    set_faults(SLOW, 0);
    CHECK(zero_aio_wait(a, id, -1, &res) == ZERO_ERR_INVALID_ARGUMENT,
          "an id is forgotten once waited for");
    CHECK(zero_aio_wait(a, 12345, 0, &res) == ZERO_ERR_INVALID_ARGUMENT,
          "an unknown id");
    /* left in flight: destroy waits for them (ASan sees no leak) */
    for (int i = 0; i < 3; i++) {
        CHECK(zero_aio_submit(a, &r, &id) == ZERO_OK, "submit");
    }
    zero_aio_destroy(a);
    set_faults(NONE, 0);

    a = engine(backend, 1);
    zero_aio_request empty = {fd, NULL, 0, 0, 0};
    CHECK(zero_aio_submit(a, &empty, &id) == ZERO_OK &&
              zero_aio_wait(a, id, 0, &res) == ZERO_OK && res.moved == 0,
          "a request of 0 bytes");
    zero_aio_destroy(a);
    free(data);
    close(fd);
}

/* O_DIRECT with aligned buffers, where this filesystem allows it. */
static void test_direct(zero_aio_backend backend)
{
    const int64_t n = 16 * BLOCK;
    int fd = temp_file(n, O_DIRECT);
    if (fd < 0) {
        printf("  O_DIRECT not available in $TMPDIR: skipped\n");
        return;
    }
    void *data, *back;
    CHECK(posix_memalign(&data, ZERO_AIO_ALIGN, n) == 0 &&
              posix_memalign(&back, ZERO_AIO_ALIGN, n) == 0,
          "aligned buffers");
    fill_random(data, n);
    memset(back, 0, n);
    zero_aio *a = engine(backend, 8);
    zero_aio_result res;
    CHECK(one(a, fd, data, n, 0, 1, &res) == ZERO_OK &&
              one(a, fd, back, n, 0, 0, &res) == ZERO_OK &&
              memcmp(data, back, n) == 0,
          "%s: O_DIRECT round trip", zero_aio_backend_name(backend));
    /* an unaligned offset is the kernel's EINVAL, reported per request */
    CHECK(one(a, fd, back, ZERO_AIO_ALIGN, 100, 0, &res) == ZERO_ERR_IO &&
              res.error == EINVAL,
          "%s: O_DIRECT at an unaligned offset: EINVAL (error %d)",
          zero_aio_backend_name(backend), res.error);
    zero_aio_destroy(a);
    free(data);
    free(back);
    close(fd);
}

/* Two threads submit and wait on one engine at once (for TSan). */
typedef struct {
    zero_aio *a;
    int fd;
    int64_t base;
    int ok;
} writer_arg;

static void *writer(void *p)
{
    writer_arg *w = p;
    uint8_t buf[3 * BLOCK];
    memset(buf, (int)(w->base / BLOCK) & 0xff, sizeof buf);
    w->ok = 1;
    for (int i = 0; i < 20; i++) {
        zero_aio_result res;
        w->ok &= one(w->a, w->fd, buf, sizeof buf, w->base, 1, &res) ==
                 ZERO_OK;
    }
    return NULL;
}

static void test_threads_share(zero_aio_backend backend)
{
    int fd = temp_file(12 * BLOCK, 0);
    zero_aio *a = engine(backend, 3);
    pthread_t t[2];
    writer_arg w[2] = {{a, fd, 0, 0}, {a, fd, 6 * BLOCK, 0}};
    for (int i = 0; i < 2; i++) {
        pthread_create(&t[i], NULL, writer, &w[i]);
    }
    for (int i = 0; i < 2; i++) {
        pthread_join(t[i], NULL);
        CHECK(w[i].ok, "%s: thread %d's requests", zero_aio_backend_name(backend),
              i);
    }
    zero_aio_destroy(a);
    close(fd);
}

/* A forked child may not use its parent's engine ([Note: aio fork]): its
 * submit and wait are refused (a wait never ended; io_uring's completion
 * went to the parent's reaper), and destroying the copy there is safe. The
 * parent's engine goes on working. */
static void test_fork(zero_aio_backend backend)
{
    int fd = temp_file(2 * BLOCK, 0);
    zero_aio *a = engine(backend, 2);
    uint8_t *data = calloc(2, BLOCK);
    zero_aio_request r = {fd, data, 2 * BLOCK, 0, 1};
    int64_t id;
    zero_aio_result res;
    CHECK(zero_aio_submit(a, &r, &id) == ZERO_OK &&
              zero_aio_wait(a, id, -1, &res) == ZERO_OK,
          "before the fork");
    /* in flight at the fork (or done, not yet waited for): a wait the
     * child may not make, with a timeout of 0 so a wrong answer cannot
     * hang the test (the parent's wait for it comes after) */
    int64_t pending;
    CHECK(zero_aio_submit(a, &r, &pending) == ZERO_OK, "submit before the fork");
    pid_t child = fork();
    if (child == 0) {
        int64_t child_id;
        int refused = zero_aio_submit(a, &r, &child_id) ==
                          ZERO_ERR_INVALID_ARGUMENT &&
                      zero_aio_wait(a, pending, 0, &res) ==
                          ZERO_ERR_INVALID_ARGUMENT;
        zero_aio_destroy(a);
        _exit(refused ? 0 : 1);
    }
    int status = -1;
    waitpid(child, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "%s: the child's submit and wait refused", zero_aio_backend_name(backend));
    CHECK(zero_aio_wait(a, pending, -1, &res) == ZERO_OK && res.moved == 2 * BLOCK,
          "%s: the request pending at the fork, in the parent",
          zero_aio_backend_name(backend));
    CHECK(zero_aio_submit(a, &r, &id) == ZERO_OK &&
              zero_aio_wait(a, id, -1, &res) == ZERO_OK && res.moved == 2 * BLOCK,
          "%s: the parent's engine after the fork", zero_aio_backend_name(backend));
    zero_aio_destroy(a);
    free(data);
    close(fd);
}

static void test_bad_arguments(void)
{
    zero_aio *a = NULL;
    CHECK(zero_aio_create(&a, ZERO_AIO_THREADS, 0, BLOCK) ==
              ZERO_ERR_INVALID_ARGUMENT,
          "queue depth 0");
    CHECK(zero_aio_create(&a, ZERO_AIO_THREADS, 2, 1000) ==
              ZERO_ERR_INVALID_ARGUMENT,
          "a block size not a multiple of 4096");
    CHECK(zero_aio_create(&a, (zero_aio_backend)7, 2, BLOCK) ==
              ZERO_ERR_INVALID_ARGUMENT,
          "an unknown backend");
    a = engine(ZERO_AIO_THREADS, 1);
    int64_t id;
    char byte;
    zero_aio_request r = {-1, &byte, 1, 0, 0};
    CHECK(zero_aio_submit(a, &r, &id) == ZERO_ERR_INVALID_ARGUMENT, "fd -1");
    r = (zero_aio_request){0, NULL, 1, 0, 0};
    CHECK(zero_aio_submit(a, &r, &id) == ZERO_ERR_INVALID_ARGUMENT,
          "no buffer");
    r = (zero_aio_request){0, &byte, 2, INT64_MAX - 1, 0};
    CHECK(zero_aio_submit(a, &r, &id) == ZERO_ERR_INVALID_ARGUMENT,
          "an end past INT64_MAX");
    zero_aio_destroy(a);
}

int main(void)
{
    zero_aio_backend backends[2] = {ZERO_AIO_THREADS, ZERO_AIO_URING};
    int count = 1;
    int uring = zero_aio_uring_probe();
    if (uring == 0) {
        count = 2;
    } else {
        printf("io_uring not available here (%s): the thread backend only\n",
               strerror(uring));
        zero_aio *a = NULL;
        CHECK(zero_aio_create(&a, ZERO_AIO_URING, 2, BLOCK) ==
                  ZERO_ERR_UNAVAILABLE,
              "io_uring asked for where it cannot run");
    }
    for (int i = 0; i < count; i++) {
        printf("backend %s\n", zero_aio_backend_name(backends[i]));
        test_round_trip(backends[i], NONE);
        test_round_trip(backends[i], SHORT);
        test_round_trip(backends[i], EINTR_SOME);
        test_failures(backends[i]);
        test_waits(backends[i]);
        test_direct(backends[i]);
        test_threads_share(backends[i]);
        test_fork(backends[i]);
    }
    test_bad_arguments();
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
