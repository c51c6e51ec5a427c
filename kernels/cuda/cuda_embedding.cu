// kernels/cuda/cuda_embedding.cu — token embedding lookup (bf16 rows copied) and its gradient scatter
// into an fp32 table gradient.
#include "kernels/cuda/cuda_common.cuh"

// out (N, C) = table (rows, C)[tokens - begin], the table holding vocabulary rows [begin, begin + rows) of V (the
// whole table: begin 0, rows V); one block per row. An id of another shard's rows gives a zero row. A token outside
// [0, V) zero-fills its row and records a fault that becomes a context error at the next synchronization (the host
// cannot check the ids without waiting for them).
__global__ void embedding_fwd_kernel(bf16 *out, const int32_t *tokens, const bf16 *table, int C, int begin, int rows,
                                     int V, int vec8, CudaFault *fault) {
    const int n = blockIdx.x;
    const int tok = tokens[n];
    bf16 *dst = out + (size_t)n * C;
    if (tok < 0 || tok >= V || tok < begin || tok >= begin + rows) {
        if (threadIdx.x == 0 && (tok < 0 || tok >= V)) cuda_fault(fault, CUDA_FAULT_EMBEDDING_TOKEN, n, tok, V);
        for (int c = threadIdx.x; c < C; c += blockDim.x) dst[c] = f2bf(0.0f);
        return;
    }
    const bf16 *src = table + (size_t)(tok - begin) * C;
    if (vec8) {  // C % 8 == 0 and both bases 16-byte aligned
        for (int c = threadIdx.x; c < C / 8; c += blockDim.x)
            reinterpret_cast<uint4 *>(dst)[c] = reinterpret_cast<const uint4 *>(src)[c];
    } else {
        for (int c = threadIdx.x; c < C; c += blockDim.x) dst[c] = src[c];
    }
}

// dtable (V, C) fp32 += dout (N, C) scattered by tokens; rows repeat when tokens repeat, hence atomics
// (fp32 atomic order makes the last bits run-dependent, within the bf16 tolerance the design allows).
// A negative id is skipped, as on the CPU (V is not known here; the forward validated the ids).
__global__ void embedding_bwd_kernel(float *dtable, const bf16 *dout, const int32_t *tokens, int C) {
    const int n = blockIdx.x;
    const int tok = tokens[n];
    if (tok < 0) return;
    float *dst = dtable + (size_t)tok * C;
    const bf16 *src = dout + (size_t)n * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) atomicAdd(dst + c, bf2f(src[c]));
}

void cuda_embedding_shard_fwd(OpsCtx *ctx, void *out, const int32_t *tokens, const void *table, int N, int C, int begin,
                              int rows, int V) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    CUDA_ARG_CHECK(ctx, N >= 0 && C >= 0 && V > 0 && begin >= 0 && rows >= 0,
                   "embedding_fwd: bad shape N=%d C=%d rows [%d, +%d) of V=%d", N, C, begin, rows, V);
    if (N == 0 || C == 0) return;
    int vec8 = C % 8 == 0 && (((uintptr_t)out | (uintptr_t)table) & 15) == 0;
    int threads = (vec8 ? C / 8 : C) >= 256 ? 256 : 128;
    embedding_fwd_kernel<<<N, threads, 0, st->stream>>>((bf16 *)out, tokens, (const bf16 *)table, C, begin, rows, V,
                                                         vec8, st->fault_dev);
    CUDA_CHECK_LAUNCH(ctx);
    st->fault_armed = 1;
}

void cuda_embedding_fwd(OpsCtx *ctx, void *out, const int32_t *tokens, const void *table, int N, int C, int V) {
    cuda_embedding_shard_fwd(ctx, out, tokens, table, N, C, 0, V, V);
}

void cuda_embedding_bwd(OpsCtx *ctx, float *dtable, const void *dout, const int32_t *tokens, int N, int C) {
    CudaState *st = cuda_enter(ctx);
    if (!st) return;
    CUDA_ARG_CHECK(ctx, N >= 0 && C >= 0, "embedding_bwd: bad shape N=%d C=%d", N, C);
    if (N == 0 || C == 0) return;
    embedding_bwd_kernel<<<N, 256, 0, st->stream>>>(dtable, (const bf16 *)dout, tokens, C);
    CUDA_CHECK_LAUNCH(ctx);
}
