// kernels/cuda/cuda_context.cu — the CUDA backend state (device, one stream, cuBLASLt handle and
// workspace, scratch, fault record), device memory, host<->device copies and the fp32 <-> bf16
// conversion used by ops_upload_f32 / ops_download_f32.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_common.cuh"

// cuBLASLt workspace by default: 32 MiB is what NVIDIA recommends for Hopper (split-K and stream-K partials).
static const size_t LT_WORKSPACE_BYTES = 32u << 20;
// Host staging for the fp32 <-> bf16 conversions: 1 Mi elements per chunk (2 MiB of bf16).
static const size_t CONVERT_CHUNK = 1u << 20;
static const size_t UPLOAD_CHUNK = (size_t)4 << 20;   // fp32 values: 16 MiB of device staging

void cuda_gemm_plans_destroy(CudaState *st);  // cuda_matmul.cu

int cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();  // clear the sticky "no device" / "insufficient driver" error
        return 0;
    }
    return n;
}

// Writes "what: reason" into err and releases whatever was created so far.
static int state_fail(CudaState *st, char *err, size_t err_len, const char *what, const char *why) {
    snprintf(err, err_len, "CUDA backend: %s: %s", what, why);
    cuda_state_destroy(st);
    return -1;
}

int cuda_state_create(OpsCtx *ctx, int device, const OpsSettings *settings, void **state, char *err,
                      size_t err_len) {
    (void)ctx;
    *state = NULL;
    int count = cuda_device_count();
    if (count <= 0) {
        snprintf(err, err_len, "CUDA backend: no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)");
        return -1;
    }
    if (device < 0 || device >= count) {
        snprintf(err, err_len, "CUDA backend: device %d does not exist (%d visible)", device, count);
        return -1;
    }
    CudaState *st = (CudaState *)calloc(1, sizeof *st);
    if (!st) {
        snprintf(err, err_len, "CUDA backend: out of host memory");
        return -1;
    }
    st->device = device;
    st->gemm_autotune = settings->gemm_autotune;
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) return state_fail(st, err, err_len, "cudaSetDevice", cudaGetErrorString(e));
    cudaDeviceProp prop;
    e = cudaGetDeviceProperties(&prop, device);
    if (e != cudaSuccess) return state_fail(st, err, err_len, "cudaGetDeviceProperties", cudaGetErrorString(e));
    if (prop.major < 8)
        return state_fail(st, err, err_len, prop.name, "compute capability 8.0 or newer is needed (bf16 tensor cores)");
    st->sm_count = prop.multiProcessorCount;
    st->max_smem_optin = prop.sharedMemPerBlockOptin;
    // Non-blocking: the stream does not serialize against the legacy default stream, which other
    // libraries (or a careless cudaMemcpy) might use.
    e = cudaStreamCreateWithFlags(&st->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) return state_fail(st, err, err_len, "cudaStreamCreate", cudaGetErrorString(e));
    st->main_stream = st->stream;
    cublasStatus_t s = cublasLtCreate(&st->lt);
    if (s != CUBLAS_STATUS_SUCCESS) return state_fail(st, err, err_len, "cublasLtCreate", cublasLtGetStatusString(s));
    const size_t ws_bytes =
        settings->gemm_workspace_mib ? (size_t)settings->gemm_workspace_mib << 20 : LT_WORKSPACE_BYTES;
    e = cudaMalloc(&st->lt_workspace, ws_bytes);
    if (e != cudaSuccess) return state_fail(st, err, err_len, "cuBLASLt workspace cudaMalloc", cudaGetErrorString(e));
    st->lt_workspace_bytes = ws_bytes;
    e = cudaMalloc(&st->fault_dev, sizeof(CudaFault));
    if (e != cudaSuccess) return state_fail(st, err, err_len, "fault record cudaMalloc", cudaGetErrorString(e));
    e = cudaMemset(st->fault_dev, 0, sizeof(CudaFault));
    if (e != cudaSuccess) return state_fail(st, err, err_len, "fault record cudaMemset", cudaGetErrorString(e));
    e = cudaMallocHost(&st->fault_host, sizeof(CudaFault));
    if (e != cudaSuccess) return state_fail(st, err, err_len, "cudaMallocHost", cudaGetErrorString(e));
    memset(st->fault_host, 0, sizeof(CudaFault));
    e = cudaMallocHost(&st->stage, CONVERT_CHUNK * sizeof(uint16_t));
    if (e != cudaSuccess) return state_fail(st, err, err_len, "staging cudaMallocHost", cudaGetErrorString(e));
    if (settings->profile_ops && !(st->profile = cuda_profile_create()))
        return state_fail(st, err, err_len, "per-op profiling events", "cudaEventCreate failed");
    e = cudaDeviceSynchronize();
    if (e != cudaSuccess) return state_fail(st, err, err_len, "cudaDeviceSynchronize", cudaGetErrorString(e));
    *state = st;
    return 0;
}

void cuda_state_destroy(void *state) {
    CudaState *st = (CudaState *)state;
    if (!st) return;
    cudaSetDevice(st->device);
    if (st->capturing) {  // a recording left open (its owner failed to end it): end and drop it
        cudaGraph_t g = NULL;
        if (cudaStreamEndCapture(st->capture_stream, &g) == cudaSuccess && g) cudaGraphDestroy(g);
        st->capturing = 0;
    }
    st->stream = st->main_stream;
    if (st->scratch && st->stream) cudaFreeAsync(st->scratch, st->stream);  // allocated stream-ordered
    for (int i = 0; i < st->n_scratch_retired; i++) cudaFreeAsync(st->scratch_retired[i], st->stream);
    free(st->scratch_retired);
    if (st->stream) cudaStreamSynchronize(st->stream);
    cuda_gemm_plans_destroy(st);
    cuda_profile_destroy(st->profile);
    if (st->lt_workspace) cudaFree(st->lt_workspace);
    if (st->fault_dev) cudaFree(st->fault_dev);
    if (st->fault_host) cudaFreeHost(st->fault_host);
    if (st->stage) cudaFreeHost(st->stage);
    if (st->upload_f32) cudaFree(st->upload_f32);
    if (st->lt) cublasLtDestroy(st->lt);
    if (st->blas) cublasDestroy(st->blas);
    if (st->capture_stream) cudaStreamDestroy(st->capture_stream);
    if (st->stream) cudaStreamDestroy(st->stream);
    cudaGetLastError();  // teardown is best effort; do not leave a sticky error for the next context
    free(st);
}

int ops_cuda_device(const OpsCtx *ctx) {
    if (!ctx || ops_backend(ctx) != OPS_BACKEND_CUDA) return -1;
    const CudaState *st = (const CudaState *)ops_backend_state((OpsCtx *)ctx);
    return st ? st->device : -1;
}

void *ops_cuda_stream(OpsCtx *ctx) {
    if (!ctx || ops_backend(ctx) != OPS_BACKEND_CUDA) return NULL;
    const CudaState *st = (const CudaState *)ops_backend_state(ctx);
    return st ? (void *)st->main_stream : NULL;
}

void *ops_cuda_recording_stream(OpsCtx *ctx) {
    if (!ctx || ops_backend(ctx) != OPS_BACKEND_CUDA) return NULL;
    const CudaState *st = (const CudaState *)ops_backend_state(ctx);
    return cuda_recording(st) ? (void *)st->capture_stream : NULL;
}

int ops_memory_info(OpsCtx *ctx, size_t *free_bytes, size_t *total_bytes) {
    *free_bytes = *total_bytes = 0;
    if (!ctx || ops_backend(ctx) != OPS_BACKEND_CUDA || !cuda_enter(ctx)) return -1;
    CUDA_CHECK_RET(ctx, cudaMemGetInfo(free_bytes, total_bytes), -1);
    return 0;
}

CudaState *cuda_enter(OpsCtx *ctx) {
    CudaState *st = (CudaState *)ops_backend_state(ctx);
    if (!st) {
        ops_set_error(ctx, -1, __FILE__, __LINE__, "CUDA op called on a context without CUDA state");
        return NULL;
    }
    CUDA_CHECK_RET(ctx, cudaSetDevice(st->device), NULL);
    return st;
}

void *cuda_scratch(OpsCtx *ctx, CudaState *st, size_t bytes) {
    if (bytes <= st->scratch_bytes) {
        // A graph keeps this pointer for good: a later growth must leave the buffer alive.
        if (cuda_recording(st)) st->scratch_in_graph = 1;
        return st->scratch;
    }
    if (cuda_refuse_in_capture(ctx, st, "growing the stream scratch")) return NULL;
    // Grow by at least 2x so a sequence of slightly larger requests does not reallocate every time.
    size_t want = st->scratch_bytes * 2 > bytes ? st->scratch_bytes * 2 : bytes;
    want = (want + 255) / 256 * 256;
    if (st->scratch && st->scratch_in_graph) {  // graphs read it: retire it instead (freed with the state)
        void **r = (void **)realloc(st->scratch_retired, (st->n_scratch_retired + 1) * sizeof *r);
        if (!r) {
            ops_set_error(ctx, -1, __FILE__, __LINE__, "out of host memory growing the stream scratch");
            return NULL;
        }
        st->scratch_retired = r;
        r[st->n_scratch_retired++] = st->scratch;
        st->scratch_in_graph = 0;
    } else if (st->scratch) {
        CUDA_CHECK_RET(ctx, cudaFreeAsync(st->scratch, st->stream), NULL);
    }
    st->scratch = NULL;
    st->scratch_bytes = 0;
    CUDA_CHECK_RET(ctx, cudaMallocAsync(&st->scratch, want, st->stream), NULL);
    st->scratch_bytes = want;
    return st->scratch;
}

// Turns a fault that a kernel recorded into a context error. Call after the stream is synchronized.
static void check_fault(OpsCtx *ctx, CudaState *st) {
    if (!st->fault_armed) return;
    st->fault_armed = 0;
    CUDA_CHECK(ctx, cudaMemcpy(st->fault_host, st->fault_dev, sizeof(CudaFault), cudaMemcpyDeviceToHost));
    CudaFault f = *st->fault_host;
    if (f.kind == CUDA_FAULT_NONE) return;
    CUDA_CHECK(ctx, cudaMemset(st->fault_dev, 0, sizeof(CudaFault)));
    switch (f.kind) {
    case CUDA_FAULT_EMBEDDING_TOKEN:
        ops_set_error(ctx, -1, __FILE__, __LINE__,
                      "embedding: token id %d at row %d is outside the vocabulary [0, %d) (found by the CUDA kernel)",
                      f.info[1], f.info[0], f.info[2]);
        break;
    case CUDA_FAULT_PEER_TIMEOUT:
        ops_set_error(ctx, -1, __FILE__, __LINE__,
                      "tensor-parallel sum: shard %d waited %.1f s for shard %d, which did not arrive (its thread or "
                      "device stopped; the step's results are void)", f.info[0], f.info[2] / 1000.0, f.info[1]);
        break;
    default:
        ops_set_error(ctx, -1, __FILE__, __LINE__, "CUDA kernel reported fault kind %d", f.kind);
        break;
    }
}

void cuda_synchronize(OpsCtx *ctx) {
    CudaState *st = cuda_enter(ctx);
    if (!st || cuda_refuse_in_capture(ctx, st, "ops_synchronize")) return;
    CUDA_CHECK(ctx, cudaStreamSynchronize(st->stream));
    check_fault(ctx, st);
}

// ---- memory ---------------------------------------------------------------------------------------

void *cuda_malloc(OpsCtx *ctx, size_t bytes) {
    CudaState *st = cuda_enter(ctx);
    if (!st || cuda_refuse_in_capture(ctx, st, "ops_malloc")) return NULL;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        cudaGetLastError();
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        ops_set_error(ctx, -1, __FILE__, __LINE__, "cudaMalloc of %zu bytes failed: %s (%zu of %zu bytes free)", bytes,
                      cudaGetErrorString(e), free_b, total_b);
        return NULL;
    }
    // Zero-filled per the contract. Synchronized so that the zeros are visible to any stream
    // (a communication stream may read this buffer before the compute stream touches it). On the main stream:
    // other threads allocate on this context too (the weight receiver) while the owner may be recording a graph.
    cudaError_t z = cudaMemsetAsync(p, 0, bytes, st->main_stream);
    if (z == cudaSuccess) z = cudaStreamSynchronize(st->main_stream);
    if (z != cudaSuccess) {
        cudaFree(p);
        ops_set_error(ctx, -1, __FILE__, __LINE__, "zero-filling %zu new device bytes failed: %s", bytes,
                      cudaGetErrorString(z));
        return NULL;
    }
    return p;
}

void cuda_free(OpsCtx *ctx, void *p) {
    CudaState *st = (CudaState *)ops_backend_state(ctx);
    if (!st || !p || cuda_refuse_in_capture(ctx, st, "ops_free")) return;
    cudaSetDevice(st->device);
    // Queued work may still read p: cudaFree waits for the device, so this is safe but slow; frees are
    // not on any per-step path (arenas are sized up front).
    cudaError_t e = cudaFree(p);
    if (e != cudaSuccess) ops_set_error(ctx, -1, __FILE__, __LINE__, "cudaFree failed: %s", cudaGetErrorString(e));
}

void cuda_memset_zero(OpsCtx *ctx, void *p, size_t bytes) {
    CudaState *st = cuda_enter(ctx);
    if (!st || !bytes) return;
    CUDA_CHECK(ctx, cudaMemsetAsync(p, 0, bytes, st->stream));
}

// Pageable host -> device: returns once the source has been staged, so the caller may reuse src at once.
void cuda_copy_to_device(OpsCtx *ctx, void *dst, const void *src_host, size_t bytes) {
    CudaState *st = cuda_enter(ctx);
    if (!st || !bytes || cuda_refuse_in_capture(ctx, st, "ops_copy_to_device (host memory)")) return;
    CUDA_CHECK(ctx, cudaMemcpyAsync(dst, src_host, bytes, cudaMemcpyHostToDevice, st->stream));
}

// Device -> host: waits for the copy (and so for all queued work), then reports kernel faults.
void cuda_copy_to_host(OpsCtx *ctx, void *dst_host, const void *src, size_t bytes) {
    CudaState *st = cuda_enter(ctx);
    if (!st || cuda_refuse_in_capture(ctx, st, "ops_copy_to_host")) return;
    if (bytes) CUDA_CHECK(ctx, cudaMemcpyAsync(dst_host, src, bytes, cudaMemcpyDeviceToHost, st->stream));
    CUDA_CHECK(ctx, cudaStreamSynchronize(st->stream));
    check_fault(ctx, st);
}

void cuda_copy(OpsCtx *ctx, void *dst, const void *src, size_t bytes) {
    CudaState *st = cuda_enter(ctx);
    if (!st || !bytes || dst == src) return;
    CUDA_CHECK(ctx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st->stream));
}

void cuda_copy_2d(OpsCtx *ctx, void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t rows,
                  size_t cols) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    const size_t es = sizeof(__nv_bfloat16);
    CUDA_CHECK(ctx, cudaMemcpy2DAsync(dst, dst_pitch * es, src, src_pitch * es, cols * es, rows,
                                      cudaMemcpyDeviceToDevice, st->stream));
}

// ---- fp32 <-> bf16 on the host ---------------------------------------------------------------------

static float host_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// fp32 bits -> bf16 bits on the device, by the host rule of shared/dtype.c (dtype_f32_to_bf16: round to nearest
// even, a NaN kept quiet with its top payload bits), so an upload gives the bits a host conversion gives.
__global__ void f32_bits_to_bf16_kernel(uint16_t *dst, const uint32_t *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint32_t u = src[i];
        dst[i] = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x0040u)
                                                 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

// src (n) fp32 host -> dst (n) bf16 device: each chunk of UPLOAD_CHUNK values is copied as it is into a device
// staging buffer and converted there by f32_bits_to_bf16_kernel. One stream orders each chunk's copy after the
// previous chunk's conversion, so nothing waits on the host between chunks; the host's share is the copy out of
// src (pageable: the driver stages it, at the link's rate), instead of a conversion loop with a wait every chunk.
// Returns once the data is on the device, like a cudaMemcpy.
void cuda_upload_f32(OpsCtx *ctx, void *dst, const float *src_host, size_t n) {
    CudaState *st = cuda_enter(ctx);
    if (!st || !n || cuda_refuse_in_capture(ctx, st, "ops_upload_f32")) return;
    if (!st->upload_f32) CUDA_CHECK(ctx, cudaMalloc(&st->upload_f32, UPLOAD_CHUNK * sizeof(uint32_t)));
    for (size_t off = 0; off < n; off += UPLOAD_CHUNK) {
        const size_t len = n - off < UPLOAD_CHUNK ? n - off : UPLOAD_CHUNK;
        CUDA_CHECK(ctx, cudaMemcpyAsync(st->upload_f32, src_host + off, len * sizeof(float), cudaMemcpyHostToDevice,
                                        st->stream));
        f32_bits_to_bf16_kernel<<<cuda_grid_1d(len, 256, st), 256, 0, st->stream>>>((uint16_t *)dst + off,
                                                                                   st->upload_f32, len);
        CUDA_CHECK_LAUNCH(ctx);
    }
    CUDA_CHECK(ctx, cudaStreamSynchronize(st->stream));
}

// src (n) bf16 device -> dst (n) fp32 host (exact: every bf16 is an fp32). Waits for queued work.
void cuda_download_f32(OpsCtx *ctx, float *dst_host, const void *src, size_t n) {
    CudaState *st = cuda_enter(ctx);
    if (!st || cuda_refuse_in_capture(ctx, st, "ops_download_f32")) return;
    if (!n) {
        cuda_synchronize(ctx);
        return;
    }
    uint16_t *stage = st->stage;
    for (size_t off = 0; off < n; off += CONVERT_CHUNK) {
        size_t len = n - off < CONVERT_CHUNK ? n - off : CONVERT_CHUNK;
        CUDA_CHECK(ctx, cudaMemcpyAsync(stage, (const uint16_t *)src + off, len * sizeof(uint16_t),
                                        cudaMemcpyDeviceToHost, st->stream));
        CUDA_CHECK(ctx, cudaStreamSynchronize(st->stream));
        for (size_t i = 0; i < len; i++) dst_host[off + i] = host_bf16_to_f32(stage[i]);
    }
    check_fault(ctx, st);
}
