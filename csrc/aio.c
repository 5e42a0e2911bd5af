/* aio.c: the async disk I/O engine's requests and its thread backend.
 *
 * The offloaded step (python/zero/offload/_nvme.py) reads the next chunk of
 * every state file and writes the previous one back while the C core
 * updates the current one. This engine moves those bytes without the GIL
 * and without Python threads: requests go into slots, are cut into blocks
 * ([Note: aio blocks] in aio_internal.h), and a backend moves the blocks,
 * at most queue_depth at a time. The thread backend (here) is always
 * available: queue_depth workers each move one block with pread/pwrite. The
 * io_uring backend (aio_uring.c) keeps the same blocks in a ring instead.
 *
 * [Note: aio fork] A forked child has none of its parent's threads, and its
 * copy of the lock may be held. Destroying an engine in a child therefore
 * frees it without joining threads, taking the lock or destroying the
 * conditions (their waiters are the parent's); the child's own
 * engines start their own threads. Submitting to or waiting on the
 * parent's engine in a child is refused (ZERO_ERR_INVALID_ARGUMENT): no
 * worker would take the request (the wait never ended), and io_uring's
 * shared rings handed the completion to the parent's reaper.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "aio_internal.h"

/* ---- the test build's fault hook -------------------------------------- */

#ifdef ZERO_AIO_FAULTS
static zero_aio_fault_fn fault_hook;

void zero_aio_set_fault(zero_aio_fault_fn fn)
{
    __atomic_store_n(&fault_hook, fn, __ATOMIC_RELEASE);
}
#endif

int64_t aio_observed(const aio_block *b, int64_t result)
{
#ifdef ZERO_AIO_FAULTS
    zero_aio_fault_fn fn = __atomic_load_n(&fault_hook, __ATOMIC_ACQUIRE);
    if (fn) {
        return fn(b->write, b->offset + b->done, b->length - b->done, result);
    }
#else
    (void)b;
#endif
    return result;
}

/* ---- requests and blocks ---------------------------------------------- */

const char *zero_aio_backend_name(zero_aio_backend backend)
{
    switch (backend) {
    case ZERO_AIO_AUTO:
        return "auto";
    case ZERO_AIO_THREADS:
        return "threads";
    case ZERO_AIO_URING:
        return "io_uring";
    }
    return "unknown";
}

zero_aio_backend zero_aio_backend_of(const zero_aio *aio)
{
    return aio->backend;
}

int aio_has_pending(const zero_aio *a)
{
    return a->pending_head >= 0;
}

/* A request with nothing left to hand out and nothing in flight is done. */
static void settle(zero_aio *a, aio_slot *s)
{
    if (s->handed_out == s->r.length && s->in_flight == 0 &&
        s->state == REQUEST_ACTIVE) {
        s->state = REQUEST_DONE;
        pthread_cond_broadcast(&a->done);
    }
}

static void pop_pending(zero_aio *a)
{
    int head = a->pending_head;
    a->pending_head = a->slots[head].next;
    if (a->pending_head < 0) {
        a->pending_tail = -1;
    }
    a->slots[head].next = -1;
}

int aio_take_block(zero_aio *a, aio_block *b)
{
    while (a->pending_head >= 0) {
        int index = a->pending_head;
        aio_slot *s = &a->slots[index];
        if (s->result.error != 0) {
            /* a failed request's remaining blocks are not started */
            s->handed_out = s->r.length;
            pop_pending(a);
            settle(a, s);
            continue;
        }
        int64_t left = s->r.length - s->handed_out;
        int64_t length = left < a->block_size ? left : a->block_size;
        b->slot = index;
        b->fd = s->r.fd;
        b->write = s->r.write;
        b->buf = (char *)s->r.buf + s->handed_out;
        b->offset = s->r.offset + s->handed_out;
        b->length = length;
        b->done = 0;
        s->handed_out += length;
        s->in_flight++;
        if (s->handed_out == s->r.length) {
            pop_pending(a);
        }
        return 1;
    }
    return 0;
}

void aio_finish_block(zero_aio *a, const aio_block *b, int error)
{
    aio_slot *s = &a->slots[b->slot];
    s->result.moved += b->done;
    int64_t at = b->offset + b->done;
    /* the lowest failing offset, whatever order the blocks ended in */
    if (error != 0 &&
        (s->result.error == 0 || at < s->result.error_offset)) {
        s->result.error = error;
        s->result.error_offset = at;
    }
    s->in_flight--;
    settle(a, s);
}

/* A free slot's index, growing the table when none is left; -1 when out of
 * memory. Blocks name slots by index, so growing may move them. */
static int take_slot(zero_aio *a)
{
    if (a->free_head < 0) {
        int grown = a->capacity ? 2 * a->capacity : 64;
        if (grown > (1 << 24)) {
            return -1; /* ids keep the index in 24 bits */
        }
        aio_slot *slots = realloc(a->slots, (size_t)grown * sizeof *slots);
        if (!slots) {
            return -1;
        }
        memset(slots + a->capacity, 0,
               (size_t)(grown - a->capacity) * sizeof *slots);
        for (int i = grown - 1; i >= a->capacity; i--) {
            slots[i].next = a->free_head;
            a->free_head = i;
        }
        a->slots = slots;
        a->capacity = grown;
    }
    int index = a->free_head;
    a->free_head = a->slots[index].next;
    a->slots[index].next = -1;
    return index;
}

static int64_t id_of(const zero_aio *a, int index)
{
    return ((int64_t)a->slots[index].generation << 24) | index;
}

/* The slot that id names, or NULL when it names none in use. */
static aio_slot *slot_of(zero_aio *a, int64_t id)
{
    if (id < 0) {
        return NULL;
    }
    int64_t index = id & ((1 << 24) - 1);
    if (index >= a->capacity) {
        return NULL;
    }
    aio_slot *s = &a->slots[index];
    if (s->state == REQUEST_FREE || (int64_t)s->generation != (id >> 24)) {
        return NULL;
    }
    return s;
}

/* ---- the thread backend ----------------------------------------------- */

/* Move all of b, resuming short transfers: 0, an errno or
 * ZERO_AIO_END_OF_FILE. Called without the lock. */
static int move_block(aio_block *b)
{
    while (b->done < b->length) {
        char *at = b->buf + b->done;
        size_t count = (size_t)(b->length - b->done);
        off_t offset = (off_t)(b->offset + b->done);
        ssize_t n = b->write ? pwrite(b->fd, at, count, offset)
                             : pread(b->fd, at, count, offset);
        int64_t seen = aio_observed(b, n < 0 ? -(int64_t)errno : n);
        if (seen < 0) {
            if (seen == -EINTR || seen == -EAGAIN) {
                continue;
            }
            return (int)-seen;
        }
        if (seen == 0) {
            return ZERO_AIO_END_OF_FILE;
        }
        b->done += seen;
    }
    return 0;
}

static void *worker(void *arg)
{
    zero_aio *a = arg;
    pthread_mutex_lock(&a->lock);
    for (;;) {
        aio_block b;
        if (!aio_take_block(a, &b)) {
            if (a->shutdown) {
                break;
            }
            pthread_cond_wait(&a->work, &a->lock);
            continue;
        }
        pthread_mutex_unlock(&a->lock);
        int error = move_block(&b);
        pthread_mutex_lock(&a->lock);
        aio_finish_block(a, &b, error);
    }
    pthread_mutex_unlock(&a->lock);
    return NULL;
}

int aio_start_thread(pthread_t *thread, void *(*fn)(void *), void *arg)
{
    /* the engine's threads take none of the process's signals: Python
     * handles them on its main thread, and the I/O need not see EINTR */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int error = pthread_create(thread, NULL, fn, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return error;
}

/* Start the workers; 0 or ZERO_ERR_THREADS (the ones started are joined). */
static zero_status start_threads(zero_aio *a)
{
    a->threads = calloc((size_t)a->queue_depth, sizeof *a->threads);
    if (!a->threads) {
        return ZERO_ERR_OUT_OF_MEMORY;
    }
    for (int i = 0; i < a->queue_depth; i++) {
        if (aio_start_thread(&a->threads[i], worker, a) != 0) {
            pthread_mutex_lock(&a->lock);
            a->shutdown = 1;
            pthread_cond_broadcast(&a->work);
            pthread_mutex_unlock(&a->lock);
            for (int j = 0; j < i; j++) {
                pthread_join(a->threads[j], NULL);
            }
            return ZERO_ERR_THREADS;
        }
        a->nthreads = i + 1;
    }
    return ZERO_OK;
}

/* ---- the engine ------------------------------------------------------- */

int zero_aio_uring_probe(void)
{
    return uring_probe();
}

/* ZERO_AIO_AUTO's choice: the environment's, else io_uring. */
static zero_aio_backend preferred(void)
{
    const char *env = getenv(ZERO_AIO_ENV);
    if (env && strcmp(env, "threads") == 0) {
        return ZERO_AIO_THREADS;
    }
    return ZERO_AIO_URING;
}

static void free_engine(zero_aio *a)
{
    /* in a forked child the conditions still count the parent's waiting
     * workers, and glibc's pthread_cond_destroy waits for them forever
     * ([Note: aio fork]): the memory goes without the destroys there */
    if (getpid() == a->pid) {
        pthread_cond_destroy(&a->done);
        pthread_cond_destroy(&a->work);
        pthread_mutex_destroy(&a->lock);
    }
    free(a->threads);
    free(a->slots);
    free(a);
}

zero_status zero_aio_create(zero_aio **out, zero_aio_backend backend,
                            int queue_depth, int64_t block_size)
{
    if (!out || queue_depth < 1 || queue_depth > ZERO_AIO_MAX_QUEUE_DEPTH ||
        block_size < ZERO_AIO_ALIGN || block_size > ZERO_AIO_MAX_BLOCK ||
        block_size % ZERO_AIO_ALIGN != 0 ||
        (backend != ZERO_AIO_AUTO && backend != ZERO_AIO_THREADS &&
         backend != ZERO_AIO_URING)) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    *out = NULL;
    zero_aio *a = calloc(1, sizeof *a);
    if (!a) {
        return ZERO_ERR_OUT_OF_MEMORY;
    }
    a->queue_depth = queue_depth;
    a->block_size = block_size;
    a->pid = getpid();
    a->free_head = a->pending_head = a->pending_tail = -1;
    pthread_mutex_init(&a->lock, NULL);
    pthread_cond_init(&a->work, NULL);
    /* waits measure their timeout on the monotonic clock */
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&a->done, &attr);
    pthread_condattr_destroy(&attr);

    zero_aio_backend want =
        backend == ZERO_AIO_AUTO ? preferred() : backend;
    if (want == ZERO_AIO_URING) {
        a->backend = ZERO_AIO_URING;
        if (uring_start(a) == 0) {
            *out = a;
            return ZERO_OK;
        }
        if (backend == ZERO_AIO_URING) {
            free_engine(a);
            return ZERO_ERR_UNAVAILABLE;
        }
    }
    a->backend = ZERO_AIO_THREADS;
    zero_status status = start_threads(a);
    if (status != ZERO_OK) {
        free_engine(a);
        return status;
    }
    *out = a;
    return ZERO_OK;
}

void zero_aio_destroy(zero_aio *a)
{
    if (!a) {
        return;
    }
    if (getpid() != a->pid) { /* [Note: aio fork] */
        if (a->backend == ZERO_AIO_URING) {
            a->nthreads = 0; /* the reaper is the parent's */
            uring_stop(a);
        }
        free_engine(a);
        return;
    }
    /* the backends finish what is pending before they stop */
    pthread_mutex_lock(&a->lock);
    a->shutdown = 1;
    pthread_cond_broadcast(&a->work);
    pthread_mutex_unlock(&a->lock);
    if (a->backend == ZERO_AIO_URING) {
        uring_stop(a);
    } else {
        for (int i = 0; i < a->nthreads; i++) {
            pthread_join(a->threads[i], NULL);
        }
    }
    free_engine(a);
}

zero_status zero_aio_submit(zero_aio *a, const zero_aio_request *request,
                            int64_t *id)
{
    if (!a || getpid() != a->pid || !request || !id || request->fd < 0 ||
        request->length < 0 ||
        request->offset < 0 || (request->length > 0 && !request->buf) ||
        request->length > INT64_MAX - request->offset) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    pthread_mutex_lock(&a->lock);
    if (a->shutdown) {
        pthread_mutex_unlock(&a->lock);
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    int index = take_slot(a);
    if (index < 0) {
        pthread_mutex_unlock(&a->lock);
        return ZERO_ERR_OUT_OF_MEMORY;
    }
    aio_slot *s = &a->slots[index];
    s->r = *request;
    s->r.write = request->write != 0;
    s->handed_out = 0;
    s->in_flight = 0;
    memset(&s->result, 0, sizeof s->result);
    s->state = REQUEST_ACTIVE;
    *id = id_of(a, index);
    if (request->length == 0) {
        s->state = REQUEST_DONE;
    } else {
        if (a->pending_tail >= 0) {
            a->slots[a->pending_tail].next = index;
        } else {
            a->pending_head = index;
        }
        a->pending_tail = index;
        if (a->backend == ZERO_AIO_URING) {
            uring_kick(a);
        } else {
            pthread_cond_broadcast(&a->work);
        }
    }
    pthread_mutex_unlock(&a->lock);
    return ZERO_OK;
}

/* now + ms on the monotonic clock */
static struct timespec deadline_after(int ms)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    t.tv_sec += ms / 1000;
    t.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    return t;
}

zero_status zero_aio_wait(zero_aio *a, int64_t id, int timeout_ms,
                          zero_aio_result *result)
{
    if (!a || !result || getpid() != a->pid) { /* [Note: aio fork] */
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    struct timespec deadline = deadline_after(timeout_ms > 0 ? timeout_ms : 0);
    pthread_mutex_lock(&a->lock);
    aio_slot *s = slot_of(a, id);
    while (s && s->state == REQUEST_ACTIVE) {
        if (timeout_ms < 0) {
            pthread_cond_wait(&a->done, &a->lock);
        } else if (pthread_cond_timedwait(&a->done, &a->lock, &deadline) ==
                   ETIMEDOUT) {
            pthread_mutex_unlock(&a->lock);
            return ZERO_ERR_TIMEOUT;
        }
        s = slot_of(a, id); /* another waiter may have taken it */
    }
    if (!s) {
        pthread_mutex_unlock(&a->lock);
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    *result = s->result;
    int index = (int)(s - a->slots);
    s->state = REQUEST_FREE;
    s->generation = (s->generation + 1) & 0x7fffffffu;
    s->next = a->free_head;
    a->free_head = index;
    pthread_mutex_unlock(&a->lock);
    return result->error == 0 ? ZERO_OK : ZERO_ERR_IO;
}
