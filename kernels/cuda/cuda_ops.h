// kernels/cuda/cuda_ops.h — the CUDA backend (bf16 storage, fp32 accumulate). Each function mirrors the
// op of the same name in kernels/ops.h (cuda_X <-> ops_X) with identical arguments; kernels/ops.c dispatches.
// Errors are recorded in the context with ops_set_error (file:line of the failing CUDA/cuBLAS call).
#ifndef TANDEM_KERNELS_CUDA_OPS_H
#define TANDEM_KERNELS_CUDA_OPS_H

#include "kernels/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

// Backend state (stream, cuBLAS(Lt) handle, workspace) hangs off the context; settings checked by the caller.
int cuda_state_create(OpsCtx *ctx, int device, const OpsSettings *settings, void **state, char *err, size_t err_len);
void cuda_state_destroy(void *state);
int cuda_device_count(void);
// Per-op timing (kernels/cuda/cuda_profile.cu): begin returns a slot (-1 when profiling is off).
int cuda_profile_begin(OpsCtx *ctx);
void cuda_profile_end(OpsCtx *ctx, int slot, const char *name);
void cuda_profile_print(OpsCtx *ctx);
int cuda_set_gemm_tuning(OpsCtx *ctx, int allowed);

void *cuda_malloc(OpsCtx *ctx, size_t bytes);
void cuda_free(OpsCtx *ctx, void *p);
void cuda_memset_zero(OpsCtx *ctx, void *p, size_t bytes);
void cuda_copy_to_device(OpsCtx *ctx, void *dst, const void *src_host, size_t bytes);
void cuda_copy_to_host(OpsCtx *ctx, void *dst_host, const void *src, size_t bytes);
void cuda_copy(OpsCtx *ctx, void *dst, const void *src, size_t bytes);
// Pitches and cols in storage (bf16) elements; see ops_copy_2d.
void cuda_copy_2d(OpsCtx *ctx, void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t rows,
                  size_t cols);
// Items checked by ops_copy_2d_batch (kernels/cuda/cuda_elementwise.cu).
void cuda_copy_2d_batch(OpsCtx *ctx, const OpsCopy2D *items, int n);
void cuda_fill_hashed_uniform(OpsCtx *ctx, void *dst, size_t rows, size_t cols, uint64_t first, size_t index_pitch,
                              uint64_t seed, float scale);
void cuda_upload_f32(OpsCtx *ctx, void *dst, const float *src_host, size_t n);
void cuda_download_f32(OpsCtx *ctx, float *dst_host, const void *src, size_t n);
void cuda_synchronize(OpsCtx *ctx);
// ops_peer_all_reduce (kernels/cuda/cuda_peer_all_reduce.cu); arguments checked by kernels/ops.c.
void cuda_peer_all_reduce(OpsCtx *ctx, void *const *buf0, void *const *buf1, uint32_t *const *flags, uint32_t *counter,
                          int rank, int n, void *x, const void *residual, size_t count, double timeout_s);
// Peer access between the devices of every pair of ctxs (ops_peer_group_create). Returns 0 or -1 with a message.
int cuda_peer_enable(OpsCtx *const *ctxs, int n, char *err, size_t err_len);
// Unlike the others it returns its error (kernels/cuda/cuda_peer.cu; see ops_copy_peer).
int cuda_copy_peer(OpsCtx *dst_ctx, void *dst, OpsCtx *src_ctx, const void *src, size_t bytes, char *err,
                   size_t err_len);

void cuda_add_inplace(OpsCtx *ctx, void *y, const void *x, size_t n);
void cuda_add_f32(OpsCtx *ctx, float *y, const float *x, size_t n);
void cuda_scale_inplace(OpsCtx *ctx, void *x, float s, size_t n);
void cuda_dropout(OpsCtx *ctx, void *out, const void *in, size_t n, float p, uint64_t seed);
void cuda_embedding_fwd(OpsCtx *ctx, void *out, const int32_t *tokens, const void *table, int N, int C, int V);
void cuda_embedding_shard_fwd(OpsCtx *ctx, void *out, const int32_t *tokens, const void *table, int N, int C, int begin,
                              int rows, int V);
void cuda_embedding_bwd(OpsCtx *ctx, float *dtable, const void *dout, const int32_t *tokens, int N, int C);
void cuda_rmsnorm_fwd(OpsCtx *ctx, void *out, float *rstd, const void *x, const void *w, int N, int C, float eps);
void cuda_rmsnorm_bwd(OpsCtx *ctx, void *dx, float *dw, const void *dout, const void *x, const void *w,
                      const float *rstd, int N, int C);
void cuda_residual_rmsnorm_fwd(OpsCtx *ctx, void *x_out, void *out, float *rstd, const void *x, const void *residual,
                               const void *w, int N, int C, float eps);
void cuda_residual_rmsnorm_bwd(OpsCtx *ctx, void *dres_out, float *dw, const void *dres_in, const void *dout,
                               const void *x_out, const void *w, const float *rstd, int N, int C);
void cuda_rope_fwd(OpsCtx *ctx, void *x, const int32_t *positions, const float *inv_freq, int N, int H, int D);
void cuda_rope_bwd(OpsCtx *ctx, void *dx, const int32_t *positions, const float *inv_freq, int N, int H, int D);
void cuda_qkv_rope_fwd(OpsCtx *ctx, void *q, void *k, void *v, const void *qkv, const int32_t *positions,
                       const float *inv_freq, int N, int Hq, int Hkv, int D);
void cuda_qkv_rope_store_fwd(OpsCtx *ctx, void *q, void *k_cache, void *v_cache, const int32_t *slot_mapping,
                             const void *qkv, const int32_t *positions, const float *inv_freq, int N, int Hq, int Hkv,
                             int D);
void cuda_qkv_rope_bwd(OpsCtx *ctx, void *dqkv, const void *dq, const void *dk, const void *dv,
                       const int32_t *positions, const float *inv_freq, int N, int Hq, int Hkv, int D);
void cuda_matmul_fwd(OpsCtx *ctx, void *out, const void *in, const void *w, const void *bias, int N, int IC, int OC);
// ops_matmul_fused_fwd as one kernel (cuda_gemv.cu) when it takes the shapes: returns 1 (done, errors recorded), or
// 0 having done nothing (the caller runs the unfused sequence).
int cuda_matmul_fused_fwd(OpsCtx *ctx, void *out, const void *in, const void *w, const void *bias, int N, int IC,
                          int OC, const OpsProjFusion *f);
void cuda_matmul_bwd(OpsCtx *ctx, void *din, float *dw, float *dbias, const void *dout, const void *in,
                     const void *w, int N, int IC, int OC, int din_accumulate);
void cuda_attention_fwd(OpsCtx *ctx, void *out, float *lse, const void *q, const void *k, const void *v,
                        const int32_t *cu_seqlens, int B, int N, int Hq, int Hkv, int D, float scale);
void cuda_attention_bwd(OpsCtx *ctx, void *dq, void *dk, void *dv, const void *dout, const void *q,
                        const void *k, const void *v, const void *out, const float *lse,
                        const int32_t *cu_seqlens, int B, int N, int Hq, int Hkv, int D, float scale);
void cuda_kv_cache_store(OpsCtx *ctx, void *k_cache, void *v_cache, const void *k, const void *v,
                         const int32_t *slot_mapping, int N, int Hkv, int D);
void cuda_attention_paged_fwd(OpsCtx *ctx, void *out, const void *q, const void *k_cache, const void *v_cache,
                              const int32_t *block_tables, const int32_t *token_seq, const int32_t *token_pos,
                              int N, int Hq, int Hkv, int D, int block_size, int max_blocks, float scale);
void cuda_attention_paged_decode_fwd(OpsCtx *ctx, void *out, void *q, void *k_cache, void *v_cache,
                                     const int32_t *slot_mapping, const void *qkv, const int32_t *block_tables,
                                     const int32_t *token_seq, const int32_t *token_pos, const float *inv_freq, int N,
                                     int Hq, int Hkv, int D, int block_size, int max_blocks, float scale);
void cuda_swiglu_fwd(OpsCtx *ctx, void *out, const void *gu, int N, int inner);
void cuda_swiglu_bwd(OpsCtx *ctx, void *dgu, const void *dout, const void *gu, int N, int inner);
void cuda_logprobs_fwd(OpsCtx *ctx, float *logprobs, float *lse, float *entropy, const void *logits,
                       const int32_t *targets, int N, int V, float inv_temperature);
void cuda_logprobs_bwd(OpsCtx *ctx, void *dlogits, const float *dlogprobs, const float *dentropy,
                       const float *entropy, const void *logits,
                       const int32_t *targets, const float *lse, int N, int V, float inv_temperature);
void cuda_sample_rows(OpsCtx *ctx, int32_t *tokens, float *logprobs, const void *logits, const OpsSampleParams *params,
                      const int32_t *history, const int32_t *history_offsets, int n, int n_rows, int V, int n_history);
void cuda_adamw_step(OpsCtx *ctx, float *master, float *m, float *v, const float *grad, void *param_out, size_t n,
                     float lr, float beta1, float beta2, float eps, float weight_decay, int step, float grad_scale);
void cuda_sum_squares(OpsCtx *ctx, float *out, const float *x, size_t n);

// Graphs (kernels/cuda/cuda_graph.cu): mirror ops_graph_* in kernels/ops.h.
int cuda_graph_supported(OpsCtx *ctx);
int cuda_graph_begin(OpsCtx *ctx);
int cuda_graph_end(OpsCtx *ctx, OpsGraph **graph);
int cuda_graph_launch(OpsCtx *ctx, OpsGraph *graph);
void cuda_graph_destroy(OpsCtx *ctx, OpsGraph *graph);

// The backend state stored in the context (for use inside kernels/cuda only).
void *ops_backend_state(OpsCtx *ctx);

#ifdef __cplusplus
}
#endif
#endif
