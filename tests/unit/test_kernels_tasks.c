// tests/unit/test_kernels_tasks.c — cpu_run_tasks (kernels/cpu/cpu_tasks.c), the worker pool of the batch-invariant
// GEMM: every task runs exactly once for any task and thread count (more threads than tasks, than cores, one, none
// to run), jobs right after one another with growing and shrinking thread counts, and two caller threads posting
// jobs at the same time (they run one after the other; none is lost and none deadlocks), and a child of fork()
// that runs a job (it has none of the parent's workers).
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kernels/cpu/cpu_tasks.h"
#include "kernels_testlib.h"

enum { MAX_TASKS = 5000 };

typedef struct {
    atomic_int runs[MAX_TASKS];
} Counts;

static void count_task(void *arg, long t) {
    Counts *c = arg;
    atomic_fetch_add(&c->runs[t], 1);
}

// Runs a job and returns how many of its tasks did not run exactly once.
static int job(Counts *c, long n_tasks, int n_threads) {
    for (long t = 0; t < n_tasks; t++) atomic_store(&c->runs[t], 0);
    cpu_run_tasks(count_task, c, n_tasks, n_threads);
    int bad = 0;
    for (long t = 0; t < n_tasks; t++) bad += atomic_load(&c->runs[t]) != 1;
    return bad;
}

static void *caller(void *arg) {
    static Counts counts[2];
    const int id = *(int *)arg;
    int bad = 0;
    for (int j = 0; j < 300; j++) bad += job(&counts[id], 1 + (j * 37 + id) % 200, 1 + (j + id) % 4);
    *(int *)arg = bad;
    return NULL;
}

int main(void) {
    static Counts c;
    static const long TASKS[] = {0, 1, 2, 3, 7, 64, MAX_TASKS};
    static const int THREADS[] = {0, 1, 2, 3, 8, 2, 1, 5};
    for (size_t t = 0; t < sizeof THREADS / sizeof *THREADS; t++)
        for (size_t n = 0; n < sizeof TASKS / sizeof *TASKS; n++) {
            const int bad = job(&c, TASKS[n], THREADS[t]);
            CHECK(bad == 0, "%ld tasks on %d threads: %d did not run exactly once", TASKS[n], THREADS[t], bad);
        }
    CHECK(cpu_max_threads() >= 1, "cpu_max_threads() = %d", cpu_max_threads());
    pthread_t th[2];
    int arg[2] = {0, 1};
    for (int i = 0; i < 2; i++) CHECK(pthread_create(&th[i], NULL, caller, &arg[i]) == 0, "pthread_create");
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    CHECK(arg[0] == 0 && arg[1] == 0, "two callers at once: %d and %d tasks did not run exactly once", arg[0],
          arg[1]);
    const pid_t child = fork();
    if (child == 0) _exit(job(&c, 100, 3) == 0 ? 0 : 1);
    int status = 0;
    CHECK(child > 0 && waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "a job in a forked child: status %d", status);
    return check_exit_code("test_kernels_tasks");
}
