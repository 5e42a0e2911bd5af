/* aio_internal.h: what the async I/O engine's two files share. aio.c holds
 * the requests, cuts them into blocks and runs the thread backend;
 * aio_uring.c runs the io_uring backend over the same blocks. Everything
 * here is called with zero_aio.lock held unless it says otherwise.
 *
 * [Note: aio blocks] A request is cut into blocks of at most block_size
 * bytes, handed out in submission order. A block is the unit a backend
 * moves: it stays with one thread (or one ring entry) until all its bytes
 * are moved or it failed, resuming short transfers itself. A request is
 * done when every byte was handed out and no block of it is in flight.
 * After a failure the request's remaining blocks are not started.
 */
#ifndef ZERO_AIO_INTERNAL_H
#define ZERO_AIO_INTERNAL_H

#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>

#include "zero.h"

enum { REQUEST_FREE = 0, REQUEST_ACTIVE = 1, REQUEST_DONE = 2 };

typedef struct {
    int state;
    uint32_t generation;   /* bumped on reuse, so a stale id is refused */
    zero_aio_request r;
    int64_t handed_out;    /* bytes given to blocks so far */
    int in_flight;         /* blocks of it being moved */
    int next;              /* the pending queue's or free list's link, -1 */
    zero_aio_result result;
} aio_slot;

typedef struct {
    int slot;              /* the request's index in zero_aio.slots */
    int fd;
    int write;
    char *buf;             /* [length] */
    int64_t offset;        /* in the file */
    int64_t length;
    int64_t done;          /* bytes moved so far */
} aio_block;

struct aio_ring;

struct zero_aio {
    zero_aio_backend backend;
    int queue_depth;
    int64_t block_size;
    pid_t pid;             /* the creator; a forked child has no workers */
    pthread_mutex_t lock;
    pthread_cond_t work;   /* threads: a block to take, or shut down */
    pthread_cond_t done;   /* a request finished */
    aio_slot *slots;
    int capacity;
    int free_head;         /* free slots, linked through next */
    int pending_head, pending_tail; /* requests with blocks to hand out */
    int shutdown;
    pthread_t *threads;    /* the thread backend's workers, or the reaper */
    int nthreads;
    struct aio_ring *ring; /* the io_uring backend's, else NULL */
};

/* The next block to move into *b: 1, or 0 when none is pending. */
int aio_take_block(zero_aio *a, aio_block *b);
/* A block is over: error 0 (all moved), an errno or ZERO_AIO_END_OF_FILE. */
void aio_finish_block(zero_aio *a, const aio_block *b, int error);
/* 1 while a request has blocks to hand out. */
int aio_has_pending(const zero_aio *a);

/* What a transfer reports (bytes moved or -errno), after the test build's
 * fault hook has had its say (tests/c/test_aio.c); the identity otherwise.
 * The thread backend calls it without the lock, io_uring's with it. */
int64_t aio_observed(const aio_block *b, int64_t result);

/* pthread_create with every signal blocked in the new thread. */
int aio_start_thread(pthread_t *thread, void *(*fn)(void *), void *arg);

/* The io_uring backend (aio_uring.c). uring_start sets up the ring and its
 * reaper thread, without the lock (0 or an errno); uring_kick hands
 * pending blocks to the ring; uring_stop (without the lock, after shutdown
 * was set) waits for the reaper and frees the ring. */
int uring_start(zero_aio *a);
void uring_kick(zero_aio *a);
void uring_stop(zero_aio *a);
int uring_probe(void);

#ifdef ZERO_AIO_FAULTS
/* Tests only: sees each transfer's result (bytes or -errno) and returns
 * what the engine should believe happened. Set it while no request is in
 * flight. */
typedef int64_t (*zero_aio_fault_fn)(int write, int64_t offset,
                                     int64_t length, int64_t result);
void zero_aio_set_fault(zero_aio_fault_fn fn);
#endif

#endif /* ZERO_AIO_INTERNAL_H */
