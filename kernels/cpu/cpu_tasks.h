// kernels/cpu/cpu_tasks.h — independent tasks spread over a pool of worker threads that sleep between jobs.
//
// Why not OpenMP: libgomp's threads spin at the end of a parallel region (OMP_WAIT_POLICY unset) before they sleep,
// and the caller spins at the region's barrier. On a box with more runnable threads than cores (the 2-core
// development box running a server and two ranks) the spinning thread holds the core that the thread it waits for
// needs, and every region costs a scheduling slice: a server's step has one per projection, and with the GEMM split
// by OpenMP the demo model's steps ran slower on 2 threads than on 1 there (bench/notes/cpu.md, issue 22). Here
// every wait is a condition variable, so a waiting thread gives its core away at once.
#ifndef TANDEM_KERNELS_CPU_TASKS_H
#define TANDEM_KERNELS_CPU_TASKS_H

// One task: `task` in [0, n_tasks).
typedef void (*CpuTask)(void *arg, long task);

// Runs task(arg, t) for every t in [0, n_tasks) on up to n_threads threads, the caller's included, and returns when
// all have run. Tasks are handed out in order from a shared counter, so which thread runs a task depends on timing:
// a task's result must not. Jobs from several caller threads run one after the other. Workers start on first use
// (fewer, or none, when the system refuses threads: the caller then runs the rest).
void cpu_run_tasks(CpuTask task, void *arg, long n_tasks, int n_threads);

// The thread count the CPU kernels use: OpenMP's (OMP_NUM_THREADS, omp_set_num_threads), 1 without OpenMP.
int cpu_max_threads(void);

#endif
