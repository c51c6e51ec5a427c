// ops_testlib.h — the CPU and CUDA contexts of the tests that compare backends, and moving test data between the
// host and an ops backend (test_cuda_attention*, test_cuda_vs_cpu). A failed allocation
// ends the test with a message.
#ifndef TANDEM_TESTS_OPS_TESTLIB_H
#define TANDEM_TESTS_OPS_TESTLIB_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "check_macros.h"
#include "kernels/ops.h"

// Opens a CPU and a CUDA context: 0; without a CUDA device "SKIP" and 77 (ctest's skip code); when a context cannot
// be created "FAIL" with the reason and 1. main returns what is not 0.
static inline int kt_open_cpu_gpu(OpsCtx **cpu, OpsCtx **gpu) {
    if (!ops_backend_available(OPS_BACKEND_CUDA)) {
        printf("SKIP: no CUDA device\n");
        return 77;
    }
    char err[256];
    if (ops_create(cpu, OPS_BACKEND_CPU, 0, err, sizeof err) != 0 ||
        ops_create(gpu, OPS_BACKEND_CUDA, 0, err, sizeof err) != 0) {
        printf("FAIL: cannot create the contexts: %s\n", err);
        return 1;
    }
    return 0;
}

// After a case ran on both contexts (synchronizes the CUDA one): 1 when neither recorded an error; else a FAIL line
// naming `what` and both errors, a failure counted, both errors cleared, and 0.
static inline int kt_expect_no_errors(OpsCtx *cpu, OpsCtx *gpu, const char *what) {
    ops_synchronize(gpu);
    if (ops_status(cpu) == 0 && ops_status(gpu) == 0) return 1;
    printf("FAIL %s: unexpected error: cpu \"%s\" cuda \"%s\"\n", what, ops_error(cpu), ops_error(gpu));
    failures++;
    ops_clear_error(cpu);
    ops_clear_error(gpu);
    return 0;
}

// n fp32 host values into a new backend buffer of the backend's storage dtype.
static inline void *kt_upload(OpsCtx *o, const float *h, size_t n) {
    void *d = ops_malloc(o, (n ? n : 1) * ops_dtype_size(o));
    if (!d) {
        fprintf(stderr, "FATAL: allocation of %zu elements failed: %s\n", n, ops_error(o));
        exit(1);
    }
    ops_upload_f32(o, d, h, n);
    return d;
}

// n int32 host values into a new backend buffer (one spare word, so n may be 0).
static inline void *kt_upload_words(OpsCtx *o, const int32_t *h, size_t n) {
    void *d = ops_malloc(o, n * 4 + 4);
    if (!d) {
        fprintf(stderr, "FATAL: allocation failed: %s\n", ops_error(o));
        exit(1);
    }
    ops_copy_to_device(o, d, h, n * 4);
    return d;
}

// n values of a backend buffer as a new fp32 host array (the caller frees it).
static inline float *kt_download(OpsCtx *o, const void *d, size_t n) {
    float *h = malloc((n ? n : 1) * sizeof *h);
    ops_download_f32(o, h, d, n);
    return h;
}

#endif
