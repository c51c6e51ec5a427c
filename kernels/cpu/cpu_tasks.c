// kernels/cpu/cpu_tasks.c — the worker pool of cpu_tasks.h: one job at a time; workers wait on a condition variable
// for a new job (a generation counter), take tasks from an atomic counter, and the last one to finish wakes the
// caller, which took tasks too.
#include "kernels/cpu/cpu_tasks.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#endif

enum { MAX_WORKERS = 255 };

static struct {
    pthread_mutex_t job;      // held by the caller for a whole job: jobs run one after the other
    pthread_mutex_t mu;       // guards everything below except `next`
    pthread_cond_t work;      // a new job (generation changed)
    pthread_cond_t done;      // the job's last worker finished
    pthread_t threads[MAX_WORKERS];
    uint64_t start_generation[MAX_WORKERS];  // the generation when each worker was started (jobs after it are new)
    int n_workers;            // started so far
    uint64_t generation;      // jobs posted so far
    int wanted;               // workers 0..wanted-1 take part in the current job
    int active;               // of those, still running tasks
    CpuTask task;
    void *arg;
    long n_tasks;
    atomic_long next;         // the next task to hand out
} pool = {.job = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER, .work = PTHREAD_COND_INITIALIZER,
          .done = PTHREAD_COND_INITIALIZER};

// Takes tasks of the current job until none is left. task / arg / n_tasks were written under `mu` before the job
// was posted, and every taker acquired `mu` (or is the poster) since, so they are visible here.
static void take_tasks(void) {
    for (long t; (t = atomic_fetch_add_explicit(&pool.next, 1, memory_order_relaxed)) < pool.n_tasks;)
        pool.task(pool.arg, t);
}

static void *worker_main(void *p) {
    const int id = (int)(intptr_t)p;
    pthread_mutex_lock(&pool.mu);
    uint64_t seen = pool.start_generation[id];
    for (;;) {
        while (pool.generation == seen) pthread_cond_wait(&pool.work, &pool.mu);
        seen = pool.generation;
        if (id >= pool.wanted) continue;   // a job with fewer threads than there are workers
        pthread_mutex_unlock(&pool.mu);
        take_tasks();
        pthread_mutex_lock(&pool.mu);
        if (--pool.active == 0) pthread_cond_signal(&pool.done);
    }
    return NULL;
}

// A child of fork() has none of the workers, and a mutex another thread held at the fork stays held: it starts with
// a fresh pool (the tandem binaries exec right after fork, but nothing here should hang if one did not).
static void reset_in_child(void) {
    pthread_mutex_init(&pool.job, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.work, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.n_workers = pool.wanted = pool.active = 0;
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, reset_in_child); }

int cpu_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

void cpu_run_tasks(CpuTask task, void *arg, long n_tasks, int n_threads) {
    if (n_threads > n_tasks) n_threads = (int)n_tasks;
    if (n_threads > MAX_WORKERS + 1) n_threads = MAX_WORKERS + 1;
    if (n_threads <= 1) {
        for (long t = 0; t < n_tasks; t++) task(arg, t);
        return;
    }
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_fork_handler);
    pthread_mutex_lock(&pool.job);
    pthread_mutex_lock(&pool.mu);
    // Workers start here, under `mu`, as of the current generation: the job posted below is new to them.
    while (pool.n_workers < n_threads - 1) {
        pool.start_generation[pool.n_workers] = pool.generation;
        if (pthread_create(&pool.threads[pool.n_workers], NULL, worker_main, (void *)(intptr_t)pool.n_workers) != 0)
            break;
        pool.n_workers++;
    }
    pool.task = task;
    pool.arg = arg;
    pool.n_tasks = n_tasks;
    atomic_store_explicit(&pool.next, 0, memory_order_relaxed);
    pool.wanted = pool.active = n_threads - 1 < pool.n_workers ? n_threads - 1 : pool.n_workers;
    pool.generation++;
    pthread_cond_broadcast(&pool.work);
    pthread_mutex_unlock(&pool.mu);
    take_tasks();
    pthread_mutex_lock(&pool.mu);
    while (pool.active > 0) pthread_cond_wait(&pool.done, &pool.mu);
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool.job);
}
