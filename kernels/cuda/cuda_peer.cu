// kernels/cuda/cuda_peer.cu — ops_copy_peer on CUDA: bytes from one context's device to another's, on a stream
// made for the call. The caller is a thread that owns neither context (the rollout server's weight receiver), so
// nothing here touches the contexts' streams, scratch or error state: only their device indices are read.
#include <stdio.h>

#include <cuda_runtime.h>

#include "kernels/cuda/cuda_ops.h"

#define PEER_CHECK(call)                                                                                    \
    do {                                                                                                    \
        cudaError_t peer_e_ = (call);                                                                       \
        if (peer_e_ != cudaSuccess) {                                                                       \
            snprintf(err, err_len, "%s:%d: %s: %s", __FILE__, __LINE__, #call, cudaGetErrorString(peer_e_)); \
            cudaGetLastError();                                                                             \
            goto done;                                                                                      \
        }                                                                                                   \
    } while (0)

extern "C" int cuda_copy_peer(OpsCtx *dst_ctx, void *dst, OpsCtx *src_ctx, const void *src, size_t bytes, char *err,
                              size_t err_len) {
    const int dst_dev = ops_cuda_device(dst_ctx), src_dev = ops_cuda_device(src_ctx);
    int prev = -1, can = 0, rc = -1;
    cudaStream_t stream = NULL;
    cudaError_t e;
    if (dst_dev < 0 || src_dev < 0) {
        snprintf(err, err_len, "peer copy: a context without a CUDA device");
        return -1;
    }
    PEER_CHECK(cudaGetDevice(&prev));
    PEER_CHECK(cudaSetDevice(dst_dev));
    if (dst_dev != src_dev) {
        // Direct access makes the copy one DMA over NVLink / PCIe instead of a bounce through host memory.
        // Enabling it once per device pair lasts for the process; a second time only says it is enabled.
        PEER_CHECK(cudaDeviceCanAccessPeer(&can, dst_dev, src_dev));
        if (can) {
            e = cudaDeviceEnablePeerAccess(src_dev, 0);
            if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
            else PEER_CHECK(e);
        }
    }
    PEER_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    PEER_CHECK(cudaMemcpyPeerAsync(dst, dst_dev, src, src_dev, bytes, stream));
    PEER_CHECK(cudaStreamSynchronize(stream));
    rc = 0;
done:
    if (stream) cudaStreamDestroy(stream);
    if (prev >= 0) cudaSetDevice(prev);
    return rc;
}
