/* aio_uring.c: the async I/O engine's io_uring backend, through the raw
 * system calls (no liburing: nothing to install, and the three calls and
 * two rings used here are a small, stable part of the kernel's ABI).
 *
 * The ring holds up to queue_depth blocks ([Note: aio blocks]). Callers
 * put blocks in the submission ring under the engine's lock and submit
 * them at once; one reaper thread waits for completions without the lock,
 * then, with it, resumes short transfers, settles finished blocks and
 * hands out the next pending ones. Only the thread holding the lock writes
 * the submission ring. The completion ring is twice the submission ring
 * and at most queue_depth blocks are in flight, so it cannot overflow.
 *
 * Where <linux/io_uring.h> is missing at build time, or the kernel refuses
 * io_uring (too old, disabled by sysctl or a seccomp filter, or lacking
 * IORING_OP_READ/WRITE, which came in 5.6), uring_start fails and
 * zero_aio_create falls back to the thread backend.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "aio_internal.h"

#if defined(__linux__) && defined(__has_include)
#if __has_include(<linux/io_uring.h>)
#define HAVE_URING 1
#endif
#endif

#ifndef HAVE_URING

int uring_probe(void)
{
    return ENOSYS;
}

int uring_start(zero_aio *a)
{
    (void)a;
    return ENOSYS;
}

void uring_kick(zero_aio *a)
{
    (void)a;
}

void uring_stop(zero_aio *a)
{
    (void)a;
}

#else

#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>

struct aio_ring {
    int fd;
    void *sq_map, *cq_map;  /* cq_map == sq_map with IORING_FEAT_SINGLE_MMAP */
    size_t sq_map_size, cq_map_size;
    struct io_uring_sqe *sqes; /* [sq_entries] */
    size_t sqes_size;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_cqe *cqes;
    unsigned unsubmitted;   /* entries past the kernel's head */
    aio_block *blocks;      /* [queue_depth] */
    int *free_blocks;       /* [queue_depth] indices, a stack */
    int nfree;
    pthread_t reaper;
    int reaper_started;
};

/* user_data of the entry that wakes the reaper to stop; blocks are i + 1 */
#define WAKE_UP 0

static int ring_setup(unsigned entries, struct io_uring_params *p)
{
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int ring_enter(int fd, unsigned submit, unsigned wait_for,
                      unsigned flags)
{
    return (int)syscall(__NR_io_uring_enter, fd, submit, wait_for, flags,
                        NULL, 0);
}

/* 0 when the kernel runs IORING_OP_READ and IORING_OP_WRITE on ring fd. */
static int check_ops(int fd)
{
    size_t size = sizeof(struct io_uring_probe) +
                  256 * sizeof(struct io_uring_probe_op);
    struct io_uring_probe *probe = calloc(1, size);
    if (!probe) {
        return ENOMEM;
    }
    int error = 0;
    if (syscall(__NR_io_uring_register, fd, IORING_REGISTER_PROBE, probe,
                256) < 0) {
        error = errno; /* before 5.6: no probe, and no READ/WRITE either */
    } else if (probe->last_op < IORING_OP_WRITE ||
               !(probe->ops[IORING_OP_READ].flags & IO_URING_OP_SUPPORTED) ||
               !(probe->ops[IORING_OP_WRITE].flags & IO_URING_OP_SUPPORTED)) {
        error = EOPNOTSUPP;
    }
    free(probe);
    return error;
}

int uring_probe(void)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    int fd = ring_setup(2, &p);
    if (fd < 0) {
        return errno;
    }
    int error = check_ops(fd);
    close(fd);
    return error;
}

static void ring_free(struct aio_ring *r)
{
    if (r->sqes && r->sqes != MAP_FAILED) {
        munmap(r->sqes, r->sqes_size);
    }
    if (r->cq_map && r->cq_map != MAP_FAILED && r->cq_map != r->sq_map) {
        munmap(r->cq_map, r->cq_map_size);
    }
    if (r->sq_map && r->sq_map != MAP_FAILED) {
        munmap(r->sq_map, r->sq_map_size);
    }
    if (r->fd >= 0) {
        close(r->fd);
    }
    free(r->blocks);
    free(r->free_blocks);
    free(r);
}

/* Map the rings of a new io_uring with room for entries; 0 or an errno. */
static int ring_map(struct aio_ring *r, unsigned entries)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    r->fd = ring_setup(entries, &p);
    if (r->fd < 0) {
        return errno;
    }
    int error = check_ops(r->fd);
    if (error) {
        return error;
    }
    r->sq_map_size = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_map_size = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    int single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single && r->cq_map_size > r->sq_map_size) {
        r->sq_map_size = r->cq_map_size;
    }
    r->sq_map = mmap(NULL, r->sq_map_size, PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQ_RING);
    if (r->sq_map == MAP_FAILED) {
        return errno;
    }
    r->cq_map = single ? r->sq_map
                       : mmap(NULL, r->cq_map_size, PROT_READ | PROT_WRITE,
                              MAP_SHARED | MAP_POPULATE, r->fd,
                              IORING_OFF_CQ_RING);
    if (r->cq_map == MAP_FAILED) {
        return errno;
    }
    r->sqes_size = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_size, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) {
        return errno;
    }
    char *sq = r->sq_map, *cq = r->cq_map;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    return 0;
}

/* Put one entry in the submission ring (there is always room: see the
 * file's comment); it is submitted by the next submit(). */
static void push(struct aio_ring *r, uint8_t opcode, const aio_block *b,
                 uint64_t user_data)
{
    unsigned tail = *r->sq_tail; /* only we write it */
    unsigned index = tail & *r->sq_mask;
    struct io_uring_sqe *sqe = &r->sqes[index];
    memset(sqe, 0, sizeof *sqe);
    sqe->opcode = opcode;
    sqe->fd = b ? b->fd : -1;
    if (b) {
        sqe->addr = (uint64_t)(uintptr_t)(b->buf + b->done);
        sqe->len = (uint32_t)(b->length - b->done);
        sqe->off = (uint64_t)(b->offset + b->done);
    }
    sqe->user_data = user_data;
    r->sq_array[index] = index;
    /* the entry is written before the kernel can see the new tail */
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
    r->unsubmitted++;
}

static void push_block(struct aio_ring *r, int i)
{
    const aio_block *b = &r->blocks[i];
    push(r, b->write ? IORING_OP_WRITE : IORING_OP_READ, b,
         (uint64_t)i + 1);
}

static void release_block(zero_aio *a, int i, int error)
{
    aio_finish_block(a, &a->ring->blocks[i], error);
    a->ring->free_blocks[a->ring->nfree++] = i;
}

/* Entries the kernel would not take are taken back and their blocks
 * failed with `error`, so no request waits for them forever. */
static void take_back(zero_aio *a, int error)
{
    struct aio_ring *r = a->ring;
    unsigned tail = *r->sq_tail;
    for (unsigned k = tail - r->unsubmitted; k != tail; k++) {
        uint64_t user_data = r->sqes[k & *r->sq_mask].user_data;
        if (user_data != WAKE_UP) {
            release_block(a, (int)(user_data - 1), error);
        }
    }
    __atomic_store_n(r->sq_tail, tail - r->unsubmitted, __ATOMIC_RELEASE);
    r->unsubmitted = 0;
}

/* Submit what was pushed. */
static void submit(zero_aio *a)
{
    struct aio_ring *r = a->ring;
    while (r->unsubmitted > 0) {
        int n = ring_enter(r->fd, r->unsubmitted, 0, 0);
        if (n > 0) {
            r->unsubmitted -= (unsigned)n;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else {
            take_back(a, n < 0 ? errno : EIO);
        }
    }
}

void uring_kick(zero_aio *a)
{
    struct aio_ring *r = a->ring;
    while (r->nfree > 0) {
        int i = r->free_blocks[r->nfree - 1];
        if (!aio_take_block(a, &r->blocks[i])) {
            break;
        }
        r->nfree--;
        push_block(r, i);
    }
    submit(a);
}

/* One completion of block i: settle it, or push the rest of a short
 * transfer again. */
static void complete(zero_aio *a, int i, int32_t res)
{
    aio_block *b = &a->ring->blocks[i];
    int64_t seen = aio_observed(b, res);
    if (seen == -EINTR || seen == -EAGAIN) {
        push_block(a->ring, i);
    } else if (seen < 0) {
        release_block(a, i, (int)-seen);
    } else if (seen == 0) {
        release_block(a, i, ZERO_AIO_END_OF_FILE);
    } else {
        b->done += seen;
        if (b->done < b->length) {
            push_block(a->ring, i);
        } else {
            release_block(a, i, 0);
        }
    }
}

/* Take every completion in the ring; 1 when the stop entry was among
 * them. */
static int reap(zero_aio *a)
{
    struct aio_ring *r = a->ring;
    int woken = 0;
    unsigned head = *r->cq_head;
    unsigned tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
    for (; head != tail; head++) {
        const struct io_uring_cqe *cqe = &r->cqes[head & *r->cq_mask];
        if (cqe->user_data == WAKE_UP) {
            woken = 1;
        } else {
            complete(a, (int)(cqe->user_data - 1), cqe->res);
        }
    }
    /* the entries are read before the kernel may reuse them */
    __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    return woken;
}

static void *reaper(void *arg)
{
    zero_aio *a = arg;
    struct aio_ring *r = a->ring;
    pthread_mutex_lock(&a->lock);
    for (;;) {
        reap(a);
        uring_kick(a);
        if (a->shutdown && r->nfree == a->queue_depth && !aio_has_pending(a)) {
            break;
        }
        pthread_mutex_unlock(&a->lock);
        /* EINTR only: the wait is simply taken again */
        ring_enter(r->fd, 0, 1, IORING_ENTER_GETEVENTS);
        pthread_mutex_lock(&a->lock);
    }
    pthread_mutex_unlock(&a->lock);
    return NULL;
}

int uring_start(zero_aio *a)
{
    struct aio_ring *r = calloc(1, sizeof *r);
    if (!r) {
        return ENOMEM;
    }
    r->fd = -1;
    r->blocks = calloc((size_t)a->queue_depth, sizeof *r->blocks);
    r->free_blocks = calloc((size_t)a->queue_depth, sizeof *r->free_blocks);
    if (!r->blocks || !r->free_blocks) {
        ring_free(r);
        return ENOMEM;
    }
    /* one entry more than the blocks, for the stop entry */
    int error = ring_map(r, (unsigned)a->queue_depth + 1);
    if (error) {
        ring_free(r);
        return error;
    }
    for (int i = 0; i < a->queue_depth; i++) {
        r->free_blocks[i] = a->queue_depth - 1 - i;
    }
    r->nfree = a->queue_depth;
    a->ring = r;
    if (aio_start_thread(&r->reaper, reaper, a) != 0) {
        a->ring = NULL;
        ring_free(r);
        return EAGAIN;
    }
    r->reaper_started = 1;
    return 0;
}

void uring_stop(zero_aio *a)
{
    struct aio_ring *r = a->ring;
    if (!r) {
        return;
    }
    if (r->reaper_started && getpid() == a->pid) {
        /* a no-op's completion wakes the reaper, which then sees shutdown
         * and leaves once the blocks in flight are settled */
        pthread_mutex_lock(&a->lock);
        push(r, IORING_OP_NOP, NULL, WAKE_UP);
        submit(a);
        pthread_mutex_unlock(&a->lock);
        pthread_join(r->reaper, NULL);
    }
    a->ring = NULL;
    ring_free(r);
}

#endif /* HAVE_URING */
