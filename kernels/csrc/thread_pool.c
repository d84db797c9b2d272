/* See thread_pool.h. */
#include "thread_pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#define MAX_THREADS 64

static pthread_mutex_t run_lock = PTHREAD_MUTEX_INITIALIZER;  /* one job at a time */
static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static int started;                /* pool threads running (ids 1..started) */
static int sleepers;               /* pool threads waiting on `wake`, under sleep_lock */
static atomic_uint generation;     /* bumped once per job */
static atomic_int remaining;       /* pool threads still in the current job */
static int64_t spin_ns = 1000000;  /* after a job that asks for a spin */
static int job_spin;               /* whether pool threads spin after the current job */
static int spin_always;            /* every job spins (pool_set_spin_always) */
static int64_t wakeups;            /* jobs that had to wake sleeping threads (pool_wakeups) */

static pool_task job_task;
static void *job_ctx;
static int job_threads;
static unsigned born_at[MAX_THREADS];  /* the generation when each pool thread was made */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void *worker(void *arg) {
    int id = (int)(intptr_t)arg;
    /* not a fresh read: a job may have been posted between pthread_create and here */
    unsigned seen = born_at[id];
    for (;;) {
        unsigned g = atomic_load_explicit(&generation, memory_order_acquire);
        if (g == seen) {
            int64_t until = now_ns() + (job_spin ? spin_ns : 0);
            for (int n = 0; g == seen; n++) {
                cpu_relax();
                g = atomic_load_explicit(&generation, memory_order_acquire);
                if ((n & 63) == 63 && g == seen && now_ns() > until) break;
            }
            if (g == seen) {
                pthread_mutex_lock(&sleep_lock);
                sleepers++;
                while ((g = atomic_load(&generation)) == seen) pthread_cond_wait(&wake, &sleep_lock);
                sleepers--;
                pthread_mutex_unlock(&sleep_lock);
            }
        }
        seen = g;
        if (id < job_threads) job_task(job_ctx, id, job_threads);
        atomic_fetch_sub_explicit(&remaining, 1, memory_order_acq_rel);
    }
    return NULL;
}

/* A forked child has none of the parent's threads: it starts its own pool when it needs one. */
static void after_fork_in_child(void) {
    started = 0;
    sleepers = 0;
    pthread_mutex_init(&run_lock, NULL);
    pthread_mutex_init(&sleep_lock, NULL);
    pthread_cond_init(&wake, NULL);
}

int64_t pool_wakeups(void) { return wakeups; }

int pool_asleep(void) { return __atomic_load_n(&sleepers, __ATOMIC_RELAXED) > 0; }

void pool_set_spin_us(int us) { spin_ns = us < 0 ? 0 : (int64_t)us * 1000; }

void pool_set_spin_always(int on) { spin_always = on != 0; }

void pool_run(pool_task task, void *ctx, int threads, int spin) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1) {
        task(ctx, 0, 1);
        return;
    }
    pthread_mutex_lock(&run_lock);
    static int atfork_registered;
    if (!atfork_registered) atfork_registered = pthread_atfork(NULL, NULL, after_fork_in_child) == 0;
    while (started < threads - 1) {
        pthread_t t;
        born_at[started + 1] = atomic_load(&generation);
        if (pthread_create(&t, NULL, worker, (void *)(intptr_t)(started + 1)) != 0) break;
        pthread_detach(t);
        started++;
    }
    if (threads > started + 1) threads = started + 1;
    job_task = task;
    job_ctx = ctx;
    job_threads = threads;
    job_spin = spin || spin_always;
    /* Every pool thread takes each job (those past `threads` return at once), so the
     * generation count alone tells each one that a job is there. */
    atomic_store_explicit(&remaining, started, memory_order_relaxed);
    atomic_fetch_add_explicit(&generation, 1, memory_order_release);
    pthread_mutex_lock(&sleep_lock);
    if (sleepers) {
        wakeups++;
        pthread_cond_broadcast(&wake);
    }
    pthread_mutex_unlock(&sleep_lock);
    task(ctx, 0, threads);
    while (atomic_load_explicit(&remaining, memory_order_acquire) > 0) cpu_relax();
    pthread_mutex_unlock(&run_lock);
}
