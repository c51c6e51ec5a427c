// kernels/cuda/cuda_graph.cu — CUDA graphs of ops (kernels/ops.h, "graphs"): record what one thread queues on a
// context into a graph, instantiate it once, replay it with one launch.
//
// Recording happens on a private stream (capture_stream) that the context's ops are pointed at for the duration
// (st->stream): the context's real compute stream (main_stream, what ops_cuda_stream hands out) stays untouched, so
// another thread that queues an event or a copy on it meanwhile (the weight receiver orders its NCCL stream after
// the compute stream) neither lands in the graph nor drags its own stream into the capture. The capture is
// thread-local (cudaStreamCaptureModeThreadLocal): only the recording thread is barred from calls that cannot be
// recorded; other threads may allocate and synchronize as usual (CUDA may then invalidate the recording, which
// fails cleanly at ops_graph_end and can be made again). The calling thread's unrecordable calls are
// refused with a named error before they reach CUDA (cuda_refuse_in_capture), because CUDA's own answer
// ("operation not permitted when stream is capturing") does not say which op was at fault.
#include <stdio.h>
#include <stdlib.h>

#include "kernels/cuda/cuda_common.cuh"

struct OpsGraph {
    cudaGraphExec_t exec;
    int may_fault;  // the recording holds a kernel that reports faults through the device record (embedding)
};

// The state whose recording the calling thread runs, or NULL: the test is per thread by construction.
static thread_local const CudaState *tls_recording = NULL;

int cuda_recording(const CudaState *st) { return st && tls_recording == st; }

int cuda_refuse_in_capture(OpsCtx *ctx, const CudaState *st, const char *what) {
    if (!st || tls_recording != st) return 0;
    ops_set_error(ctx, -1, __FILE__, __LINE__,
                  "%s cannot be recorded into a CUDA graph (run the same ops eagerly once before recording, so that "
                  "nothing needs to be allocated or set up while recording)",
                  what);
    return 1;
}

int cuda_graph_supported(OpsCtx *ctx) {
    const CudaState *st = (const CudaState *)ops_backend_state(ctx);
    return st && !st->profile;
}

int cuda_graph_begin(OpsCtx *ctx) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return ops_status(ctx);
    if (st->profile) return OPS_GRAPH_UNSUPPORTED;
    if (st->capturing) {
        return ops_set_error(ctx, -1, __FILE__, __LINE__, "graph recording started while one is already under way");
    }
    if (!st->capture_stream) {
        CUDA_CHECK_RET(ctx, cudaStreamCreateWithFlags(&st->capture_stream, cudaStreamNonBlocking), ops_status(ctx));
    }
    CUDA_CHECK_RET(ctx, cudaStreamBeginCapture(st->capture_stream, cudaStreamCaptureModeThreadLocal), ops_status(ctx));
    st->capturing = 1;
    st->stream = st->capture_stream;
    st->capture_saved_fault = st->fault_armed;
    st->fault_armed = 0;
    tls_recording = st;
    return 0;
}

int cuda_graph_end(OpsCtx *ctx, OpsGraph **graph) {
    CudaState *st = (CudaState *)ops_backend_state(ctx);
    if (!st || !st->capturing || tls_recording != st) {
        return ops_set_error(ctx, -1, __FILE__, __LINE__, "ops_graph_end without a recording begun by this thread");
    }
    // Leave capture mode first, whatever happened while recording: the stream must not stay in it.
    cudaSetDevice(st->device);
    cudaGraph_t g = NULL;
    const cudaError_t end_e = cudaStreamEndCapture(st->capture_stream, &g);
    tls_recording = NULL;
    st->capturing = 0;
    st->stream = st->main_stream;
    const int may_fault = st->fault_armed;
    st->fault_armed = st->capture_saved_fault;
    if (ops_status(ctx) != 0 || end_e != cudaSuccess) {
        if (g) cudaGraphDestroy(g);
        // A failed capture leaves its error as the thread's last error; the next launch check must not see it.
        cudaGetLastError();
        if (ops_status(ctx) != 0) return ops_status(ctx);
        return ops_set_error(ctx, -1, __FILE__, __LINE__, "cudaStreamEndCapture failed: %s (%s)",
                             cudaGetErrorString(end_e), cudaGetErrorName(end_e));
    }
    cudaError_t e = cudaSuccess;
    OpsGraph *out = *graph;
    if (out) {
        // The old graph is changed or dropped below: let a replay of it still queued finish first (this happens
        // only when a graph is recorded again, not per replay).
        e = cudaStreamSynchronize(st->main_stream);
        if (e != cudaSuccess) {
            cudaGraphDestroy(g);
            return ops_set_error(ctx, -1, __FILE__, __LINE__, "cudaStreamSynchronize failed: %s (%s)",
                                 cudaGetErrorString(e), cudaGetErrorName(e));
        }
        // Same structure (the usual case after new parameter pointers): patch the executable graph in place.
        cudaGraphExecUpdateResultInfo info;
        if (cudaGraphExecUpdate(out->exec, g, &info) == cudaSuccess) {
            out->may_fault = may_fault;
            cudaGraphDestroy(g);
            return 0;
        }
        cudaGetLastError();  // the refusal (another topology or kernel) is not an error: instantiate anew below
    }
    cudaGraphExec_t exec = NULL;
    e = cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return ops_set_error(ctx, -1, __FILE__, __LINE__, "cudaGraphInstantiate failed: %s (%s)", cudaGetErrorString(e),
                             cudaGetErrorName(e));
    }
    // Moves the graph's launch resources to the device now rather than on the first replay.
    e = cudaGraphUpload(exec, st->main_stream);
    if (e != cudaSuccess) {
        cudaGraphExecDestroy(exec);
        cudaGetLastError();
        return ops_set_error(ctx, -1, __FILE__, __LINE__, "cudaGraphUpload failed: %s (%s)", cudaGetErrorString(e),
                             cudaGetErrorName(e));
    }
    if (out) {
        cudaGraphExecDestroy(out->exec);
    } else if (!(out = (OpsGraph *)calloc(1, sizeof *out))) {
        cudaGraphExecDestroy(exec);
        return ops_set_error(ctx, -1, __FILE__, __LINE__, "out of host memory for a graph");
    }
    out->exec = exec;
    out->may_fault = may_fault;
    *graph = out;
    return 0;
}

int cuda_graph_launch(OpsCtx *ctx, OpsGraph *graph) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return ops_status(ctx);
    if (cuda_refuse_in_capture(ctx, st, "ops_graph_launch")) return ops_status(ctx);
    CUDA_CHECK_RET(ctx, cudaGraphLaunch(graph->exec, st->stream), ops_status(ctx));
    if (graph->may_fault) st->fault_armed = 1;  // checked at the next synchronization, as after the eager op
    return 0;
}

void cuda_graph_destroy(OpsCtx *ctx, OpsGraph *graph) {
    CudaState *st = (CudaState *)ops_backend_state(ctx);
    if (!graph) return;
    if (st) {
        cudaSetDevice(st->device);
        cudaStreamSynchronize(st->main_stream);  // no replay of it may still be queued
    }
    if (graph->exec) cudaGraphExecDestroy(graph->exec);
    cudaGetLastError();  // teardown is best effort
    free(graph);
}
