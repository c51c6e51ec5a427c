// kernels/cpu/cpu_ops.h — the fp32 CPU backend: one function per op of kernels/ops.h, same semantics,
// every storage buffer is float. Called through kernels/ops.c; tests may call them directly as the oracle.
#ifndef TANDEM_KERNELS_CPU_OPS_H
#define TANDEM_KERNELS_CPU_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/index_hash.h"
#include "kernels/ops.h"

// Returns 0, or -1 when a token id is outside [0, V) (bad_index receives the offending row).
int cpu_embedding_fwd(float *out, const int32_t *tokens, const float *table, int N, int C, int V, int *bad_row);
int cpu_embedding_shard_fwd(float *out, const int32_t *tokens, const float *table, int N, int C, int begin, int rows,
                            int V, int *bad_row);
void cpu_embedding_bwd(float *dtable, const float *dout, const int32_t *tokens, int N, int C);

void cpu_rmsnorm_fwd(float *out, float *rstd, const float *x, const float *w, int N, int C, float eps);
void cpu_rmsnorm_bwd(float *dx, float *dw, const float *dout, const float *x, const float *w, const float *rstd,
                     int N, int C);
void cpu_residual_rmsnorm_fwd(float *x_out, float *out, float *rstd, const float *x, const float *residual,
                              const float *w, int N, int C, float eps);
void cpu_residual_rmsnorm_bwd(float *dres_out, float *dw, const float *dres_in, const float *dout, const float *x_out,
                              const float *w, const float *rstd, int N, int C);

void cpu_rope_fwd(float *x, const int32_t *positions, const float *inv_freq, int N, int H, int D);
void cpu_rope_bwd(float *dx, const int32_t *positions, const float *inv_freq, int N, int H, int D);
void cpu_qkv_rope_fwd(float *q, float *k, float *v, const float *qkv, const int32_t *positions,
                      const float *inv_freq, int N, int Hq, int Hkv, int D);
void cpu_qkv_rope_store_fwd(float *q, float *k_cache, float *v_cache, const int32_t *slot_mapping, const float *qkv,
                            const int32_t *positions, const float *inv_freq, int N, int Hq, int Hkv, int D);
void cpu_qkv_rope_bwd(float *dqkv, const float *dq, const float *dk, const float *dv, const int32_t *positions,
                      const float *inv_freq, int N, int Hq, int Hkv, int D);

void cpu_matmul_fwd(float *out, const float *in, const float *w, const float *bias, int N, int IC, int OC);
void cpu_matmul_fwd_batch_invariant(float *out, const float *in, const float *w, const float *bias, int N, int IC,
                                    int OC);
void cpu_matmul_bwd(float *din, float *dw, float *dbias, const float *dout, const float *in, const float *w,
                    int N, int IC, int OC, int din_accumulate);

void cpu_attention_fwd(float *out, float *lse, const float *q, const float *k, const float *v,
                       const int32_t *cu_seqlens, int B, int N, int Hq, int Hkv, int D, float scale);
void cpu_attention_bwd(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                       const float *v, const float *out, const float *lse, const int32_t *cu_seqlens, int B, int N,
                       int Hq, int Hkv, int D, float scale);
void cpu_kv_cache_store(float *k_cache, float *v_cache, const float *k, const float *v, const int32_t *slot_mapping,
                        int N, int Hkv, int D);
void cpu_attention_paged_fwd(float *out, const float *q, const float *k_cache, const float *v_cache,
                             const int32_t *block_tables, const int32_t *token_seq, const int32_t *token_pos, int N,
                             int Hq, int Hkv, int D, int block_size, int max_blocks, float scale);

void cpu_swiglu_fwd(float *out, const float *gu, int N, int inner);
void cpu_swiglu_bwd(float *dgu, const float *dout, const float *gu, int N, int inner);

void cpu_logprobs_fwd(float *logprobs, float *lse, float *entropy, const float *logits, const int32_t *targets,
                      int N, int V, float inv_temperature);
void cpu_logprobs_bwd(float *dlogits, const float *dlogprobs, const float *dentropy, const float *entropy,
                      const float *logits, const int32_t *targets,
                      const float *lse, int N, int V, float inv_temperature);

void cpu_adamw_step(float *master, float *m, float *v, const float *grad, float *param_out, size_t n, float lr,
                    float beta1, float beta2, float eps, float weight_decay, int step, float grad_scale);
void cpu_sum_squares(float *out, const float *x, size_t n);

// ops_sample_rows on fp32 logits. Returns 0, or -1 when scratch memory ran out (results then incomplete).
int cpu_sample_rows(int32_t *tokens, float *logprobs, const float *logits, const OpsSampleParams *params,
                    const int32_t *history, const int32_t *history_offsets, int n, int n_rows, int V, int n_history);

void cpu_add_inplace(float *y, const float *x, size_t n);
void cpu_add_f32(float *y, const float *x, size_t n);
void cpu_scale_inplace(float *x, float s, size_t n);
void cpu_dropout(float *out, const float *in, size_t n, float p, uint64_t seed);
// ops_dropout's keep threshold and its test: 1 when element i of the mask of `seed` is kept.
static inline int cpu_dropout_keep(uint64_t seed, size_t i, uint32_t threshold) {
    return index_hash24(seed, i) >= threshold;
}

// ops_peer_all_reduce's protocol (kernels/ops.h) over host memory: buf0/buf1/flags are every shard's, counter this
// shard's (slot 0 of each used). Returns 0, or -1 when shard *late did not arrive within timeout_s.
int cpu_peer_all_reduce(float *const *buf0, float *const *buf1, uint32_t *const *flags, uint32_t *counter, int rank,
                        int n, float *x, const float *residual, size_t count, double timeout_s, int *late);

#endif
