/* threadpool.c: the core's own small pthread pool and its parallel-for.
 *
 * DESIGN.md rules out a second OpenMP runtime beside torch's, so the core
 * keeps a few workers of its own. One job runs at a time (call_lock); the
 * calling thread takes a share of the chunks too, so N threads means N-1
 * workers. Workers start lazily on the first large job.
 *
 * Workers and the caller spin briefly before they block: a step over an
 * in-cache buffer takes tens of microseconds, about what a futex wake-up
 * costs on a virtual machine, so sleeping at once would halve the speed of
 * small steps.
 *
 * [Note: fork] A child process has none of its parent's threads. The atfork
 * handlers hold call_lock across fork() so no job is half done, and the
 * child forgets the workers it does not have; its first job starts new ones.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "internal.h"

/* Below this many elements per extra thread, waking a worker costs more
 * than it saves. */
#define MIN_ELEMENTS_PER_THREAD 16384

/* Spin iterations (each one pause instruction, some tens of cycles) before
 * blocking: about 50 microseconds. */
#define SPIN_ITERATIONS 2000

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;

static struct {
    pthread_mutex_t lock;  /* guards the condition waits and shutdown */
    pthread_cond_t wake;   /* a new job, or shutdown */
    pthread_cond_t done;   /* the last worker finished the job */
    pthread_t *workers;
    int nworkers;
    atomic_int shutdown;
    atomic_ullong generation; /* bumped once per job */
    atomic_int remaining;  /* workers still inside the current job */
    range_fn fn;
    void *ctx;
    int64_t n, chunk;
    int64_t nchunks;
    atomic_llong next_chunk;
} pool = {
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .wake = PTHREAD_COND_INITIALIZER,
    .done = PTHREAD_COND_INITIALIZER,
};

static int requested_threads; /* 0: as many as this process may use */
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static int affinity_cpus(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int count = CPU_COUNT(&set);
        if (count > 0) {
            return count;
        }
    }
    return 1;
}

int zero_threads_get(void)
{
    return requested_threads > 0 ? requested_threads : affinity_cpus();
}

static void run_chunks(void)
{
    for (;;) {
        int64_t c = atomic_fetch_add(&pool.next_chunk, 1);
        if (c >= pool.nchunks) {
            return;
        }
        int64_t begin = c * pool.chunk;
        int64_t end = begin + pool.chunk < pool.n ? begin + pool.chunk
                                                  : pool.n;
        pool.fn(pool.ctx, begin, end);
    }
}

/* `start_generation` is the job count when the worker was created: a job
 * posted before the new thread first runs must still be seen as new. */
static void *worker_main(void *start_generation)
{
    uint64_t seen = (uint64_t)(uintptr_t)start_generation;
    for (;;) {
        for (int spin = 0; spin < SPIN_ITERATIONS &&
                           atomic_load(&pool.generation) == seen &&
                           !pool.shutdown;
             spin++) {
            cpu_relax();
        }
        pthread_mutex_lock(&pool.lock);
        while (atomic_load(&pool.generation) == seen && !pool.shutdown) {
            pthread_cond_wait(&pool.wake, &pool.lock);
        }
        if (pool.shutdown) {
            pthread_mutex_unlock(&pool.lock);
            return NULL;
        }
        pthread_mutex_unlock(&pool.lock);
        seen = atomic_load(&pool.generation);
        run_chunks();
        if (atomic_fetch_sub(&pool.remaining, 1) == 1) {
            /* Under the lock, so the caller cannot miss the signal between
             * its check of `remaining` and its wait. */
            pthread_mutex_lock(&pool.lock);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.lock);
        }
    }
}

/* Called with call_lock held. */
static void stop_workers(void)
{
    pthread_mutex_lock(&pool.lock);
    pool.shutdown = 1;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    for (int i = 0; i < pool.nworkers; i++) {
        pthread_join(pool.workers[i], NULL);
    }
    free(pool.workers);
    pool.workers = NULL;
    pool.nworkers = 0;
    pool.shutdown = 0;
}

/* Called with call_lock held. */
static zero_status start_workers(int count)
{
    pool.workers = calloc((size_t)count, sizeof *pool.workers);
    if (!pool.workers) {
        return ZERO_ERR_OUT_OF_MEMORY;
    }
    for (int i = 0; i < count; i++) {
        void *generation = (void *)(uintptr_t)atomic_load(&pool.generation);
        if (pthread_create(&pool.workers[i], NULL, worker_main,
                           generation) != 0) {
            stop_workers();
            return ZERO_ERR_THREADS;
        }
        pool.nworkers = i + 1;
    }
    return ZERO_OK;
}

static void atfork_prepare(void) { pthread_mutex_lock(&call_lock); }
static void atfork_parent(void) { pthread_mutex_unlock(&call_lock); }

static void atfork_child(void)
{
    /* See [Note: fork]: the workers do not exist in the child. */
    free(pool.workers);
    pool.workers = NULL;
    pool.nworkers = 0;
    pool.shutdown = 0;
    atomic_store(&pool.remaining, 0);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pthread_mutex_unlock(&call_lock);
}

static void register_atfork(void)
{
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

zero_status zero_threads_set(int nthreads)
{
    if (nthreads < 0) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    pthread_mutex_lock(&call_lock);
    stop_workers();
    requested_threads = nthreads;
    pthread_mutex_unlock(&call_lock);
    return ZERO_OK;
}

zero_status parallel_for(int64_t n, int64_t grain, range_fn fn, void *ctx)
{
    if (n <= 0) {
        return ZERO_OK;
    }
    int64_t threads = zero_threads_get();
    int64_t useful = n / MIN_ELEMENTS_PER_THREAD;
    if (threads > useful) {
        threads = useful > 0 ? useful : 1;
    }
    if (threads <= 1) {
        fn(ctx, 0, n);
        return ZERO_OK;
    }
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&call_lock);
    int wanted_workers = zero_threads_get() - 1;
    if (pool.nworkers != wanted_workers) {
        stop_workers();
        zero_status status = start_workers(wanted_workers);
        if (status != ZERO_OK) {
            pthread_mutex_unlock(&call_lock);
            return status;
        }
    }
    int64_t chunk = (n + threads - 1) / threads;
    chunk = (chunk + grain - 1) / grain * grain;
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n = n;
    pool.chunk = chunk;
    pool.nchunks = (n + chunk - 1) / chunk;
    atomic_store(&pool.next_chunk, 0);

    /* The job's fields are written before the generation moves: a worker
     * that sees the new generation sees the job. */
    atomic_store(&pool.remaining, pool.nworkers);
    pthread_mutex_lock(&pool.lock);
    atomic_fetch_add(&pool.generation, 1);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);

    run_chunks();

    for (int spin = 0;
         spin < SPIN_ITERATIONS && atomic_load(&pool.remaining) > 0; spin++) {
        cpu_relax();
    }
    pthread_mutex_lock(&pool.lock);
    while (atomic_load(&pool.remaining) > 0) {
        pthread_cond_wait(&pool.done, &pool.lock);
    }
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&call_lock);
    return ZERO_OK;
}
