// rollout_server/model_runner_internal.h — the runner's state, shared by model_runner.c (steps, sampling, weights,
// set-up) and runner_shards.c (the tensor-parallel shards' threads). Not a public API: the engine sees
// model_runner.h only.
//
// Tensor parallelism: a runner over --tensor-parallel-size N holds N shards, shard k on device cfg->device + k, each
// with its compute context, its slice of the weights (shared/model.h, "tensor-parallel shards"), its KV pool (its KV
// heads of every block: the same block ids name the same token slots on every shard) and its step buffers. One
// thread per shard, driven in lock-step: the engine thread runs shard 0 itself and hands the same step to shards
// 1..N-1, whose threads wait for it (runner_shards_run); the shards' all-reduces inside the model meet over their
// communicator. Why a thread per shard and not one thread queueing on N devices: every collective of a shard is
// queued from the thread that owns the shard's communicator, and with the host communicator (the CPU twin) a
// collective blocks until every shard has called it, so one thread could not call it on N shards in turn. Sampling
// and top logprobs run on shard 0 over the whole vocabulary (its logits rows are gathered from every shard). N = 1
// is the plain runner: one shard, no thread, no communicator.
#ifndef TANDEM_ROLLOUT_MODEL_RUNNER_INTERNAL_H
#define TANDEM_ROLLOUT_MODEL_RUNNER_INTERNAL_H

#include <pthread.h>

#include "rollout_server/model_runner.h"
#include "shared/comm/comm.h"
#include "shared/ipc_region.h"
#include "shared/model_lora.h"

// What the shards run together (runner_shards_run).
typedef enum {
    SHARD_JOB_NONE = 0,
    SHARD_JOB_JOIN,    // make the shards' communicator (every shard joins at once)
    SHARD_JOB_STEP,    // the step in the runner's step arrays (RunnerStepPlan)
    SHARD_JOB_SCORE,   // the logits rows of the step's scored tokens (score_rows), in chunks
    SHARD_JOB_EXIT,
} ShardJob;

// The step every shard runs: the model over the runner's step arrays (tok_ids ... rows), see run_model.
typedef struct {
    int n, n_seqs, mb, n_rows;
    int padded;        // a decode-only step at its padded size (model_decode_step_padded)
} RunnerStepPlan;

typedef struct RunnerShard {
    struct ModelRunner *runner;     // its runner, and its index there (the shard thread's argument)
    int index;
    OpsCtx *ops;
    Model m;
    int have_model;
    ResidentWeights w;
    int have_weights;
    UnitSource src;
    KVCache kv;
    DecodeBufs *bufs;
    Comm *comm;         // the shards' communicator (N > 1)
    void **dstaging;    // (n_units of the shard's layout) transport nccl: the second copy of each unit on this
                        // shard's device (storage dtype), made on first use, that the shard's receiver fills
    IpcRegion ipc[2];   // transport ipc (runner_ipc.c): two regions other processes map, each holding every unit
    size_t *ipc_offsets;// (n_units) at these byte offsets; the live weights and the staging take turns in them
    pthread_t thread;   // shards 1..N-1
    int have_thread;
    int rc;             // the last job's result, and its message
    char err[768];
} RunnerShard;

struct ModelRunner {
    int tp;                         // shards (--tensor-parallel-size)
    RunnerShard *shards;            // (tp)
    struct OpsPeerGroup *peers;     // tp > 1: the shards' peer group for small sums (NULL: the communicator only)
    OpsCtx *ops;                    // shard 0's context: sampling, the weight receiver's staging
    Model whole;                    // tp > 1: the whole model (config, layout) that weight updates address
    int have_whole;
    int block_size, max_num_seqs, max_num_batched_tokens, max_blocks, n_blocks, V;
    // Step arrays (host): one entry per token of the step, max_num_batched_tokens of them ...
    int32_t *tok_ids, *tok_seq, *tok_pos, *slots;
    int32_t *tables;                // (max_num_seqs, max_blocks) room for the block tables of the step's sequences,
                                    // filled as (n_seqs, the step's longest table)
    int32_t *rows;                  // (max_num_seqs) step token index of each logits row
    // Scored tokens of the step (RunnerSeq.score_*): step token index, its sequence, its position.
    int32_t *score_rows, *score_seq, *score_pos;   // (max_num_batched_tokens)
    int n_score;
    const RunnerSeq *step_seqs;     // the step's sequences while it runs
    float *logits;                  // (max_num_seqs, V) host copies of the logits rows that top logprobs need
    // Sampling: one entry per sample. Arrays grow on demand: samp_cap samples, hist_cap history ids, mask_cap mask
    // ids.
    int samp_cap, hist_cap, mask_cap;
    OpsSampleParams *samp_params;   // (samp_cap) host
    int32_t *samp_off;              // (samp_cap + 1) host: history offsets (histories of penalised samples only)
    int32_t *samp_hist;             // (hist_cap) host
    int32_t *samp_mask;             // (mask_cap) host: the masked samples' ids one after the other ...
    int samp_n_mask;                // ... this many for the step
    int32_t *samp_tok;              // (samp_cap) host: sampled ids
    float *samp_lp;                 // (samp_cap) host: their logprobs
    TokenLogprob *samp_top;         // (samp_cap, ENGINE_MAX_TOP_LOGPROBS) host: alternatives
    OpsSampleParams *d_params;      // backend copies of the above
    int32_t *d_off, *d_hist, *d_tok, *d_mask;
    float *d_lp;
    int64_t graph_logged;           // decode graph recordings + failures already logged (log_graphs)
    // LoRA adapters (runner_adapters.c): adapters[0] the policy's (or NULL), adapters[1..n_adapters] the --lora ones
    // with their names; lora_rows is shard 0's m.lora_rows (tp is 1 whenever there are adapters).
    struct ModelLora **adapters;    // (n_adapters + 1)
    char **adapter_names;           // (n_adapters + 1), [0] NULL
    int n_adapters;
    ModelLoraRows lora_rows;
    // Adapter updates merged into the served weights (not adapter_updates_lowrank): the base's decoder-layer units
    // as they were before the first merge ((n_units), NULL for the others; all NULL when no merged adapter is live).
    int adapter_updates_lowrank;
    void **adapter_base;
    // The adapter update being committed, one unit per decoder layer in the storage dtype (model_lora.h adapter
    // units of adapter_staging_numel elements): received there over NCCL, or uploaded from the host units of a zmq
    // update (runner_adapter_device_staging).
    void **adapter_staging;
    size_t adapter_staging_numel;
    // Kept between merged adapter updates of one config (a commit then allocates nothing): the adapters' layout and
    // the merge's scratch.
    struct ModelLora *merge_lora;
    void *merge_scratch;
    int lowrank_fallback_logged;
    // Lock-step driving of shards 1..tp-1 (runner_shards.c).
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    int have_sync;
    uint64_t job_seq;               // bumped per job; a shard thread runs each one once
    ShardJob job;
    RunnerStepPlan plan;
    int pending;                    // shard threads still running the current job
    CommBackend comm_backend;
    uint8_t comm_id[COMM_UNIQUE_ID_BYTES]; // the shards' communicator's id (nccl's, or a loopback host rendezvous)
    int comm_timeout_ms;
};

// Room for n samples, nh history ids and nm mask ids, host and backend (model_runner.c). Returns 0 or -1 (out of
// memory).
int runner_samp_reserve(ModelRunner *r, int n, int64_t nh, int64_t nm);
// Runs shard k's part of the current plan (the model over the step arrays). Returns 0 or -1 (message in the
// shard's err).
int runner_shard_step(ModelRunner *r, int k);
// Shard k's part of scoring: the logits of every scored token, chunk by chunk; shard 0 turns each row into the
// token's logprob, rank and alternatives. Returns 0 or -1 (message in the shard's err).
int runner_shard_score(ModelRunner *r, int k);
// Starts the threads of shards 1..tp-1 and makes the shards' communicator. Returns 0, or an ENGINE_* code with a
// message.
int runner_shards_start(ModelRunner *r, char *err, size_t err_len);
// Runs `job` on every shard at once: shard 0 on the calling thread, the others on theirs; returns when all are
// done: 0, or -1 with the first failing shard's message.
int runner_shards_run(ModelRunner *r, ShardJob job, char *err, size_t err_len);
// Stops and joins the shard threads (before the shards are freed).
void runner_shards_stop(ModelRunner *r);
// Loads the --lora adapters of cfg onto shard 0 and sizes the step scratch (runner_adapters.c). Returns 0 or an
// ENGINE_* code with a message naming the adapter.
int runner_adapters_load(ModelRunner *r, const EngineConfig *cfg, char *err, size_t err_len);
void runner_adapters_free(ModelRunner *r);

// ---- runner_ipc.c -------------------------------------------------------------------------------------------
// Before a shard's teardown frees its weights and staging: forgets the units that live in its ipc regions (they
// are not ops_malloc's), then closes the regions. Call with the shard's context still alive.
void runner_ipc_release(RunnerShard *s);
// The step's adapter row ranges from its sequences (the step arrays hold seqs[i]'s n_sched rows in order) into
// shard 0's m.lora_rows. Returns the number of ranges (0: the base model alone).
int runner_adapter_ranges(ModelRunner *r, const RunnerSeq *seqs, int n_seqs);

#endif
