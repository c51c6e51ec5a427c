// kernels/cpu/cpu_parallel.h — how the CPU kernels use the machine's cores.
//
// The big GEMMs (linear layers) are threaded by OpenBLAS itself. Work made of many small independent pieces
// (attention per sequence and head, log-softmax per row) is split across cores with OpenMP instead, each piece
// running its small sgemms single-threaded: OpenBLAS's own threading costs more than it gains on 64 x 128
// tiles (attention measured slower with 2 OpenBLAS threads than with 1), and two thread pools must not both be
// active at once.
// Without OpenMP (a compiler without it) the pragmas vanish and the same loops run serially.
// The batch-invariant GEMM of the rollout server's forward (cpu_matmul_batch_invariant.c) splits its tiles over the
// pool of kernels/cpu/cpu_tasks.h instead, whose threads sleep rather than spin between jobs (see there why), with
// OpenMP's thread count.
#ifndef TANDEM_KERNELS_CPU_PARALLEL_H
#define TANDEM_KERNELS_CPU_PARALLEL_H

#ifdef _OPENMP
#define CPU_OMP(directive) _Pragma(directive)
#else
#define CPU_OMP(directive)
#endif

// OpenBLAS's thread count is process-wide state. The ops of one context run on one thread (kernels/ops.h), so
// a kernel may lower it to 1 around its tiled section and restore it afterwards; both calls are cheap (they
// set a counter; the OpenBLAS worker threads stay alive). Only the pthreads build of OpenBLAS needs this: an
// OpenMP build already runs single-threaded inside an OpenMP parallel region, and there setting its thread
// count would set OpenMP's own (omp_set_num_threads) and serialize the region. openblas_get_parallel():
// 0 sequential build, 1 pthreads, 2 OpenMP.
void openblas_set_num_threads(int num_threads);
int openblas_get_num_threads(void);
int openblas_get_parallel(void);

static inline int cpu_blas_threads_begin_single(void) {
    if (openblas_get_parallel() != 1) return 0;
    const int n = openblas_get_num_threads();
    if (n > 1) openblas_set_num_threads(1);
    return n;
}

// n: what cpu_blas_threads_begin_single returned.
static inline void cpu_blas_threads_restore(int n) {
    if (n > 1) openblas_set_num_threads(n);
}

#endif
