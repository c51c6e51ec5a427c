// dev/cuda/kernel_trace.c — a measuring tool, not part of tandem's build: an LD_PRELOAD library that records every
// kernel a process runs on any GPU (CUPTI's activity API; kernels replayed from CUDA graphs included) as one line
// "device start_ns end_ns mangled_name" in $KTRACE_OUT.<pid>. dev/cuda/kernel_trace_summary.py turns the lines into
// per-kernel times per decode step and the gaps between kernels. Build and use (dev/cuda/README.md):
//   gcc -O2 -shared -fPIC -o libktrace.so dev/cuda/kernel_trace.c -I$CUDA/include -L$CUDA/lib64 -lcupti
//   LD_PRELOAD=./libktrace.so KTRACE_OUT=/tmp/kt tandem-serve ...   (libcupti.so on LD_LIBRARY_PATH)
// Records reach the file as CUPTI hands over its buffers (at least every 200 ms) and at exit; a process killed
// with SIGKILL loses the last ones. Tracing adds host time to every launch, so end-to-end times measured under it
// are longer; the kernels' own durations and the gaps inside a graph replay are what it is for.
#include <cupti.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define TRACE_BUFFER_BYTES (8u << 20)

static FILE *trace_out;
static pthread_mutex_t trace_mu = PTHREAD_MUTEX_INITIALIZER;

static void CUPTIAPI buffer_requested(uint8_t **buf, size_t *size, size_t *max_records) {
    *size = TRACE_BUFFER_BYTES;
    *buf = aligned_alloc(8, TRACE_BUFFER_BYTES);
    *max_records = 0;   // as many as fit
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size, size_t valid) {
    (void)ctx, (void)stream, (void)size;
    CUpti_Activity *r = NULL;
    pthread_mutex_lock(&trace_mu);
    while (cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
        if (r->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && r->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
        const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;
        fprintf(trace_out, "%u %llu %llu %s\n", k->deviceId, (unsigned long long)k->start,
                (unsigned long long)k->end, k->name ? k->name : "?");
    }
    fflush(trace_out);
    pthread_mutex_unlock(&trace_mu);
    free(buf);
}

__attribute__((constructor)) static void trace_start(void) {
    const char *prefix = getenv("KTRACE_OUT");
    if (!prefix) return;
    char path[512];
    snprintf(path, sizeof path, "%s.%d", prefix, (int)getpid());
    trace_out = fopen(path, "w");
    if (!trace_out) {
        fprintf(stderr, "kernel_trace: cannot write %s; not tracing\n", path);
        return;
    }
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
        fprintf(stderr, "kernel_trace: CUPTI refused the kernel activity; not tracing\n");
        return;
    }
    cuptiActivityFlushPeriod(200);
}

__attribute__((destructor)) static void trace_stop(void) {
    if (trace_out) cuptiActivityFlushAll(1);
}
