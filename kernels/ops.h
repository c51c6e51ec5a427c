// kernels/ops.h — the compute primitives tandem's model is written against.
//
// Two backends sit behind these calls:
//   cpu  : fp32 storage and math (OpenBLAS for GEMM). The reference ("oracle") for everything else.
//   cuda : bf16 storage, fp32 accumulation, one compute stream per context (kernels/cuda/).
//
// Buffer conventions (every op):
//   void *         "storage" buffer: parameters, activations and activation gradients in the backend's
//                  storage dtype (fp32 on cpu, bf16 on cuda). Its element size is ops_dtype_size(ctx).
//   float *        always fp32: parameter gradients, master weights, Adam moments, softmax statistics,
//                  per-token logprobs, losses.
//   int32_t *      token ids, positions, sequence offsets, block tables.
// All pointers are backend memory (host memory on cpu, device memory on cuda), allocated with ops_malloc.
// Shapes are given in comments as (rows, cols) with the last index fastest (row-major).
//
// Errors: ops never exit(). The first failure (CUDA error, bad argument, out of memory) is recorded in the
// context with file:line and every later op becomes a no-op until ops_clear_error; callers check
// ops_status() at the points where they can react (after a layer, a step, a request).
#ifndef TANDEM_KERNELS_OPS_H
#define TANDEM_KERNELS_OPS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { OPS_BACKEND_CPU = 0, OPS_BACKEND_CUDA = 1 } OpsBackend;

typedef struct OpsCtx OpsCtx;

// ---- context, memory, errors ------------------------------------------------------------------

// A context's settings, fixed when it is created; kernels/cuda/README.md lists each with its default and who sets
// it. A zeroed OpsSettings holds the defaults. The cpu backend has no settings of its own and ignores them.
typedef enum {
    OPS_GEMM_AUTOTUNE_ON = 0,   // cuda: a GEMM shape met for the first time has cuBLASLt's candidate algorithms
                                // timed on the spot and keeps the fastest (kernels/cuda/cuda_matmul.cu)
    OPS_GEMM_AUTOTUNE_OFF = 1,  // every shape keeps the heuristic's first pick, which depends on the shape alone: two
                                // processes then run the same algorithms and their GEMMs agree bit for bit
    OPS_GEMM_AUTOTUNE_LOG = 2,  // on, with one line per decision on stderr
} OpsGemmAutotune;
typedef struct {
    OpsGemmAutotune gemm_autotune;
    int gemm_workspace_mib;     // cuda: the cuBLASLt workspace in MiB, 1..4096; 0: 32 (NVIDIA's advice for Hopper)
    int profile_ops;            // cuda: 1 times every op with events for ops_profile_print; graphs cannot be recorded
                                // meanwhile (ops_graph_supported is 0)
} OpsSettings;

// Creates a context on `backend` (device index for cuda) with the default settings. Returns 0, or a negative code
// with a message in err.
int ops_create(OpsCtx **out, OpsBackend backend, int device, char *err, size_t err_len);
// The same with the given settings (NULL: the defaults); settings out of range are refused.
int ops_create_with_settings(OpsCtx **out, OpsBackend backend, int device, const OpsSettings *settings, char *err,
                             size_t err_len);
// Reads an OpsGemmAutotune from text, as a binary's option or environment variable gives it: "1" or "on", "0" or
// "off", "2" or "log". Returns 0, or -1 (and *out unchanged) for other text.
int ops_gemm_autotune_parse(const char *text, OpsGemmAutotune *out);
void ops_destroy(OpsCtx *ctx);
OpsBackend ops_backend(const OpsCtx *ctx);
int ops_backend_available(OpsBackend backend); // 1 if compiled in and (for cuda) a device is visible
int ops_cuda_device_count(void);                // visible CUDA devices; 0 in a CPU build or without a driver
// cuda, on a context created with profile_ops: prints the GPU time of each op since the last print to stderr
// (largest first) and starts over. Otherwise does nothing.
void ops_profile_print(OpsCtx *ctx);
// cuda: whether a GEMM shape met for the first time may be autotuned (its candidate algorithms timed on the spot;
// kernels/cuda/cuda_matmul.cu). Allowed by default; a context created with OPS_GEMM_AUTOTUNE_OFF never tunes,
// whatever this says. Callers whose shapes rarely recur — a server's prefill steps, one token count each — pause
// it around them, so that no step pays for timing candidates of a shape it will not meet again. Returns the
// previous setting. cpu: no effect.
int ops_set_gemm_tuning(OpsCtx *ctx, int allowed);
size_t ops_dtype_size(const OpsCtx *ctx);      // bytes per storage element: 4 (cpu) or 2 (cuda)

int ops_status(const OpsCtx *ctx);             // 0 or the first recorded negative error code
const char *ops_error(const OpsCtx *ctx);      // message of the first error ("" if none)
void ops_clear_error(OpsCtx *ctx);
// Records an error (used by the backends; first one wins). Returns the code.
int ops_set_error(OpsCtx *ctx, int code, const char *file, int line, const char *fmt, ...);

void *ops_malloc(OpsCtx *ctx, size_t bytes);   // zero-filled; NULL (and an error recorded) on failure
void ops_free(OpsCtx *ctx, void *p);
void ops_memset_zero(OpsCtx *ctx, void *p, size_t bytes);
void ops_copy_to_device(OpsCtx *ctx, void *dst, const void *src_host, size_t bytes);
void ops_copy_to_host(OpsCtx *ctx, void *dst_host, const void *src, size_t bytes);
void ops_copy(OpsCtx *ctx, void *dst, const void *src, size_t bytes);
// Strided copy of a (rows, cols) block of storage elements between backend buffers: row r of dst (cols elements
// from dst + r * dst_pitch) = row r of src (from src + r * src_pitch); pitches in elements, each >= cols. Splits a
// fused projection's output (N, QD + 2 KVD) into q, k, v, and packs their gradients back. dst and src must not
// overlap. cuda: cudaMemcpy2DAsync on the context's stream (recordable in a graph); cpu: a row loop.
void ops_copy_2d(OpsCtx *ctx, void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t rows,
                 size_t cols);
// Many such strided copies at once, each optionally scaled: item k copies its (rows, cols) block as ops_copy_2d
// does and, with scale != 1, multiplies each element by scale in fp32 and rounds it once to the storage dtype (as
// ops_scale_inplace), so a copy then a scale of the same block gives the same bits. Blocks must not overlap one
// another or their sources. Builds the rollout server's serving copy of LoRA adapters (shared/model_lora.c): a few
// hundred small blocks per update, which one launch per 64 items moves instead of one each.
typedef struct {
    void *dst;
    const void *src;
    size_t dst_pitch, src_pitch, rows, cols;   // in storage elements, as ops_copy_2d
    float scale;                               // 1: a plain copy of the bits
} OpsCopy2D;
void ops_copy_2d_batch(OpsCtx *ctx, const OpsCopy2D *items, int n);
// Fills a contiguous (rows, cols) block of storage elements with values that are a function of each element's index
// alone: element (r, c) has index i = first + r * index_pitch + c and value scale * (u / 2^23 - 1), u =
// index_hash24(seed, i) (kernels/index_hash.h, ops_dropout's hash) — uniform in [-scale, scale). Any block of a
// tensor filled with its own indices equals that block of the whole tensor filled at once, which is how the rollout
// server's --load-format random gives every tensor-parallel shard its slice of one random model. u / 2^23 - 1 is exact in
// fp32, then one multiply; bf16 rounds that once (to nearest even), so both backends store the same bits.
void ops_fill_hashed_uniform(OpsCtx *ctx, void *dst, size_t rows, size_t cols, uint64_t first, size_t index_pitch,
                             uint64_t seed, float scale);
// fp32 host array <-> storage-dtype backend buffer (conversion with round-to-nearest-even on cuda).
void ops_upload_f32(OpsCtx *ctx, void *dst, const float *src_host, size_t n);
void ops_download_f32(OpsCtx *ctx, float *dst_host, const void *src, size_t n);
// Waits for all queued work (a no-op on cpu).
void ops_synchronize(OpsCtx *ctx);
// cuda: the context's device index and its compute stream (a cudaStream_t), for code that queues work beside
// the ops and orders itself against them with events (shared/comm/comm.h's nccl backend). cpu: -1 and NULL.
int ops_cuda_device(const OpsCtx *ctx);
void *ops_cuda_stream(OpsCtx *ctx);
// cuda: while the calling thread records a graph on ctx (ops_graph_begin .. ops_graph_end), the stream that recording
// captures (a cudaStream_t: the ops queue there instead of on the compute stream), for code that queues its own work
// into the recording in order with the ops (shared/comm/comm.h's nccl backend, "CUDA graphs"); NULL when this
// thread records nothing on ctx. cpu: NULL.
void *ops_cuda_recording_stream(OpsCtx *ctx);
// cuda: free and total bytes of the context's device (cudaMemGetInfo), returns 0. cpu: -1 (no device memory).
int ops_memory_info(OpsCtx *ctx, size_t *free_bytes, size_t *total_bytes);
// Copies `bytes` of backend memory from src (a buffer of src_ctx) to dst (a buffer of dst_ctx), which may live on
// another device: cuda peer copy (NVLink or PCIe, direct where the two devices can reach each other), cpu memcpy.
// For a thread that owns neither context (the rollout server's weight receiver, while the engines generate): it
// runs on a stream of its own, neither waiting for nor disturbing the work queued on the contexts' streams, so
// the caller sees to it that none of that work writes src or touches dst; it leaves the contexts' error state
// alone. Returns once the bytes are at dst: 0, or -1 with a message in err. Both contexts are of one backend.
int ops_copy_peer(OpsCtx *dst_ctx, void *dst, OpsCtx *src_ctx, const void *src, size_t bytes, char *err,
                  size_t err_len);

// ---- elementwise ------------------------------------------------------------------------------

// y += x over n storage elements (residual stream, gradient merge).
void ops_add_inplace(OpsCtx *ctx, void *y, const void *x, size_t n);

// y += x over n fp32 elements (gradient accumulation).
void ops_add_f32(OpsCtx *ctx, float *y, const float *x, size_t n);

// x *= s over n storage elements, the product rounded to the storage dtype once (the LoRA scale alpha / r on the
// adapter's (N, r) intermediate, forward and backward: shared/model_lora.c).
void ops_scale_inplace(OpsCtx *ctx, void *x, float s, size_t n);

// Inverted dropout with a mask that is a function of (seed, element index) alone, so that the backward (and an
// activation-checkpoint recompute) regenerates the forward's mask instead of storing it:
//   out[i] = keep(seed, i) ? in[i] / (1 - p) : 0      over n storage elements, in place allowed (out == in)
// keep(seed, i): index_hash24(seed, i) (kernels/index_hash.h) >= p * 2^24
// (rounded to the nearest integer): the drop probability is p to within 2^-24. p in [0, 1).
void ops_dropout(OpsCtx *ctx, void *out, const void *in, size_t n, float p, uint64_t seed);

// ---- embedding --------------------------------------------------------------------------------

// out (N, C) = table[tokens[i]] ; table (V, C). A token outside [0, V) records an error.
void ops_embedding_fwd(OpsCtx *ctx, void *out, const int32_t *tokens, const void *table, int N, int C, int V);
// Tensor-parallel shard of the lookup: table (rows, C) holds vocabulary rows [begin, begin + rows) of a V-row
// embedding; out row i = table[tokens[i] - begin] when the id falls in those rows, zeros otherwise (another shard
// has it: the shards' outputs add up to the whole lookup). A token outside [0, V) records an error.
void ops_embedding_shard_fwd(OpsCtx *ctx, void *out, const int32_t *tokens, const void *table, int N, int C, int begin,
                             int rows, int V);
// dtable (V, C) fp32 += scatter of dout (N, C) by tokens.
void ops_embedding_bwd(OpsCtx *ctx, float *dtable, const void *dout, const int32_t *tokens, int N, int C);

// ---- RMSNorm ----------------------------------------------------------------------------------

// out (N, C) = x * rsqrt(mean(x^2) + eps) * w ; w (C). rstd (N) fp32 receives rsqrt(...) (may be NULL).
void ops_rmsnorm_fwd(OpsCtx *ctx, void *out, float *rstd, const void *x, const void *w, int N, int C, float eps);
// dx (N, C) += d/dx ; dw (C) fp32 += d/dw ; rstd from the forward.
void ops_rmsnorm_bwd(OpsCtx *ctx, void *dx, float *dw, const void *dout, const void *x, const void *w,
                     const float *rstd, int N, int C);

// Residual add fused into the RMSNorm that follows it, in one pass over memory:
//   x_out (N, C) = x + residual          the residual-stream update, rounded to the storage dtype once
//   out   (N, C) = rmsnorm(x_out) * w    computed from the stored (rounded) x_out
// so the results equal ops_add_inplace(x, residual) followed by ops_rmsnorm_fwd on it, bit for bit.
// x_out may alias x or residual (never out). residual NULL: a plain RMSNorm of x (x_out is not written and may
// be NULL) — the same kernel, so a plain norm of a stored x_out repeats the fused op's out and rstd exactly.
// w (C); rstd (N) fp32 receives rsqrt(mean(x_out^2) + eps) (may be NULL).
void ops_residual_rmsnorm_fwd(OpsCtx *ctx, void *x_out, void *out, float *rstd, const void *x, const void *residual,
                              const void *w, int N, int C, float eps);
// Its backward. x and residual have the same gradient: the residual stream's gradient from above (d x_out) plus
// the norm's input gradient, merged in one pass:
//   dres_out (N, C) = dres_in + d rmsnorm(x_out)/d x_out (dout)      dres_in NULL: zero (dres_out overwritten)
//   dw (C) fp32 += d/dw (dw may be NULL)
// dres_out may alias dres_in. x_out and rstd are the forward's. ops_rmsnorm_bwd is this op with dres_in = dx.
void ops_residual_rmsnorm_bwd(OpsCtx *ctx, void *dres_out, float *dw, const void *dres_in, const void *dout,
                              const void *x_out, const void *w, const float *rstd, int N, int C);

// ---- rotary embedding (Hugging Face "rotate_half" convention) ---------------------------------

// In place on x (N, H, D): pairs (i, i + D/2) rotate by angle positions[n] * inv_freq[i], i < D/2.
// inv_freq (D/2) fp32 carries any rope_scaling (see shared/config.h: config_rope_inv_freq).
void ops_rope_fwd(OpsCtx *ctx, void *x, const int32_t *positions, const float *inv_freq, int N, int H, int D);
// In place on dx (N, H, D): the transpose of the forward rotation.
void ops_rope_bwd(OpsCtx *ctx, void *dx, const int32_t *positions, const float *inv_freq, int N, int H, int D);

// The fused q/k/v projection's split and RoPE in one pass (models without qk_norm): with QD = Hq*D, KVD = Hkv*D,
// qkv (N, QD + 2 KVD) = [q | k | v] per row,
//   q (N, Hq, D) = rope_fwd(qkv[:, :QD]) ; k (N, Hkv, D) = rope_fwd(qkv[:, QD:QD+KVD]) ; v = qkv[:, QD+KVD:]
// the same values, bit for bit, as three ops_copy_2d followed by ops_rope_fwd on q and on k. q, k, v must not
// overlap qkv.
void ops_qkv_rope_fwd(OpsCtx *ctx, void *q, void *k, void *v, const void *qkv, const int32_t *positions,
                      const float *inv_freq, int N, int Hq, int Hkv, int D);
// The same for a paged KV cache (decode and prefill chunks): q as above, while k (rotated) and v go straight to the
// cache rows slot_mapping[n] (n_slots, Hkv, D), skipped for negative slots — bit for bit ops_qkv_rope_fwd followed
// by ops_kv_cache_store, with no k, v buffers in between.
void ops_qkv_rope_store_fwd(OpsCtx *ctx, void *q, void *k_cache, void *v_cache, const int32_t *slot_mapping,
                            const void *qkv, const int32_t *positions, const float *inv_freq, int N, int Hq, int Hkv,
                            int D);
// Its backward, the gradients packed for the fused projection's GEMM:
//   dqkv (N, QD + 2 KVD) = [rope_bwd(dq) | rope_bwd(dk) | dv]
// bit for bit ops_rope_bwd on dq and dk followed by three ops_copy_2d, except that dq and dk are left as they were.
// dq (N, Hq, D), dk, dv (N, Hkv, D) must not overlap dqkv.
void ops_qkv_rope_bwd(OpsCtx *ctx, void *dqkv, const void *dq, const void *dk, const void *dv, const int32_t *positions,
                      const float *inv_freq, int N, int Hq, int Hkv, int D);

// ---- GEMM -------------------------------------------------------------------------------------

// out (N, OC) = in (N, IC) @ w^T + bias ; w (OC, IC) as stored by PyTorch's Linear; bias (OC) or NULL.
void ops_matmul_fwd(OpsCtx *ctx, void *out, const void *in, const void *w, const void *bias, int N, int IC, int OC);
// The same product with each output row a function of its own input row alone: the same bits whatever N, the row's
// place among the N rows and the thread count. The rollout server's forward (shared/model_decode.c) uses it, so that
// a sequence's logits do not depend on which sequences share its step (continuous batching decides that by timing).
// cpu: every dot product in one fixed order (kernels/cpu/cpu_matmul_batch_invariant.c; faster than OpenBLAS for a
// few rows, slower for many: training keeps ops_matmul_fwd). cuda: ops_matmul_fwd, which does not promise this
// (cuBLASLt may take another kernel for another N); the GPU server pads its decode steps to fixed sizes instead.
void ops_matmul_fwd_batch_invariant(OpsCtx *ctx, void *out, const void *in, const void *w, const void *bias, int N,
                                    int IC, int OC);
// din (N, IC) = dout @ w (or += when din_accumulate) — skipped when din is NULL;
// dw (OC, IC) fp32 += dout^T @ in — skipped when dw is NULL; dbias (OC) fp32 += column sums — skipped when NULL.
void ops_matmul_bwd(OpsCtx *ctx, void *din, float *dw, float *dbias, const void *dout, const void *in,
                    const void *w, int N, int IC, int OC, int din_accumulate);

// A forward projection with its neighbours fused, for decode steps of a row or two, where every kernel launch is a
// visible share of the step (shared/model_layer.c layer_decode_small). With f's fields:
//   norm_w != NULL: the input rows are RMS-normalised first, in_n = rmsnorm(in) * norm_w (eps), as ops_rmsnorm_fwd;
//                   h (N, IC) is scratch for it (written where the backend materialises in_n);
//   swiglu: w is the fused [gate; up] (OC = 2I rows) and out (N, I) = silu(g) * u of the projection rounded to the
//                   storage dtype, as the GEMM then ops_swiglu_fwd; gu (N, OC) is scratch for it;
//   residual != NULL: out (N, OC) = the projection rounded to the storage dtype + residual (N, OC), rounded again,
//                   as the GEMM then ops_add_inplace (out must not be the residual). Not with swiglu.
//   rope_store:     w is the fused q|k|v projection (OC = (Hq + 2 Hkv) D); its output rounded to the storage dtype is
//                   split, q and k turned by RoPE at positions (N) with inv_freq, q written to out (N, Hq, D), k and
//                   v to row slot_mapping[i] of k_cache / v_cache (n_slots, Hkv, D; nowhere when negative), as
//                   the GEMM into qkv (N, OC, scratch) then ops_qkv_rope_store_fwd. Not with swiglu or residual.
// Otherwise the GEMM alone. The GEMM is ops_matmul_fwd_batch_invariant (these are decode steps). Every backend
// computes the unfused sequence's values; the CUDA one runs the sequence as one kernel where cuda_gemv.cu takes the
// shapes (1-2 rows), and may then differ in the last bits (the norm's sum of squares is taken in another order).
typedef struct {
    const void *norm_w;
    float eps;
    void *h;
    int swiglu;
    void *gu;
    const void *residual;
    int rope_store;
    void *qkv;
    const int32_t *positions, *slot_mapping;
    const float *inv_freq;
    void *k_cache, *v_cache;
    int Hq, Hkv, D;
} OpsProjFusion;
void ops_matmul_fused_fwd(OpsCtx *ctx, void *out, const void *in, const void *w, const void *bias, int N, int IC,
                          int OC, const OpsProjFusion *f);

// ---- attention --------------------------------------------------------------------------------

// Training attention over B packed sequences (no padding): sequence b holds tokens
// [cu_seqlens[b], cu_seqlens[b+1]); each token attends causally within its own sequence.
// q, out (N, Hq, D); k, v (N, Hkv, D); Hq % Hkv == 0 (GQA: query head h reads kv head h / (Hq/Hkv)).
// lse (N, Hq) fp32 receives the log-sum-exp of the scaled scores (the only statistic backward needs).
void ops_attention_fwd(OpsCtx *ctx, void *out, float *lse, const void *q, const void *k, const void *v,
                       const int32_t *cu_seqlens, int B, int N, int Hq, int Hkv, int D, float scale);
// dq (N, Hq, D), dk, dv (N, Hkv, D) are overwritten.
void ops_attention_bwd(OpsCtx *ctx, void *dq, void *dk, void *dv, const void *dout, const void *q,
                       const void *k, const void *v, const void *out, const float *lse,
                       const int32_t *cu_seqlens, int B, int N, int Hq, int Hkv, int D, float scale);

// Paged KV cache. A cache holds n_slots = n_blocks * block_size token slots: k_cache, v_cache (n_slots, Hkv, D).
// Writes token i's k, v (N, Hkv, D) to slot slot_mapping[i] (a negative slot skips the token).
void ops_kv_cache_store(OpsCtx *ctx, void *k_cache, void *v_cache, const void *k, const void *v,
                        const int32_t *slot_mapping, int N, int Hkv, int D);
// Inference attention through block tables (prefill chunks and decodes alike): query token i belongs to
// sequence token_seq[i] at position token_pos[i] and attends to that sequence's positions 0..token_pos[i],
// whose k/v live at slot block_tables[token_seq[i] * max_blocks + pos / block_size] * block_size + pos % block_size.
// q, out (N, Hq, D); block_tables (n_seqs, max_blocks).
void ops_attention_paged_fwd(OpsCtx *ctx, void *out, const void *q, const void *k_cache, const void *v_cache,
                             const int32_t *block_tables, const int32_t *token_seq, const int32_t *token_pos,
                             int N, int Hq, int Hkv, int D, int block_size, int max_blocks, float scale);
// A decode step's attention from the fused q|k|v projection: the values of
//   ops_qkv_rope_store_fwd(q, k_cache, v_cache, slot_mapping, qkv, token_pos, inv_freq, ...) then
//   ops_attention_paged_fwd(out, q, k_cache, v_cache, block_tables, token_seq, token_pos, ...),
// for calls where every token with a slot (slot_mapping[i] >= 0) is its sequence's only token in the call and its
// slot is the one the block table gives its position (a decode step: the CUDA backend folds the split, RoPE and the
// store into the attention kernel, whose blocks each read only their own token's new row). q (N, Hq, D) is scratch
// that receives the turned q where the backend materialises it.
void ops_attention_paged_decode_fwd(OpsCtx *ctx, void *out, void *q, void *k_cache, void *v_cache,
                                    const int32_t *slot_mapping, const void *qkv, const int32_t *block_tables,
                                    const int32_t *token_seq, const int32_t *token_pos, const float *inv_freq, int N,
                                    int Hq, int Hkv, int D, int block_size, int max_blocks, float scale);

// ---- MLP --------------------------------------------------------------------------------------

// out (N, inner) = silu(gu[:, :inner]) * gu[:, inner:] ; gu (N, 2*inner) is the fused [gate | up] projection.
void ops_swiglu_fwd(OpsCtx *ctx, void *out, const void *gu, int N, int inner);
// dgu (N, 2*inner) overwritten.
void ops_swiglu_bwd(OpsCtx *ctx, void *dgu, const void *dout, const void *gu, int N, int inner);

// ---- log-softmax, per-token logprobs, cross-entropy -------------------------------------------

// For each row n of logits (N, V), with z = logits * inv_temperature:
//   lse[n] = logsumexp(z), logprobs[n] = z[targets[n]] - lse[n], entropy[n] = -sum softmax(z) log softmax(z).
// targets[n] < 0 marks an ignored row: logprobs[n] = 0 (lse and entropy still computed).
// entropy may be NULL. Cross-entropy of a row is -logprobs[n] (inv_temperature 1).
void ops_logprobs_fwd(OpsCtx *ctx, float *logprobs, float *lse, float *entropy, const void *logits,
                      const int32_t *targets, int N, int V, float inv_temperature);
// dlogits (N, V) overwritten with the gradient of sum_n dlogprobs[n] logprobs[n] + dentropy[n] entropy[n]:
//   inv_temperature * (dlogprobs[n] (onehot(targets[n]) - p) - dentropy[n] p (log p + entropy[n])),  p = softmax(z[n])
// The logprob term is zero for ignored rows. dentropy (N) may be NULL (no entropy term); entropy (N) is the
// forward's (read only when dentropy is given). dlogits may be logits itself (the gradient replaces the logits in
// place); otherwise the two must not overlap.
void ops_logprobs_bwd(OpsCtx *ctx, void *dlogits, const float *dlogprobs, const float *dentropy, const float *entropy,
                      const void *logits, const int32_t *targets, const float *lse, int N, int V,
                      float inv_temperature);

// ---- sampling (the rollout server's next-token choice) -------------------------------------

// Temperatures below this pick the argmax (vLLM's epsilon: logits / T would overflow).
#define OPS_SAMPLE_GREEDY_BELOW 1e-5f

// What one sample asks for (an array of these lives in backend memory, one per sample).
typedef struct {
    double u;                  // the draw's uniform in [0, 1): the caller's counter-based generator
    float temperature;         // < OPS_SAMPLE_GREEDY_BELOW: greedy argmax
    float top_p;               // >= 1: off
    float min_p;               // <= 0: off
    float repetition_penalty;  // 1: off
    int32_t top_k;             // <= 0 or >= V: off
    int32_t logits_row;        // the row of `logits` this sample reads (several samples may share a row)
    int32_t mask_mode;         // OPS_SAMPLE_MASK_*: which ids may be drawn (0: all)
    int32_t n_mask;            // ids in mask
    const int32_t *mask;       // (n_mask) ids in backend memory, like params (repeats and ids outside [0, V) are
                               // ignored); NULL when n_mask is 0
} OpsSampleParams;

// What OpsSampleParams.mask says. The rollout server's min_tokens, bad_words and allowed_token_ids (vLLM's logits
// processors) come down to one of these per sample and step.
enum {
    OPS_SAMPLE_MASK_NONE = 0,   // every id may be drawn
    OPS_SAMPLE_MASK_BAN = 1,    // the ids in mask may not
    OPS_SAMPLE_MASK_ALLOW = 2,  // only the ids in mask may
};

// One token per sample s in [0, n) (r = params[s].logits_row, x = the row's logits; the host reference is
// kernels/cpu/cpu_sample.c):
//   logprobs[s] = log_softmax(x / T)[tokens[s]] of the raw logits (T = 1 when greedy), before penalty and filters;
//   repetition penalty (Hugging Face) on each distinct id of history[history_offsets[s] .. history_offsets[s+1])
//     (ids outside [0, V) are skipped, repeats count once);
//   the mask: every id it forbids gets the penalised logit -inf (vLLM's allowed_token_ids / bad words / min-tokens
//     processors), so it is never drawn, greedy included; the reported logprob stays the raw one above;
//   greedy: argmax of the penalised logits (ties: lowest id); otherwise z = penalised x / T, then min-p (drop
//     p < min_p * p_max), top-k (keep the k largest and any tied with the k-th), top-p (keep a token while the
//     mass ranked above it, ties ranked by id, is below top_p of the survivors; the top token always stays),
//     then the inverse CDF of u over the kept tokens in id order.
// logits (n_rows, V) storage dtype; params (n); history_offsets (n + 1) into history (n_history), or NULL for no
// history; tokens, logprobs (n). A sample's result depends only on its own row, parameters and history (not on
// the other samples), and is reproducible run to run. A row with nothing to choose from (every logit -inf
// or masked, or min_p > 1) gives id 0. A logits_row outside [0, n_rows) gives token -1 and logprob NaN (params live
// in backend memory, where the host cannot look before the op runs). cpu: kernels/cpu/cpu_sample.c; cuda: one
// block per sample, no sort (kernels/cuda/cuda_sample.cu).
void ops_sample_rows(OpsCtx *ctx, int32_t *tokens, float *logprobs, const void *logits, const OpsSampleParams *params,
                     const int32_t *history, const int32_t *history_offsets, int n, int n_rows, int V, int n_history);

// ---- optimizer --------------------------------------------------------------------------------

// AdamW exactly as torch.optim.AdamW (decoupled weight decay, bias-corrected), on n fp32 elements:
//   master *= 1 - lr * weight_decay
//   m = beta1 m + (1 - beta1) g ;  v = beta2 v + (1 - beta2) g^2      with g = grad * grad_scale
//   master -= (lr / (1 - beta1^step)) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
// step counts from 1. param_out (n, storage dtype) receives the updated master when not NULL.
void ops_adamw_step(OpsCtx *ctx, float *master, float *m, float *v, const float *grad, void *param_out, size_t n,
                    float lr, float beta1, float beta2, float eps, float weight_decay, int step, float grad_scale);

// *out (one fp32 in backend memory) += sum of grad[i]^2 over n fp32 elements (global-norm clipping).
void ops_sum_squares(OpsCtx *ctx, float *out, const float *x, size_t n);

// ---- sums across the tensor-parallel shards of one process ------------------------------------
// The shards of a tensor-parallel engine are threads of one process, one context each (rollout_server/
// runner_shards.c), so each can read the others' memory: cuda through peer access between their devices (NVLink)
// or on one device, cpu in the shared address space. A decode step adds each layer's partial sums over the shards
// twice, a few rows of hidden_size elements each time, where a collective library's fixed cost per call is most of
// the time; this sum is one kernel on the shard's own stream instead (recordable in a graph), after
// dev/cuda/allreduce_p2p.cu.
//   One call on shard `rank` (every shard makes it, the same count, in the same order):
//   1. copies x into its exchange buffer of parity e & 1 (e: the call's epoch, the shard's count of calls; cuda: per
//      block of the kernel, kept in device memory so that a replayed graph needs no new argument);
//   2. publishes e in every other shard's flag slot for it (a release store), then waits until every other
//      shard's slot for it holds an epoch >= e (an acquire load; a shard may already be one call ahead);
//   3. x = residual + the sum over shards 0..n-1 of their buffers, in that order, accumulated in fp32 and rounded
//      once to the storage dtype: every shard gets the same bits.
// Two buffers by parity make one wait a call enough: a shard writes buffer p again only at call e + 2, after every
// other shard published e + 1, which each does only after its reads of call e.
// A shard that waits longer than the group's timeout for another gives up and records an error in its context
// naming the late shard (cuda: a fault, turned into the error at the next synchronization), instead of hanging.
#define OPS_PEER_MAX 8
#define OPS_PEER_BLOCKS 32   // the cuda kernel's blocks: flag slots and epochs are kept per block
typedef struct OpsPeerGroup OpsPeerGroup;
// Makes the group of n (2..OPS_PEER_MAX) contexts of one backend, from one thread, with two exchange buffers of
// capacity storage elements per shard (allocated on the shard's context) and enables peer access between the
// devices (cuda). Returns 0, or -1 with a message in err (devices that cannot reach each other, out of memory).
int ops_peer_group_create(OpsPeerGroup **out, OpsCtx *const *ctxs, int n, size_t capacity, double timeout_s,
                          char *err, size_t err_len);
void ops_peer_group_destroy(OpsPeerGroup *g);
size_t ops_peer_group_capacity(const OpsPeerGroup *g);
// x (count storage elements, on shard rank's context) = residual (count; NULL: nothing) + the sum of every shard's
// x, as above. count <= capacity; x and residual are 16-byte aligned. Queued on shard rank's context (cuda) or done
// on return (cpu), by shard rank's own thread.
void ops_peer_all_reduce(OpsPeerGroup *g, int rank, void *x, const void *residual, size_t count);

// ---- graphs (CUDA graphs: a recorded sequence of ops replayed with one launch) ----------------

// A graph records the ops the calling thread queues on a context between ops_graph_begin and ops_graph_end; they do
// not run then. ops_graph_launch replays them on the context's stream, in order with the ops around it. Everything
// the ops were given is frozen into the graph: buffer pointers, shapes, scalars, parameter pointers. To replay with
// new inputs, write them into the same buffers before the launch; to change a shape or a pointer, record again.
// Recording is only sound for ops whose sizes come from their arguments or from backend memory (never from host
// values that change between replays). Ops that would allocate (stream scratch, ops_malloc), free, synchronize or
// copy between host and backend record an error during a capture instead: run the same ops once eagerly before
// recording so that every lazily made resource (GEMM plans, scratch) exists. Other threads may keep using the
// context's stream (ops_cuda_stream) and allocating while one thread records: the recording goes to a private stream
// and nothing they queue lands in it (CUDA may still invalidate the recording when another thread synchronizes on
// the same device; ops_graph_end then fails cleanly and the recording can be made again).
// cpu: no graphs; ops_graph_begin returns OPS_GRAPH_UNSUPPORTED and callers run their ops eagerly.
#define OPS_GRAPH_UNSUPPORTED (-2)

typedef struct OpsGraph OpsGraph;

// 1 when this context can record graphs: cuda, without per-op profiling (profile_ops times each op with events,
// which a replay would not reproduce). 0 otherwise.
int ops_graph_supported(OpsCtx *ctx);
// Starts recording. Returns 0, OPS_GRAPH_UNSUPPORTED (nothing started, no error recorded), or the context's
// error code (an earlier error, or one starting the capture).
int ops_graph_begin(OpsCtx *ctx);
// Ends the recording that ops_graph_begin started (always call it after a 0 from begin, even when an op failed in
// between: it ends the capture). On success *graph is an executable graph: a new one when *graph was NULL,
// else *graph updated in place when the recording has the same structure (cheaper than a new one), or replaced.
// Returns 0, or the context's error code (an op failed while recording, or the capture failed); *graph is then
// left as it was.
int ops_graph_end(OpsCtx *ctx, OpsGraph **graph);
// Queues one replay of graph on the context's stream. Returns 0 or the context's error code.
int ops_graph_launch(OpsCtx *ctx, OpsGraph *graph);
// Frees the graph (a replay still in flight completes first). NULL is ignored.
void ops_graph_destroy(OpsCtx *ctx, OpsGraph *graph);

#ifdef __cplusplus
}
#endif
#endif
