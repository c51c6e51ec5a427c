// kernels/cpu/cpu_peer_all_reduce.c — ops_peer_all_reduce on the CPU (kernels/ops.h "sums across the tensor-parallel
// shards of one process"): the CUDA kernel's protocol with one "block", the shards being threads of this process.
#include <sched.h>
#include <string.h>
#include <time.h>

#include "kernels/cpu/cpu_ops.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int cpu_peer_all_reduce(float *const *buf0, float *const *buf1, uint32_t *const *flags, uint32_t *counter, int rank,
                        int n, float *x, const float *residual, size_t count, double timeout_s, int *late) {
    const uint32_t e = counter[0] + 1;
    float *const *buf = (e & 1) ? buf1 : buf0;
    memcpy(buf[rank], x, count * sizeof *x);
    for (int j = 0; j < n; j++)
        if (j != rank) __atomic_store_n(&flags[j][rank], e, __ATOMIC_RELEASE);
    double t0 = -1.0;
    for (int j = 0; j < n; j++) {
        if (j == rank) continue;
        for (unsigned spins = 0; (int32_t)(__atomic_load_n(&flags[rank][j], __ATOMIC_ACQUIRE) - e) < 0; spins++) {
            if (spins < 64) continue;
            // The other shards are threads that may share this core: let them run, and watch the clock.
            sched_yield();
            if ((spins & 255) == 0) {
                if (t0 < 0) t0 = now_s();
                else if (now_s() - t0 > timeout_s) {
                    *late = j;
                    return -1;
                }
            }
        }
    }
    for (size_t i = 0; i < count; i++) {
        float acc = 0.0f;
        for (int g = 0; g < n; g++) acc += buf[g][i];
        x[i] = residual ? acc + residual[i] : acc;
    }
    counter[0] = e;
    return 0;
}
