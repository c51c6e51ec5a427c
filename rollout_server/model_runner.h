// rollout_server/model_runner.h — the model runner: what runs an engine step on the compute device (nano-vllm's
// ModelRunner). The engine (engine.c) decides what a step holds — admission, the scheduler's plan, forks, events,
// aborts, pause and weight commits — and hands the runner the step's sequences and samples; the runner gives back
// one token and logprob per sample. Everything on the device side is the runner's: the compute context, the model
// and its resident weights (and the second copy an NCCL update is received into), the paged KV cache (sized from
// the memory budget and allocated here), the step workspace (token, slot and block-table arrays, DecodeBufs), the
// choice between replaying a CUDA graph, a padded eager decode and an unpadded step, and sampling on the device
// (ops_sample_rows) with the host logits rows that top logprobs need.
//
// Owned by the engine thread: every call comes from it, except runner_weights_device_staging and
// runner_weights_device_missing (a receiving thread, under the engine's mutex; see there) and runner_ops.
//
// Tensor parallelism (EngineConfig.tensor_parallel_size > 1): one runner over N shards (model_runner_internal.h):
// runner_model describes the whole model (the layout weight updates address), runner_num_blocks is the count every
// shard's pool holds, runner_copy_kv_rows copies on every shard, runner_step runs the step on every shard and samples
// on shard 0, runner_ops is shard 0's context, and every shard has its own device staging (its slice of each unit,
// filled by its own NCCL receiver). The engine and everything above it know only the staging's shards.
#ifndef TANDEM_ROLLOUT_MODEL_RUNNER_H
#define TANDEM_ROLLOUT_MODEL_RUNNER_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/ops.h"
#include "rollout_server/engine.h"
#include "shared/ipc_region.h"
#include "shared/model.h"

typedef struct ModelRunner ModelRunner;
struct LoraConfig;   // shared/model_lora.h

// One sequence of a step, as the scheduler planned it.
typedef struct {
    const int32_t *tokens;  // its ids, prompt then generated (at least n_computed + n_sched of them)
    int n_computed;         // leading tokens whose K/V are in the cache
    int n_sched;            // this step computes tokens [n_computed, n_computed + n_sched), >= 1
    const int32_t *blocks;  // (n_blocks) the physical KV block of each of its logical blocks; covers every token
    int n_blocks;           // the step writes
    int n_samples;          // samples drawn from the logits of token n_computed + n_sched - 1, which must then be
                            // its last token (0: a prefill chunk with more of the prompt to come). A fork's first
                            // token is several samples of one row.
    // Scoring (prompt logprobs): each computed position p < score_until writes, for token p + 1, its logprob
    // (log_softmax of the raw logits of p) to score_lp[p + 1], its rank among all ids to score_rank[p + 1] and the
    // score_top best alternatives to score_alts[(p + 1) * score_top ...]. score_until 0: nothing scored.
    int score_until, score_top;
    float *score_lp;
    int32_t *score_rank;
    TokenLogprob *score_alts;
    int adapter;            // SamplingParams.adapter: 0 the policy, k >= 1 the k-th --lora adapter
} RunnerSeq;

// One sample: the next token of one completion.
typedef struct {
    OpsSampleParams p;        // what to draw (kernels/ops.h); p.logits_row is set by the runner, and p.mask (host
                              // ids, p.n_mask of them) is copied to backend memory by it
    const int32_t *history;   // (n_history) ids the repetition penalty applies to; NULL when the penalty is off
    int n_history;
    int top_logprobs;         // alternatives to report, 0..ENGINE_MAX_TOP_LOGPROBS
} RunnerSample;

// What a step gave. Pointers stay valid until the next runner_step.
typedef struct {
    const int32_t *tokens;    // (n_samples) sampled ids, in [0, V)
    const float *logprobs;    // (n_samples) log_softmax(logits / T)[token] (EngineEvent.logprobs)
    const TokenLogprob *top;  // (n_samples, ENGINE_MAX_TOP_LOGPROBS): sample k's first top_logprobs entries are
                              // its alternatives, best first (its logprob then comes from the same host row)
    int kind;                 // ENGINE_STEP_*, or -1 when the step failed before it reached the model
    double compute_seconds;   // in the model and sampling calls (backend work and issuing it)
} RunnerOutput;

// Starts the compute context of cfg->backend / cfg->device, loads the model from cfg->model_dir, sets up the step
// workspace and the decode graphs, sizes the KV pool (cfg->kv_cache_bytes, or what --gpu-memory-utilization
// leaves) and allocates it. Returns 0, or an ENGINE_* code with a message that says what to change.
int runner_create(ModelRunner **out, const EngineConfig *cfg, char *err, size_t err_len);
void runner_free(ModelRunner *r);

// The model as loaded (config, layout: what weight updates address). Valid until runner_free.
const Model *runner_model(const ModelRunner *r);
// KV blocks in the pool (block ids 0..n-1, cfg->block_size tokens each).
int runner_num_blocks(const ModelRunner *r);
// Shard 0's compute context: sampling, and where shard 0's device staging lives (runner_shard_ops gives the others').
OpsCtx *runner_ops(ModelRunner *r);

// Runs one step: seqs (n_seqs <= max_num_seqs, at most max_num_batched_tokens scheduled tokens in all) in step
// order, and the samples of each sequence with n_samples > 0, in the same order, n_samples in all. Writes every
// scheduled token's K/V into its block and samples on the device. Returns 0 with *out filled, or -1 with a
// message (out of memory for the samples, a backend failure: the step's K/V writes are then undefined).
int runner_step(ModelRunner *r, const RunnerSeq *seqs, int n_seqs, const RunnerSample *samples, int n_samples,
                RunnerOutput *out, char *err, size_t err_len);

// Copies the first `rows` token rows of block src into block dst, in every layer's K and V: the block manager's
// copy-on-write of a shared partial block (BmCopyRows; user is the runner).
void runner_copy_kv_rows(void *user, int32_t dst, int32_t src, int rows);

// ---- LoRA adapters (rollout_server/runner_adapters.c) ---------------------------------------------------
// Adapter k of the runner: 0 the policy's (NULL until an adapter update is committed), 1..n the --lora ones loaded
// at runner_create. A step's sequences run through their RunnerSeq.adapter's (the rows of a run of consecutive
// sequences with one adapter form one range, m->lora_rows); a decode step whose rows all run through one adapter
// is padded and replayed as a CUDA graph like the base's, other steps with adapter rows run unpadded.
int runner_adapter_count(const ModelRunner *r);             // n (the --lora ones)
const char *runner_adapter_name(const ModelRunner *r, int k);   // k in 1..n
// An adapter update: the policy's adapter becomes config c with the units of layer l (model_lora_unit_numel elements
// each) taken from host[l] (fp32, rounded to the storage dtype on upload), or, with host NULL, from the device
// staging (runner_adapter_device_staging, filled by an NCCL receive), replacing the previous adapter. Returns 0, or
// -1 with a message (the previous adapter stays).
int runner_set_policy_adapter(ModelRunner *r, const struct LoraConfig *c, float *const *host, char *err,
                              size_t err_len);
// Layer `layer`'s unit of the device staging for adapter units of unit_numel elements (storage dtype, the runner's
// device), allocated on first use (all layers' units are dropped when unit_numel changes); NULL when the layer is
// out of range or there is no device memory for it.
void *runner_adapter_device_staging(ModelRunner *r, size_t unit_numel, int layer);
// A whole-weights update: the policy is the new weights alone.
void runner_drop_policy_adapter(ModelRunner *r);

// ---- weights --------------------------------------------------------------------------------------------
// Uploads host units in the weights' storage dtype (units[u] holds layout.unit_numel[u] values: bf16 bits, copied as
// they are, or fp32; NULL leaves unit u as it is) into the live weights and waits for the device. Returns 0, or -1
// with a message (the weights may then be partly updated).
int runner_upload_weights(ModelRunner *r, void *const *units, char *err, size_t err_len);
// The tensor-parallel shards (1: none), shard k's model (its config, layout and place in the whole model:
// ModelShard) and compute context. Shard 0's context is runner_ops.
int runner_tp(const ModelRunner *r);
const Model *runner_shard_model(const ModelRunner *r, int shard);
OpsCtx *runner_shard_ops(ModelRunner *r, int shard);
// Transport nccl: the second copy of shard `shard`'s unit `unit` on its device (storage dtype, the shard layout's
// unit_numel elements, zero-filled when made) that a receiver fills, made on first use; NULL when out of device
// memory (or out of range). Called from other threads: the engine serialises these calls with its mutex, and never
// runs them during runner_swap_device_weights.
void *runner_weights_device_staging(ModelRunner *r, int shard, int unit);
// Transport ipc (rollout_server/weight_ipc.h): makes shard `shard`'s device staging (the copies above) live in a
// region of memory that other processes of the host can map (shared/ipc_region.h: CUDA IPC on GPUs, POSIX shared
// memory on the CPU), every unit at ipc_unit_offsets, and returns that region; NULL with a message when it cannot be
// made. Two regions per shard take turns: the staging goes into the one that does not hold the live weights (after
// a swap the live weights are in the region the update was written into), made on first use; the staging copies
// ops_malloc made before are freed, as are the live weights' first copies once they have been swapped out. The
// regions last as long as the runner. Same threading as runner_weights_device_staging.
const IpcRegion *runner_weights_ipc_staging(ModelRunner *r, int shard, char *err, size_t err_len);
// The first unit without a device staging copy (its shard in *shard), or -1 when every unit of every shard has one.
int runner_weights_device_missing(const ModelRunner *r, int *shard);
// Swaps every shard's units with their device staging copies (pointers only; the old weights receive the next
// update) and checks the devices. Returns 0, or -1 with a message.
int runner_swap_device_weights(ModelRunner *r, char *err, size_t err_len);

#endif
